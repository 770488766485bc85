"""Files the suite writes: atomic replacement and the one JSON policy.

Every file is written to a uniquely named temporary file in the same folder, flushed and fsynced,
renamed over its final name (atomic on POSIX) and the folder fsynced, so a reader sees either the
old complete file or the new complete file (docs/design.md, "Crash safety").

JSON is standard JSON (RFC 8259) everywhere: NaN and +-inf are written as null, numpy / torch
scalars as numbers, tuples as lists. Readers turn null back into NaN where a column is numeric
(bench/axes.py holds the result schema that says which).
"""
from __future__ import annotations

import json
import math
import os
import secrets
import tempfile
from pathlib import Path
from typing import Any

TMP_SUFFIX = ".tmp"


def fsync_dir(path: Path) -> None:
    """Make the entries of folder `path` (new names, renames) durable; a no-op where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str | Path, data: bytes, *, mode: int | None = None) -> None:
    """Replace `path` by `data` atomically: unique temp file, fsync, rename, fsync of the folder.

    The temp file is `.<name>.<pid>-<hex>.tmp` beside `path`; it is removed if the write fails.
    `mode`: permission bits of the new file (e.g. those of the file it replaces); None: 0o666
    less the umask, as for open().
    Raises:
        OSError: the folder is missing or not writable (nothing is left behind).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}{TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def blocking_file(path: str | Path) -> Path | None:
    """The first folder above `path` that exists as something other than a folder (so `path`
    cannot be created), or None."""
    return next((p for p in Path(path).parents if p.exists() and not p.is_dir()), None)


def cannot_create(path: str | Path) -> str | None:
    """Why no file could be created at `path`, or None: its folder (or, where that is still to be
    made, the nearest existing folder above it) does not take new files: tried with a nameless
    temporary file there, which a read-only mount or /proc refuses even to root (os.access says
    yes to root on /proc). For checks before long work whose result would then be lost."""
    folder = Path(path).absolute().parent
    base = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if base is None or not base.is_dir():
        return f"{base} is not a folder"
    try:
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as exc:
        return f"{base}: {exc.strerror or exc}"
    return None


def jsonable(v: Any) -> Any:
    """`v` with NaN / inf -> None and numpy / torch scalars and arrays -> Python numbers / lists."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if hasattr(v, "tolist") and not isinstance(v, (str, bytes)):  # numpy / torch scalars and arrays
        return jsonable(v.tolist())
    if isinstance(v, Path):
        return str(v)
    return v


def dumps(obj: Any, *, indent: int | None = None, sort_keys: bool = False) -> str:
    """Standard JSON text of `obj` (see the module docstring); never writes NaN or Infinity.

    Raises:
        TypeError: `obj` holds a value JSON cannot represent (after the conversions above).
    """
    return json.dumps(jsonable(obj), indent=indent, sort_keys=sort_keys, allow_nan=False)


def write_json(path: str | Path, obj: Any, *, indent: int | None = 2, sort_keys: bool = False) -> None:
    """Write `obj` as standard JSON to `path` atomically (with a trailing newline)."""
    write_atomic(path, (dumps(obj, indent=indent, sort_keys=sort_keys) + "\n").encode())
