"""The output folder of a run and its cell store: one SQLite database (WAL mode) instead of one
file per cell, written so that a crash at any instant loses at most the cells in flight and never
leaves a row that reads as something it is not (docs/scale-out.md, "The cell store").

    out/.icl-bench.lock   held (flock) by the one process writing this folder; the kernel
                          releases it when that process ends, however it ends (kill -9 included)
    out/config.json       the run's config, written first: --resume refuses another config
    out/cells.sqlite      table `cells`: one row per finished cell, keyed by the cell key string,
                          holding the cell's *result* columns only (the cell's own fields - solver,
                          N, noise, ... - are rebuilt from the config) and a CRC-32 of them;
                          -wal / -shm beside it while a writer has it open
    out/results.parquet   the table, written after every cell is done
    out/results.csv       the same table as CSV
    out/metadata.json     written last: a folder whose metadata.json exists holds a finished run

Why a crash cannot merge a torn row: every `put` is one SQLite transaction, committed before the
next cell is stored. In WAL mode a commit appends the row's pages to out/cells.sqlite-wal with a
checksum over every frame, then a commit frame; a reader (the next --resume) replays only frames
up to the last intact commit frame, so a transaction cut short by kill -9 or a power cut is simply
absent (https://www.sqlite.org/wal.html, "checksums"). A commit is a write() into the WAL, so it
is in the kernel's page cache before `put` returns: killing the process, kill -9 included, loses
no committed cell. With `synchronous=NORMAL` the WAL is fsynced at checkpoints, not at every
commit (https://www.sqlite.org/pragma.html#pragma_synchronous): a power cut or kernel crash may
roll back the last cells committed before it - they are recomputed by --resume - but never tears
one (an fsync per cell costs 0.25-10 ms on this machine's disk, more than the rest of a trivial
cell). On top of that each row carries a CRC-32 of its values: a row changed behind SQLite's back
(or written by another schema) fails the check and is recomputed, never merged.

The folder-level files (config.json, tables, metadata.json) are written atomically: temp file,
fsync, rename, fsync of the folder (icl_bench/files.py); metadata.json holds standard JSON.
"""
from __future__ import annotations

import errno
import json
import math
import os
import sqlite3
import zlib
from contextlib import closing
from pathlib import Path

from icl_bench.errors import ConfigError
from icl_bench.files import TMP_SUFFIX, dumps, fsync_dir, write_atomic

try:
    import fcntl
except ImportError:  # not POSIX: no cross-process lock (single-writer use is then the user's job)
    fcntl = None

LOCK_NAME = ".icl-bench.lock"
CONFIG_NAME = "config.json"  # the run's config, written first: --resume checks it
STORE_NAME = "cells.sqlite"
DATA_KEY = "data_sha256"  # in config.json beside the config: the sha256 of the CSV prompt source's bytes
FINAL_FILES = ("results.parquet", "results.csv", "metadata.json")


KILLED = "killed (no end recorded: kill -9, a crash or a power cut)"  # a session's status read back


def _checksum(key: str, values: list) -> int:
    """CRC-32 of the key and the row's values: their repr (exact for floats; NaN, which SQLite
    stores as NULL, is read back as NaN before the check)."""
    return zlib.crc32(repr((key, values)).encode())


def _check_intact(db: sqlite3.Connection) -> None:
    """Raise sqlite3.DatabaseError unless SQLite's quick_check of every page of a store / cache passes."""
    rows = [r[0] for r in db.execute("PRAGMA quick_check")]  # raises itself on some damage
    if rows != ["ok"]:
        first = next((x for r in rows for x in r.splitlines() if not x.startswith("***")), rows[0])
        raise sqlite3.DatabaseError(f"database disk image is malformed: {first}")


def _refusal(exc: sqlite3.Error, flag: str, path: Path, otherwise: str) -> ConfigError:
    """One line for a database SQLite cannot use: a damaged page says to move it away, else `otherwise`."""
    if "malformed" not in str(exc):  # e.g. a damaged header: "file is not a database"
        return ConfigError(f"{flag}: {otherwise} ({exc})")
    remedy = "recompute the run's cells" if flag == "--out" else "start a new cache"
    return ConfigError(f"{flag}: {path} is damaged ({exc}); move it away to {remedy}")


def _write(db: sqlite3.Connection, path: Path, sql: str, params: tuple, flag: str = "--out") -> None:
    """db.execute(sql, params); a full disk (or another write failure) is an OSError naming the
    file, so the command line reports it in one line under the flag whose folder holds it."""
    try:
        db.execute(sql, params)
    except sqlite3.OperationalError as exc:
        code = errno.ENOSPC if "full" in str(exc) else errno.EIO
        raise OSError(code, f"{exc}; the cells stored before it are kept (--resume continues)", str(path)) from None
    except sqlite3.DatabaseError as exc:  # a damaged page: a ConfigError naming `flag`
        raise _refusal(exc, flag, path, f"cannot write to {path}") from None


class CellStore:
    """The finished cells of one run folder (see the module docstring).

    Args:
        out: the run folder (created if absent).
        columns: names of the result columns stored per cell, in order.
        resume: continue the run in `out` (otherwise `out` must be absent or empty).
        config_json: canonical JSON of the run's config; written to out/config.json, and on
            resume compared with the one there by `same(saved, new)` (default ==). Its key
            DATA_KEY, when present (a CSV prompt source's sha256), is not compared by `same`:
            on resume it must equal the digest the run in `out` used.
    Raises:
        ConfigError: `out` is a file, cannot be written, holds a run while resume is False, holds
            another config's run (or no run) while resume is True, holds a run of the same config
            made from other bytes of its CSV file, or is locked by another running icl-bench
            process. Nothing in `out` is changed when it raises.
    """

    def __init__(self, out: str | Path, columns, *, resume: bool, config_json: str | None = None, same=None):
        self.out, self.columns = Path(out), tuple(columns)
        self._lock, write_config = _prepare(self.out, resume=resume, config_json=config_json, same=same)
        if write_config and not resume:  # a new run: nothing below refuses it, and a config.json written
            self._write_config(config_json)  # before the store keeps a run killed at any point resumable
        try:
            self._db = sqlite3.connect(self.out / STORE_NAME, isolation_level=None, check_same_thread=False)
            have = [r[1] for r in self._db.execute("PRAGMA table_info(cells)")]
            if have and not {"key", "crc"} <= set(have):  # checked before any write: a foreign file is left as it is
                raise sqlite3.DatabaseError(f"its table 'cells' is not a cell store's (columns: {', '.join(have)})")
            if have:  # --resume: a damaged page is refused now (_check_intact), not mid-run
                _check_intact(self._db)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # WAL: every commit survives kill -9 (see above)
            cols = ", ".join(f'"{c}"' for c in self.columns)  # no declared type: values kept as given
            self._db.execute(f"CREATE TABLE IF NOT EXISTS cells (key TEXT PRIMARY KEY, {cols}, crc INTEGER NOT NULL)")
            have = [r[1] for r in self._db.execute("PRAGMA table_info(cells)")]
            for c in self.columns:  # a store of an older schema: the new columns are NULL -> CRC fails
                if c not in have:
                    self._db.execute(f'ALTER TABLE cells ADD COLUMN "{c}"')
        except sqlite3.Error as exc:
            self.close()
            raise _refusal(exc, "--out", self.out / STORE_NAME, f"cannot use {self.out / STORE_NAME} as a cell store") from None
        if write_config and resume:  # only once the store is accepted (a refusal leaves config.json as it was)
            self._write_config(config_json)
        self._insert = (f"INSERT OR REPLACE INTO cells (key, {cols}, crc) "
                        f"VALUES ({', '.join('?' * (len(self.columns) + 2))})")

    def _write_config(self, config_json: str) -> None:
        """config.json written atomically; on failure (a full disk) the store is closed and its lock let go."""
        try:
            write_atomic(self.out / CONFIG_NAME, config_json.encode())
        except BaseException:
            self.close()
            raise

    def open_session(self, doc: dict) -> int:
        """Record a session of this run as it starts (table `sessions`: a JSON document per run or
        --resume here), with status "running"; returns its number for close_session. A session
        killed with no chance to record its end (kill -9, a crash, a power cut) keeps that row: it
        was missing from metadata.json's `sessions` when its end was the first record (a review)."""
        self._db.execute("CREATE TABLE IF NOT EXISTS sessions (n INTEGER PRIMARY KEY, doc TEXT NOT NULL)")
        _write(self._db, self.out / STORE_NAME, "INSERT INTO sessions (doc) VALUES (?)",
               (dumps({**doc, "status": "running"}),))
        return self._db.execute("SELECT max(n) FROM sessions").fetchone()[0]

    def close_session(self, n: int, doc: dict) -> list[dict]:
        """Replace session `n`'s record with `doc` (finished or stopped) and return every session
        recorded, oldest first (metadata.json's `sessions`); one still "running" that is not `n`
        was killed and reads as KILLED, its cells_computed unknown (None)."""
        _write(self._db, self.out / STORE_NAME, "UPDATE sessions SET doc = ? WHERE n = ?", (dumps(doc), n))
        out = []
        for m, text in self._db.execute("SELECT n, doc FROM sessions ORDER BY n"):
            record = json.loads(text)
            if m != n and record.get("status") == "running":
                record.update(status=KILLED, cells_computed=None)
            out.append(record)
        return out

    def put(self, key: str, row: dict) -> None:
        """Store one finished row (one committed, fsynced transaction)."""
        values = [_plain(row[c]) for c in self.columns]
        _write(self._db, self.out / STORE_NAME, self._insert, (key, *values, _checksum(key, values)))

    def load(self) -> dict[str, dict]:
        """Every valid stored row of a finished cell: key -> {column: value}. A row whose CRC
        does not match its values is left out (its cell is recomputed), and so is a row whose
        status is not "ok": an error or a skip may not recur (a plugin since fixed, a GPU now
        present), so --resume tries those cells again."""
        cols = ", ".join(f'"{c}"' for c in self.columns)
        out = {}
        for key, *values, crc in self._db.execute(f"SELECT key, {cols}, crc FROM cells"):  # (pages checked on open)
            values = [math.nan if v is None else v for v in values]
            if _checksum(key, values) != crc:
                continue
            row = dict(zip(self.columns, values))
            if row.get("status", "ok") == "ok":
                out[key] = row
        return out

    def __len__(self) -> int:
        return self._db.execute("SELECT count(*) FROM cells").fetchone()[0]

    def write_results(self, table, meta: dict) -> None:
        """results.parquet, results.csv, then metadata.json (the "finished" mark), each atomically.

        metadata.json is removed first, so a crash part-way leaves a folder without it
        (unfinished, resumable), never new tables beside the old run's metadata.
        """
        (self.out / "metadata.json").unlink(missing_ok=True)
        fsync_dir(self.out)
        write_atomic(self.out / "results.parquet", table.to_parquet(index=False))
        write_atomic(self.out / "results.csv", table.to_csv(index=False).encode())
        write_atomic(self.out / "metadata.json", (dumps(meta, indent=2) + "\n").encode())

    def close(self) -> None:
        """Checkpoint and close the database, then release the folder lock."""
        db, self._db = getattr(self, "_db", None), None
        if db is not None:
            db.close()  # the last connection checkpoints the WAL into cells.sqlite and removes it
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _first_command(out: Path) -> str:
    """The command of the first session recorded in `out`'s store (CellStore.open_session), or ""."""
    try:
        uri = f"{(out / STORE_NAME).absolute().as_uri()}?mode=ro&immutable=1"  # (as_uri: a '#' or '?' in the path
        with closing(sqlite3.connect(uri, uri=True)) as db:  # cut a plain URI short and made a file; no -shm:
            row = db.execute("SELECT doc FROM sessions ORDER BY n LIMIT 1").fetchone()  # the folder is left as it is)
        return str(json.loads(row[0]).get("command", "")) if row else ""
    except (sqlite3.Error, ValueError, AttributeError):  # no store, no sessions table (an older run), bad JSON
        return ""


def _plain(v):
    """A value SQLite stores exactly: Python int / float / str (numpy / torch scalars converted;
    NaN is stored as NULL and read back as NaN)."""
    if type(v) in (float, int, str):
        return v
    if isinstance(v, bool):
        return int(v)  # SQLite reads it back as an int
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):
        return _plain(v.item())  # (a numpy / torch bool gives a bool: stored as an int, as above)
    return v


def prepare(out: Path, *, resume: bool, config_json: str | None, same=None):
    """_prepare, then config.json written (new, or rewritten to the new form) at once; returns the lock."""
    lock, write_config = _prepare(out, resume=resume, config_json=config_json, same=same)
    if write_config:
        write_atomic(out / CONFIG_NAME, config_json.encode())
    return lock


def _prepare(out: Path, *, resume: bool, config_json: str | None, same=None):
    """Check / create the run folder and lock it for this process; returns (the open lock file, whether
    config_json is to be written to config.json: new, or rewritten to the new form).

    A --resume into a folder whose config.json differs (by `same(saved, new)`, default ==; an
    equal-by-`same` config.json is rewritten to the new form), that has none (not a run folder),
    or that is missing or empty (no run to continue) is refused, so a finished run is never
    silently replaced by another config's table and a mistyped --out never silently starts afresh.
    """
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out: {out} is a file, not a folder")
    if not resume and out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out: {out} is not empty; pass --resume to continue that run or choose another folder")
    if resume and not (out.exists() and any(out.iterdir())):
        raise ConfigError(f"--resume: {out} holds no run to continue ({'empty' if out.exists() else 'missing'}); "
                          "drop --resume to start one there")
    for name in FINAL_FILES:  # checked now: write_results, at the end, could not replace a folder
        if resume and (out / name).is_dir():
            raise ConfigError(f"--out: {out / name} is a folder, where the run writes a file; remove it to resume")
    saved = out / CONFIG_NAME
    rewrite = False
    if resume and config_json is not None:
        if not saved.is_file():
            raise ConfigError(f"--resume: {out} is not an icl-bench run folder (no {CONFIG_NAME}); choose another --out")
        try:
            old, new = json.loads(saved.read_text()), json.loads(config_json)
        except OSError as exc:  # (a PermissionError read "cannot be read as JSON": a review)
            raise ConfigError(f"--resume: cannot read {saved} ({exc.strerror or type(exc).__name__})") from None
        except ValueError as exc:  # empty, binary, not JSON: it read "a run of another config"
            raise ConfigError(f"--resume: {saved} cannot be read as JSON ({type(exc).__name__}): not an "
                              "icl-bench run folder; choose another --out") from None
        except RecursionError:  # json recurses once per nested array / object
            raise ConfigError(f"--resume: {saved} nests JSON too deeply to read: not the {CONFIG_NAME} of an "
                              "icl-bench run; choose another --out") from None
        if not isinstance(old, dict):  # null, a list, a number: not what run writes
            kind = {type(None): "null", list: "a list", str: "a string", bool: "a boolean"}.get(type(old), "a number")
            raise ConfigError(f"--resume: {saved} holds {kind}, not a run config: not an icl-bench run folder; "
                              "choose another --out")
        was, now = str(old.pop(DATA_KEY, "") or ""), str(new.pop(DATA_KEY, "") or "")
        try:
            ok = (same or (lambda a, b: a == b))(old, new)
            rewrite = ok and (old != new or was != now)
        except (TypeError, AttributeError, ValueError):  # a dict of another shape
            ok = False
        if not ok:
            first = _first_command(out)  # a user without the TOML or the scroll-back (a new-user tryout)
            raise ConfigError(f"--resume: {out} holds a run of another config ({CONFIG_NAME} differs); "
                              "resume it with that config (or with no --config, --solver or --data: the "
                              f"{CONFIG_NAME} there is read) or choose another --out"
                              + (f" (the run was started by: {first})" if first else ""))
        was = was or _table_digest(out)  # a folder from before config.json kept the digest: its table's
        if now and was and was != now:  # the same config on other data: its table would be silently replaced
            path = (new.get("data") or {}).get("path", "the CSV file") if isinstance(new.get("data"), dict) else "the CSV file"
            raise ConfigError(f"data.path: the bytes of {path} changed since the run in {out} was made (sha256 "
                              f"{now[:12]}..., its cells used {was[:12]}...); give a new --out to run on the new "
                              "data, or restore the file to resume that run")
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = open(out / LOCK_NAME, "a+b")
    except OSError as exc:
        if out.is_symlink() and not out.exists():  # mkdir says "File exists" of a dangling link
            raise ConfigError(f"--out: {out} is a link to {os.readlink(out)}, which does not exist; "
                              "create that folder or choose another --out") from None
        raise ConfigError(f"--out: cannot write to {out} ({exc.strerror or type(exc).__name__})") from None
    if fcntl is not None:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            raise ConfigError(f"--out: {out} is in use by another icl-bench run; wait for it or choose another folder") from None
    for name in FINAL_FILES + (CONFIG_NAME,):  # temp files of a killed writer (we hold the lock: none is live)
        for tmp in out.glob(f".{name}.*{TMP_SUFFIX}"):
            tmp.unlink(missing_ok=True)
    return lock, config_json is not None and (rewrite or not saved.is_file())


def _table_digest(out: Path) -> str:
    """The one data_sha256 of the results table in `out` ("" if none, several or unreadable)."""
    try:
        import pandas as pd

        digests = set(pd.read_parquet(out / "results.parquet", columns=["data_sha256"])["data_sha256"].dropna())
    except Exception:  # absent (an unfinished run), not parquet, no such column: unknown
        return ""
    digests = {str(d) for d in digests} - {""}
    return digests.pop() if len(digests) == 1 else ""
