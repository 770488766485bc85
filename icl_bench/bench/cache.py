"""The cell cache: finished rows by cell key, shared across run folders (`icl-bench run --cache DIR`).

One SQLite file DIR/cells.sqlite in WAL mode, written and checked as a run's own store is
(icl_bench/bench/store.py: one transaction per row, a CRC-32 per row; docs/scale-out.md).
"""
from __future__ import annotations

import math
import os
import sqlite3
from pathlib import Path

from icl_bench.bench.store import (CONFIG_NAME, LOCK_NAME, STORE_NAME, _check_intact, _checksum, _plain, _refusal,
                                   _write)
from icl_bench.errors import ConfigError


def cache_key(key: str, *, threads: int, exclusive: bool) -> str:
    """A cell's key in the cache: its key (Cell.key), plus the timing settings its timing columns
    depend on where they are not the defaults ([timing] threads = 1, no exclusive timing). A row
    timed with 2 torch threads had been served to a run with 1 (and the reverse), whose metadata
    then named a thread count its throughput was not measured with (found by a review); --resume
    refuses that change of config. Rows cached with the defaults keep their keys."""
    tags = ([f"threads={threads}"] if threads != 1 else []) + (["exclusive"] if exclusive else [])
    return "|".join([key, *tags])


class CellCache:
    """Finished rows by cell key, shared across run folders (`icl-bench run --cache DIR`): one
    SQLite file DIR/cells.sqlite in WAL mode (concurrent runs may share it). A cell key holds
    every input the cell reads (bench/cells.py), so a hit is the same computation; its row,
    timings included, is reused. Rows carry the same CRC as a run's store; a bad one is a miss.

    Only "ok" rows are served and stored: an error or a skip may not recur.

    Raises:
        ConfigError: DIR is empty, is a run folder (`out`, a folder inside it, or any folder with a
            run's config.json, lock or metadata.json: its store belongs to that run), cannot be
            created, or its cells.sqlite is not a usable cell cache. Nothing is created then.
    """

    @staticmethod
    def check_path(folder: str | Path, out: str | Path | None = None) -> None:
        """The path checks of __init__, without creating anything (run them before --out is made).

        Raises:
            ConfigError: DIR is empty, a file, a run folder, the --out folder or inside it, a
                folder that `icl-bench publish` wrote or one inside it, a dangling symbolic link
                (or one above it) or a link loop, or a new cache that cannot be created there (its
                nearest existing folder is not writable).
        """
        if not str(folder).strip():
            raise ConfigError("--cache: empty path; give a folder")
        folder = Path(folder)
        try:
            real = folder.resolve()
        except (RuntimeError, OSError) as exc:  # e.g. a link to itself (Python 3.11: RuntimeError)
            raise ConfigError(f"--cache: cannot use {folder} ({' '.join(str(exc).split())[:120]})") from None
        dangling = next((p for p in (folder, *folder.absolute().parents) if p.is_symlink() and not p.exists()), None)
        if dangling is not None:  # it would be created only after --out, and fail there
            raise ConfigError(f"--cache: {dangling} is a symbolic link to {os.readlink(dangling)}, which is missing")
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"--cache: {folder} is a file, not a folder")
        published = next((p for p in (real, *real.parents) if (p / "publish.json").is_file()), None)
        if published is not None:  # `publish --force` replaces that folder, cache and all
            raise ConfigError(f"--cache: {folder} is {'inside ' if published != real else ''}a folder "
                              "icl-bench publish wrote (it replaces it with --force); a cell cache needs a folder of its own")
        run_files = [n for n in (CONFIG_NAME, LOCK_NAME, "metadata.json") if (folder / n).exists()]
        inside = out is not None and (real == Path(out).resolve() or Path(out).resolve() in real.parents)
        if run_files or inside:
            raise ConfigError(f"--cache: {folder} is a run folder or inside one ({', '.join(run_files) or 'the --out folder'}); "
                              "a cell cache needs a folder of its own")
        db = folder / STORE_NAME  # a cache to be made: where it goes must take it (checked before --out is made)
        if not (db.exists() or db.is_symlink()):
            base = next(p for p in (folder, *folder.absolute().parents) if p.exists())
            if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):
                raise ConfigError(f"--cache: cannot create a cell cache in {folder} ({base} is not a writable folder)")

    def __init__(self, folder: str | Path, columns, out: str | Path | None = None):
        self.check_path(folder, out)
        self.folder, self.columns = Path(folder), tuple(columns)
        cols = ", ".join(f'"{c}"' for c in self.columns)
        self._db = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.folder / STORE_NAME, isolation_level=None, timeout=60)
            have = {r[1] for r in self._db.execute("PRAGMA table_info(cells)")}
            if have and not {"key", "crc"} <= have:  # a foreign table: checked before any write
                raise sqlite3.DatabaseError(f"its table 'cells' is not a cell cache's (columns: {', '.join(sorted(have))})")
            if have:  # opened before --out is made: a damaged page leaves no run folder behind
                _check_intact(self._db)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(f"CREATE TABLE IF NOT EXISTS cells (key TEXT PRIMARY KEY, {cols}, crc INTEGER NOT NULL)")
            for c in self.columns:  # a cache of an older version: new columns are NULL, its rows fail the CRC
                if have and c not in have:
                    self._db.execute(f'ALTER TABLE cells ADD COLUMN "{c}"')
        except (OSError, sqlite3.Error) as exc:
            self.close()
            raise _refusal(exc, "--cache", self.folder / STORE_NAME, f"cannot use {self.folder} as a cell cache") from None
        self._cols = cols

    def get(self, keys) -> dict[str, dict]:
        """key -> row for the keys found with a valid CRC."""
        out = {}
        for key in keys:
            try:
                hit = self._db.execute(f"SELECT {self._cols}, crc FROM cells WHERE key = ?", (key,)).fetchone()
            except sqlite3.DatabaseError as exc:  # (checked when opened: damaged since, by another run)
                raise _refusal(exc, "--cache", self.folder / STORE_NAME, "cannot read the cache") from None
            if hit is None:
                continue
            values = [math.nan if v is None else v for v in hit[:-1]]
            if _checksum(key, values) == hit[-1] and values[self.columns.index("status")] == "ok":
                out[key] = dict(zip(self.columns, values))
        return out

    def put(self, key: str, row: dict) -> None:
        """Store the row of a finished "ok" cell (other rows are not kept: see the class docstring)."""
        if row.get("status") != "ok":
            return
        values = [_plain(row[c]) for c in self.columns]
        _write(self._db, self.folder / STORE_NAME, f"INSERT OR REPLACE INTO cells (key, {self._cols}, crc) VALUES "
               f"({', '.join('?' * (len(self.columns) + 2))})", (key, *values, _checksum(key, values)), "--cache")

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
