"""Atomic file writes for run folders (the folder layout and the cell store: icl_bench/cellstore.py).

Every file is written to a uniquely named temporary file in the same folder, flushed and fsynced,
renamed over its final name (atomic on POSIX), and then the folder itself is fsynced so that the
rename survives a power cut. A reader therefore sees either the old complete file or the new
complete file. Temporary files left by a killed run are removed when the folder is next locked.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no cross-process lock (single-writer use is then the user's job)
    fcntl = None

LOCK_NAME = ".icl-bench.lock"
CONFIG_NAME = "config.json"  # the run's config, written first: --resume checks it
TMP_SUFFIX = ".tmp"
FINAL_FILES = ("results.parquet", "results.csv", "metadata.json")


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


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` by `data` atomically: unique temp file, fsync, rename, fsync of the folder."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}{TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
    try:
        with os.fdopen(fd, "wb") as f:
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
