"""Files the suite writes: atomic replacement and the one JSON policy.

Every file is written to a uniquely named temporary file in the same folder, flushed and fsynced,
renamed over its final name (atomic on POSIX) and the folder fsynced, so a reader sees either the
old complete file or the new complete file (docs/design.md, "Crash safety").

JSON is standard JSON (RFC 8259) everywhere: NaN and +-inf are written as null, numpy / torch
scalars as numbers, tuples as lists. Readers turn null back into NaN where a column is numeric
(bench/axes.py holds the result schema that says which).
"""
from __future__ import annotations

import errno
import json
import math
import os
import secrets
import tempfile
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from icl_bench.errors import ConfigError

try:
    import fcntl
except ImportError:  # not POSIX: folder_lock runs its block unlocked
    fcntl = None

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


@contextmanager
def folder_lock(path: str | Path, *, shared: bool = False):
    """Hold an flock on folder `path` for the `with` block: exclusive for a writer that renames
    several files into place (a checkpoint pair), shared for a reader of such a set, so a reader
    never sees one writer's file beside another's and two writers never interleave their renames.
    The kernel releases it if the process dies. Where the folder cannot be opened or takes no
    flock (some network file systems), the block runs unlocked, as it did before locks existed."""
    try:
        fd = os.open(path, os.O_RDONLY) if fcntl is not None else None
    except OSError:
        fd = None
    if fd is None:
        yield
        return
    try:
        with suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


def temp_path(path: str | Path) -> Path:
    """A new unique temporary name beside `path`: `.<name>.<pid>-<hex>.tmp` (write_atomic's)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}{TMP_SUFFIX}")


def fsync_file(path: str | Path) -> None:
    """Flush the contents of the file `path` (written by someone else, e.g. a library) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def discard(*paths: str | Path | None) -> None:
    """Remove each file of `paths` that exists (None: skipped); an error is ignored (cleanup only)."""
    for p in paths:
        if p is not None:
            with suppress(OSError):
                os.unlink(p)


def first_existing(path: str | Path) -> Path | None:
    """The nearest of `path` and its parents that exists: what `drop_made_folders` stops at."""
    return next((p for p in (Path(path), *Path(path).parents) if p.exists() or p.is_symlink()), None)


def drop_made_folders(folder: str | Path, made: Path | None) -> None:
    """Remove `folder` and its parents up to (not including) `made` (first_existing before the command
    made them), each only while it is an empty folder: a command that saved nothing leaves none of the
    folders it made behind. An error is ignored (cleanup only)."""
    for p in (Path(folder), *Path(folder).parents):
        if p == made or p.is_symlink() or not p.is_dir() or any(p.iterdir()):
            break
        with suppress(OSError):
            p.rmdir()


def write_temp(path: str | Path, data: bytes, *, mode: int | None = None) -> Path:
    """Write `data` to a new temp_path(path), flushed and fsynced, and return that name: the first
    half of write_atomic, for a caller that renames several files into place in its own order.
    The temp file is removed if the write fails (an OSError naming `path`: e.g. the disk is full)."""
    tmp = temp_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
    try:
        with os.fdopen(fd, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as exc:
        discard(tmp)
        if isinstance(exc, OSError) and exc.errno is not None:  # named as `path`, not as the hidden temp file
            raise OSError(exc.errno, exc.strerror, str(path)) from None  # (a write's own error names no file)
        raise
    return tmp


def write_atomic(path: str | Path, data: bytes, *, mode: int | None = None) -> None:
    """Replace `path` by `data` atomically: unique temp file, fsync, rename, fsync of the folder.

    The temp file is `.<name>.<pid>-<hex>.tmp` beside `path` (write_temp); it is removed if the
    write fails.
    `mode`: permission bits of the new file (e.g. those of the file it replaces); None: 0o666
    less the umask, as for open().
    Raises:
        OSError: the folder is missing or not writable (nothing is left behind).
    """
    path = Path(path)
    tmp = write_temp(path, data, mode=mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        discard(tmp)
        raise
    fsync_dir(path.parent)


def blocking_file(path: str | Path) -> Path | None:
    """The first folder above `path` that exists as something other than a folder (so `path`
    cannot be created), or None."""
    return next((p for p in Path(path).parents if p.exists() and not p.is_dir()), None)


def link_loop(path: str | Path) -> str | None:
    """Why `path` cannot be used when it, or a folder above it, is a symbolic link loop (links that
    lead in a circle: stat fails with ELOOP), naming the outermost such link; else None. (exists()
    and is_dir() read a loop as a missing file; Path.resolve raises RuntimeError for it.)"""
    path = Path(path)
    for p in reversed((path, *path.parents)):
        try:
            os.stat(p)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                target = f"a link to {os.readlink(p)}, " if p.is_symlink() else ""
                return f"{p} is a symbolic link loop ({target}whose links lead in a circle)"
    return None


def refuse_link_loop(path: str | Path, flag: str, advice: str = "remove it or choose another folder") -> None:
    """Raise ConfigError "<flag>: <path> is a symbolic link loop (...); <advice>" when link_loop
    finds one in `path`; else nothing (the one check of every command that takes a folder)."""
    why = link_loop(path)
    if why:
        raise ConfigError(f"{flag}: {why}; {advice}")


def name_too_long(*paths: str | Path) -> str | None:
    """Why one of `paths` (files to be written, or their temp_path names) cannot be created for the
    length of its last name, or None: longer in bytes than the nearest existing folder above it takes
    (PC_NAME_MAX; 255 where unknown). For checks before long work, as cannot_create."""
    for path in map(Path, paths):
        folder = next((p for p in path.absolute().parents if p.is_dir()), Path("/"))
        try:
            limit = os.pathconf(folder, "PC_NAME_MAX")
        except (OSError, ValueError, AttributeError):
            limit = 255
        if len(os.fsencode(path.name)) > limit:
            return f"the name {path.name[:40]}... is {len(os.fsencode(path.name))} bytes; {folder} takes at most {limit}"
    return None


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
