"""The output folder of a run, written so that a crash at any instant loses at most the cell
being computed and never leaves a file that reads as something it is not.

    out/.icl-bench.lock   held (flock) by the one process writing this folder; the kernel
                          releases it when that process ends, however it ends (kill -9 included)
    out/cells/<key>.json  one finished row per cell
    out/results.parquet   the table, written after every cell is done
    out/results.csv       the same table as CSV
    out/metadata.json     written last: a folder whose metadata.json exists holds a finished,
                          consistent run (it is removed before the tables are rewritten)

Every file is written to a uniquely named temporary file in the same folder, flushed and fsynced,
renamed over its final name (atomic on POSIX), and then the folder itself is fsynced so that the
rename survives a power cut. A reader therefore sees either the old complete file or the new
complete file. Temporary files left by a killed run are removed when the folder is next locked.
"""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from icl_bench import provenance
from icl_bench.bench import schema
from icl_bench.errors import ConfigError
from icl_bench.files import TMP_SUFFIX, dumps, fsync_dir, write_atomic

try:
    import fcntl
except ImportError:  # not POSIX: no cross-process lock (single-writer use is then the user's job)
    fcntl = None

LOCK_NAME = ".icl-bench.lock"
CONFIG_NAME = "config.json"  # the run's config, written first: --resume checks it
FINAL_FILES = ("results.parquet", "results.csv", "metadata.json")


def prepare(out: Path, *, resume: bool, config_json: str | None = None):
    """Create / check the output folder and lock it for this process.

    `config_json` (canonical JSON of the run's config) is written to out/config.json; a --resume
    into a folder whose config.json differs, or that has none (not a run folder), is refused, so
    a finished run is never silently replaced by another config's table.

    Returns:
        The open lock file (keep it open for the whole run; closing it releases the lock).
    Raises:
        ConfigError: `out` is a file, cannot be created, holds a run while resume is False, holds
            another config's run (or no run) while resume is True, or is locked by another
            running icl-bench process.
    """
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out: {out} is a file, not a folder")
    if not resume and out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out: {out} is not empty; pass --resume to continue that run or choose another folder")
    saved = out / CONFIG_NAME
    if resume and config_json is not None and out.exists() and any(out.iterdir()):
        if not saved.is_file():
            raise ConfigError(f"--resume: {out} is not an icl-bench run folder (no {CONFIG_NAME}); choose another --out")
        try:
            same = json.loads(saved.read_text()) == json.loads(config_json)
        except (OSError, ValueError):
            same = False
        if not same:
            raise ConfigError(f"--resume: {out} holds a run of another config ({CONFIG_NAME} differs); "
                              "resume it with that config or choose another --out")
    try:
        (out / "cells").mkdir(parents=True, exist_ok=True)
        lock = open(out / LOCK_NAME, "a+b")
    except OSError as exc:
        raise ConfigError(f"--out: cannot write to {out} ({exc.strerror or type(exc).__name__})") from None
    if fcntl is not None:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            raise ConfigError(f"--out: {out} is in use by another icl-bench run; wait for it or choose another folder") from None
    # temp files of a killed writer (we hold the lock: none is live); only names write_atomic makes
    stale = [*(out / "cells").glob(f".*.json.*{TMP_SUFFIX}"),
             *(p for name in FINAL_FILES for p in out.glob(f".{name}.*{TMP_SUFFIX}"))]
    for tmp in stale:
        tmp.unlink(missing_ok=True)
    if config_json is not None and not saved.is_file():
        write_atomic(saved, config_json.encode())
    return lock


def load_cell(path: Path, key: str) -> dict | None:
    """The row stored in `path` for the cell `key` (null read back as NaN in float columns), or
    None when it is absent, truncated, not JSON, written for another cell (another config), lacks
    a column of bench/schema.py or has an unknown status."""
    try:
        row = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    if not isinstance(row, dict) or row.get("_key") != key or set(schema.COLUMNS) - set(row):
        return None
    if row.get("status") not in schema.STATUSES:
        return None
    return schema.from_json(row)


def save_cell(path: Path, key: str, row: dict) -> None:
    """Persist one finished row (atomically), tagged with its cell key."""
    write_atomic(path, dumps({**row, "_key": key}).encode())


def write_results(out: Path, table, meta: dict) -> None:
    """Write results.parquet, results.csv, then metadata.json (the "finished" mark), each atomically.

    metadata.json is removed first, so a crash part-way leaves a folder without it (unfinished,
    resumable), never new tables beside the old run's metadata.
    """
    (out / "metadata.json").unlink(missing_ok=True)
    fsync_dir(out)
    write_atomic(out / "results.parquet", table.to_parquet(index=False))
    write_atomic(out / "results.csv", table.to_csv(index=False).encode())
    write_atomic(out / "metadata.json", (dumps(meta, indent=2) + "\n").encode())


def run_metadata(config, *, started: str, table) -> dict:
    """The metadata.json content of one run of `config` (a MatrixConfig) that produced `table`:
    config, seed, package versions, device, git commit, start / end time, status counts."""
    return {
        "config": config.to_dict(),
        "seed": config.seed,
        "packages": provenance.package_versions(),
        "device": provenance.device_info(),
        "git_commit": provenance.git_commit(),
        "started_at": started,
        "finished_at": datetime.now(timezone.utc).isoformat(),
        "n_cells": int(len(table)),
        "status_counts": {str(k): int(v) for k, v in table["status"].value_counts().items()},
    }
