"""Crash safety: a run killed at any instant resumes to the table an uninterrupted run gives,
recomputing only the cells it had not finished; nothing half-written is ever merged."""
from __future__ import annotations

import errno
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import tomli_w

from icl_bench.bench import store
from icl_bench.bench.cache import CellCache, cache_key
from icl_bench.bench.cells import expand_cells
from icl_bench.bench.config import parse_config
from icl_bench.bench.runner import run_matrix
from icl_bench.bench.schema import RESULT_COLUMNS, TIMING_COLUMNS
from icl_bench.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]  # the checkout under test


def _cli(*args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "icl_bench", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _stable(table: pd.DataFrame) -> pd.DataFrame:
    return table.drop(columns=list(TIMING_COLUMNS)).reset_index(drop=True)


def _stored(out: Path) -> dict[str, tuple]:
    """key -> every stored value (timing included) of the finished cells in out/cells.sqlite,
    read through a read-only connection (safe while a writer runs: WAL mode)."""
    path = out / "cells.sqlite"
    if not path.exists():
        return {}
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return {r[0]: r[1:] for r in db.execute("SELECT * FROM cells")}
    except sqlite3.OperationalError:  # the writer has not created the table yet
        return {}
    finally:
        db.close()


# slow enough to be caught mid-way (scipy-lstsq loops over prompts in Python), fast overall
SLOW = {"seed": 3, "n_prompts": 1000, "batch_size": 250, "timing": {"repeats": 1},
        "grid": {"N": [4, 5, 6, 7, 8, 9, 10, 11], "noise": [0.1], "R": [100.0], "dtype": ["float64"]},
        "solvers": {"scipy-lstsq": {}}}


def test_sigkill_mid_run_then_resume_recomputes_only_unfinished_cells(tmp_path):
    cfg_path, out = tmp_path / "slow.toml", tmp_path / "run"
    cfg_path.write_text(tomli_w.dumps(SLOW))
    total = len(expand_cells(parse_config(SLOW)))
    proc = _cli("run", "--config", str(cfg_path), "--out", str(out), "--no-progress")
    deadline = time.monotonic() + 120
    while len(_stored(out)) < 2:  # some cells finished ...
        assert proc.poll() is None, f"run ended before it could be killed: {proc.communicate()}"
        assert time.monotonic() < deadline, "no cell finished in 120 s"
        time.sleep(0.005)
    proc.kill()  # SIGKILL: no cleanup, no finally blocks
    proc.communicate()
    assert proc.returncode == -9
    done = _stored(out)
    assert 2 <= len(done) < total  # ... but not all: kill -9 lost only the cell in flight
    assert not (out / "results.parquet").exists() and not (out / "metadata.json").exists()

    resumed = _cli("run", "--config", str(cfg_path), "--out", str(out), "--no-progress", "--resume")
    stdout, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr
    after = _stored(out)
    assert len(after) == total and not list(out.glob(".*.tmp"))
    assert {k: after[k] for k in done} == done  # finished cells were not recomputed (same timing, same values)
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["n_cells_reused"] == len(done) and meta["n_cells"] == total
    assert meta["command"] == f"icl-bench run --config {cfg_path} --out {out} --no-progress --resume"  # this session's
    reference = run_matrix(parse_config(SLOW), progress=False)  # uninterrupted, in memory
    pd.testing.assert_frame_equal(_stable(pd.read_parquet(out / "results.parquet")), _stable(reference))


KILL_AFTER_THIRD_CELL = """
import os, signal, sys
from icl_bench.bench import store
from icl_bench.bench.cache import CellCache, cache_key
real, calls = store.CellStore.put, []
def put(self, key, row):
    real(self, key, row)
    calls.append(key)
    if len(calls) == 3:  # three cells committed; the WAL is never checkpointed
        os.kill(os.getpid(), signal.SIGKILL)
store.CellStore.put = put
from icl_bench.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _killed_after_three_cells(tmp_path) -> Path:
    cfg_path, out = tmp_path / "small.toml", tmp_path / "run"
    cfg_path.write_text(tomli_w.dumps(SMALL))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", KILL_AFTER_THIRD_CELL, "run", "--config", str(cfg_path),
                        "--out", str(out), "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == -9, p.stderr
    assert (out / "cells.sqlite-wal").stat().st_size > 0  # the rows live in the WAL only
    return out


SMALL = {"seed": 1, "n_prompts": 40, "batch_size": 40, "timing": {"repeats": 1},
         "grid": {"N": [3, 6], "noise": [0.0, 0.5], "R": [10.0], "dtype": ["float32"]},
         "solvers": {"ols": {}, "scipy-lstsq": {}}}


@pytest.mark.parametrize("tear", ["cut-last-commit", "half-frame-appended"])
def test_torn_write_is_never_merged(tmp_path, tear):
    out = _killed_after_three_cells(tmp_path)
    wal = out / "cells.sqlite-wal"
    size = wal.stat().st_size
    if tear == "cut-last-commit":  # a kill / power cut in the middle of the third commit
        with open(wal, "r+b") as f:
            f.truncate(size - 100)
        expect = 2
    else:  # a fourth transaction cut short: a frame header and half a page, no commit frame
        with open(wal, "ab") as f:
            f.write(open(wal, "rb").read()[32:32 + 24 + 2000])
        expect = 3
    done = _stored(out)
    assert len(done) == expect  # SQLite replays the WAL only up to the last intact commit frame
    from icl_bench.report.aggregate import load_run

    with pytest.raises(ConfigError, match=r"an unfinished run: complete it with `icl-bench run --resume --out .*`, which reads the config it recorded"):
        load_run(out)
    (out / ".my-own-notes.tmp").write_text("not ours")  # a user's file: left alone
    (out / ".results.csv.123-abcd.tmp").write_text("half a ta")  # a table write cut short
    table = run_matrix(parse_config(SMALL), out, resume=True, progress=False)
    assert [p.name for p in out.glob(".*.tmp")] == [".my-own-notes.tmp"]
    assert json.loads((out / "metadata.json").read_text())["n_cells_reused"] == expect
    assert {k: v for k, v in _stored(out).items() if k in done} == done
    assert len(_stored(out)) == len(table) == 8
    pd.testing.assert_frame_equal(_stable(table), _stable(run_matrix(parse_config(SMALL), progress=False)))


def _set(key: str, col: str, value) -> str:
    return f'UPDATE cells SET "{col}" = {value} WHERE key = \'{key}\''


CORRUPTIONS = {  # SQL that damages the stored row of `victim` behind the store's back
    "value-changed": lambda victim, other: _set(victim, "mse_vs_ols", 0.25),
    "value-lost": lambda victim, other: _set(victim, "mse_vs_truth", "NULL"),
    "status-unknown": lambda victim, other: _set(victim, "status", "'banana'"),
    "crc-changed": lambda victim, other: _set(victim, "crc", "crc + 1"),
    "another-cell": lambda victim, other: (  # a valid row of a different cell under this cell's key
        f"INSERT OR REPLACE INTO cells SELECT '{victim}', {', '.join(f'{chr(34)}{c}{chr(34)}' for c in RESULT_COLUMNS)}, "
        f"crc FROM cells WHERE key = '{other}'"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_stored_row_is_recomputed_never_merged(tmp_path, kind):
    out = tmp_path / "run"
    first = run_matrix(parse_config(SMALL), out, progress=False)
    keys = sorted(_stored(out))
    victim, other = keys[0], keys[1]
    with sqlite3.connect(out / "cells.sqlite") as db:
        db.execute(CORRUPTIONS[kind](victim, other))
    db.close()
    others = {k: v for k, v in _stored(out).items() if k != victim}
    again = run_matrix(parse_config(SMALL), out, resume=True, progress=False)
    assert {k: v for k, v in _stored(out).items() if k != victim} == others
    assert json.loads((out / "metadata.json").read_text())["n_cells_reused"] == len(first) - 1
    pd.testing.assert_frame_equal(_stable(first), _stable(again))


def test_a_store_that_is_not_a_database_is_refused(tmp_path):
    out = tmp_path / "run"
    run_matrix(parse_config(SMALL), out, progress=False)
    (out / "cells.sqlite").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(ConfigError, match=r"--out: cannot use .*cells.sqlite as a cell store"):
        run_matrix(parse_config(SMALL), out, resume=True, progress=False)


@pytest.mark.parametrize("name", ["run", "run#1 ?x"])  # ('#' and '?' cut a plain SQLite URI short: a stray file)
def test_resume_with_another_config_is_refused_and_changes_nothing(tmp_path, monkeypatch, name):
    out = tmp_path / name
    monkeypatch.setattr(sys, "argv", ["/venv/bin/icl-bench", "run", "--config", "my.toml", "--out", "run"])
    run_matrix(parse_config(SMALL), out, progress=False)
    monkeypatch.setattr(sys, "argv", ["/venv/bin/icl-bench", "run", "--out", "run", "--resume"])  # a later session:
    run_matrix(parse_config(SMALL), out, resume=True, progress=False)  # the hint names the first (a mutation review)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match=r"--resume: .* holds a run of another config .*; resume it with that config \(or "
                                          r"with no --config, --solver or --data: the config.json there is read\) or "
                                          r"choose another --out \(the run was started by: icl-bench run --config my.toml "
                                          r"--out run\)$"):  # (a user without the TOML's name: a new-user tryout)
        run_matrix(parse_config({**SMALL, "seed": 2}), out, resume=True, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # nothing made beside it
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_resume_into_a_folder_that_is_not_a_run_is_refused(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "results.csv").write_text("my own table\n")
    with pytest.raises(ConfigError, match=r"--resume: .* is not an icl-bench run folder"):
        run_matrix(parse_config(SMALL), out, resume=True, progress=False)
    assert [p.name for p in out.iterdir()] == ["results.csv"] and (out / "results.csv").read_text() == "my own table\n"


def test_crash_while_writing_the_tables_leaves_no_finished_mark(tmp_path, monkeypatch):
    out = tmp_path / "run"
    run_matrix(parse_config(SMALL), out, progress=False)
    real = store.write_atomic

    def dies_at_csv(path, data):
        if path.name == "results.csv":
            raise KeyboardInterrupt  # stands in for a crash between the two table writes
        real(path, data)

    monkeypatch.setattr(store, "write_atomic", dies_at_csv)
    with pytest.raises(KeyboardInterrupt):
        run_matrix(parse_config(SMALL), out, resume=True, progress=False)
    assert not (out / "metadata.json").exists()  # the rewritten parquet is not vouched for by old metadata
    monkeypatch.setattr(store, "write_atomic", real)
    table = run_matrix(parse_config(SMALL), out, resume=True, progress=False)
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["n_cells_reused"] == 8 and len(pd.read_csv(out / "results.csv")) == len(table) == 8


def test_every_write_is_renamed_into_place_and_every_cell_committed_durably(tmp_path, monkeypatch):
    from icl_bench import files

    synced, renamed, commits, events = [], [], [], []  # events: ("sync" | "replace" | "unlink", name), in order
    real_fsync_dir, real_replace, real_put, real_unlink = files.fsync_dir, os.replace, store.CellStore.put, Path.unlink
    sync = lambda p: (synced.append(Path(p).name), events.append(("sync", Path(p).name)), real_fsync_dir(p))  # noqa: E731
    monkeypatch.setattr(files, "fsync_dir", sync)
    monkeypatch.setattr(store, "fsync_dir", sync)
    monkeypatch.setattr(files.os, "replace", lambda a, b: (renamed.append(Path(b).name), events.append(("replace", Path(b).name)),
                                                           real_replace(a, b)))
    monkeypatch.setattr(Path, "unlink", lambda self, *a, **k: (events.append(("unlink", self.name)), real_unlink(self, *a, **k)))

    def put(self, key, row):  # each put is its own committed transaction in the WAL
        assert self._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert self._db.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
        real_put(self, key, row)
        assert not self._db.in_transaction
        commits.append(key)

    monkeypatch.setattr(store.CellStore, "put", put)
    out = tmp_path / "run"
    run_matrix(parse_config(SMALL), out, progress=False)
    assert len(commits) == len(set(commits)) == 8
    assert renamed == ["config.json", "results.parquet", "results.csv", "metadata.json"]
    assert synced.count("run") >= 4
    gone, tables = events.index(("unlink", "metadata.json")), events.index(("replace", "results.parquet"))
    assert ("sync", "run") in events[gone:tables], events  # the old "finished" mark is gone for good before new tables
    # come in: a power cut could otherwise leave it beside them (its fsync was not checked: a mutation review)
    assert sorted(p.name for p in out.iterdir()) == [".icl-bench.lock", "cells.sqlite", "config.json", "metadata.json",
                                                      "results.csv", "results.parquet"]  # WAL checkpointed on close


def test_a_second_writer_is_refused_while_the_first_holds_the_folder(tmp_path):
    out = tmp_path / "run"
    run_matrix(parse_config(SMALL), out, progress=False)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    holder = store.CellStore(out, RESULT_COLUMNS, resume=True)  # stands in for a run in progress
    try:
        with pytest.raises(ConfigError, match="--out: .* is in use by another icl-bench run"):
            run_matrix(parse_config(SMALL), out, resume=True, progress=False)
    finally:
        holder.close()
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    run_matrix(parse_config(SMALL), out, resume=True, progress=False)  # released: fine again


def test_resume_after_the_data_file_changed_is_refused_and_a_new_out_gets_the_new_data(tmp_path):
    """No stale row is ever merged: --resume on edited bytes is refused (it used to recompute every
    cell and replace the folder's table silently); a new --out computes the new data's numbers."""
    data = tmp_path / "d.csv"
    data.write_text("x,y\n" + "".join(f"{i},{2 * i + 1}\n" for i in range(20)))
    grid = {k: v for k, v in SMALL["grid"].items() if k != "noise"}  # CSV prompts have no noise to set
    raw = {**SMALL, "grid": grid, "data": {"path": str(data), "x": "x", "y": "y"}}
    out = tmp_path / "run"
    run_matrix(parse_config(raw), out, progress=False)
    before = (out / "results.parquet").read_bytes()
    data.write_text("x,y\n" + "".join(f"{i},{i * i}\n" for i in range(20)))  # same name, a curve: OLS misses it
    with pytest.raises(ConfigError, match=r"^data\.path: the bytes of .*d\.csv changed since the run in"):
        run_matrix(parse_config(raw), out, resume=True, progress=False)
    assert (out / "results.parquet").read_bytes() == before
    table = run_matrix(parse_config(raw), tmp_path / "new", progress=False)
    assert (table["mse_vs_target"] > 1e-3).all()  # the new numbers, not the line this process read first
    fresh = tmp_path / "fresh"  # another process reading the edited file gives the same table
    fresh.mkdir()
    code = ("import json, sys; from icl_bench.bench.config import parse_config; from icl_bench.bench.runner import "
            "run_matrix; run_matrix(parse_config(json.loads(sys.argv[1])), sys.argv[2], progress=False)")
    subprocess.run([sys.executable, "-c", code, json.dumps(raw), str(fresh / "run")], check=True)
    pd.testing.assert_frame_equal(_stable(table), _stable(pd.read_parquet(fresh / "run" / "results.parquet")))


def test_store_gives_back_exactly_what_was_put(tmp_path):
    import math

    import numpy as np
    import torch

    cols = ("x", "nan", "inf", "n", "flag", "np", "t", "status")
    row = {"x": 0.1 + 0.2, "nan": math.nan, "inf": -math.inf, "n": 2**62, "flag": True,
           "np": np.float32(1.5), "t": torch.tensor(7), "status": "ok"}
    with store.CellStore(tmp_path / "o", cols, resume=False) as db:
        db.put("k1", row)
        db.put("k2", {**row, "status": "banana"})  # stored, but never read back as a finished cell
    with store.CellStore(tmp_path / "o", cols, resume=True) as db:
        got = db.load()
    assert list(got) == ["k1"]
    r = got["k1"]
    assert r["x"] == 0.1 + 0.2 and math.isnan(r["nan"]) and r["inf"] == -math.inf and r["n"] == 2**62
    assert r["flag"] == 1 and r["np"] == 1.5 and r["t"] == 7 and r["status"] == "ok"
    assert [type(r[c]) for c in ("x", "n", "np", "t")] == [float, int, float, int]


class _FullDisk:
    """A sqlite3 connection whose inserts fail as on a full disk (everything else passes through)."""

    def __init__(self, db, fail_after: int):
        self.db, self.left = db, fail_after

    def execute(self, sql, *args):
        if sql.lstrip().startswith("INSERT") and "INTO cells" in sql:  # (not the session record)
            self.left -= 1
            if self.left < 0:
                raise sqlite3.OperationalError("database or disk is full")
        return self.db.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self.db, name)


def test_a_full_disk_mid_run_is_one_line_and_the_stored_cells_resume(tmp_path, monkeypatch, capsys):
    """The disk filling up after some cells were stored was an 18-line sqlite3 traceback; it is
    one line naming --out's store (exit 2), and --resume reuses the cells stored before it."""
    from icl_bench.cli import main

    connect = sqlite3.connect
    monkeypatch.setattr(store.sqlite3, "connect", lambda *a, **k: _FullDisk(connect(*a, **k), fail_after=3))
    cfg = tmp_path / "c.toml"
    cfg.write_text(tomli_w.dumps({**SLOW, "n_prompts": 16, "batch_size": 16, "grid": {**SLOW["grid"], "N": [4, 5, 6, 7, 8]},
                                  "solvers": {"ols": {}}}))
    out = tmp_path / "run"
    assert main(["run", "--config", str(cfg), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"icl-bench: error: --out: {out / 'cells.sqlite'}: database or disk is full; the cells stored "
                   "before it are kept (--resume continues)"], err
    monkeypatch.setattr(store.sqlite3, "connect", connect)
    assert main(["run", "--config", str(cfg), "--out", str(out), "--no-progress", "--resume"]) == 0
    assert json.loads((out / "metadata.json").read_text())["n_cells_reused"] == 3


def _damage_page(db_path: Path, name: str = "cells") -> None:
    """Overwrite the first page of table / index `name` of the SQLite file (not its header page)
    with text, as `printf 'GARBAGE%.0s' {1..600} | dd of=cells.sqlite seek=... conv=notrunc` does."""
    db = sqlite3.connect(db_path)
    root = db.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (name,)).fetchone()[0]
    size = db.execute("PRAGMA page_size").fetchone()[0]
    db.close()
    assert root > 1 and not Path(f"{db_path}-wal").exists()
    with open(db_path, "r+b") as f:
        f.seek((root - 1) * size)
        f.write(b"GARBAGE" * 600)


@pytest.mark.parametrize("page", ["cells", "sqlite_autoindex_cells_1"])
@pytest.mark.parametrize("where", ["--out", "--cache"])
def test_a_damaged_page_of_the_store_or_cache_is_one_line_and_writes_nothing(tmp_path, capsys, where, page):
    """A damaged page (not the header) of cells.sqlite was a `database disk image is malformed`
    traceback, exit 1, on --resume and with --cache (found by an adversarial review); with --cache it
    also left a started --out (config.json + cells.sqlite) that the next run refused as not empty."""
    from icl_bench.cli import main

    cfg = tmp_path / "c.toml"
    cfg.write_text(tomli_w.dumps(SMALL))
    run = ["run", "--config", str(cfg), "--no-progress"]
    assert main([*run, "--out", str(tmp_path / "run"), "--cache", str(tmp_path / "cache")]) == 0
    capsys.readouterr()
    db = tmp_path / ("run" if where == "--out" else "cache") / "cells.sqlite"
    _damage_page(db, page)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    argv = [*run, "--out", str(tmp_path / "run"), "--resume"] if where == "--out" else \
        [*run, "--out", str(tmp_path / "new"), "--cache", str(tmp_path / "cache")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    remedy = "recompute the run's cells" if where == "--out" else "start a new cache"
    assert err.startswith(f"icl-bench: error: {where}: {db} is damaged (database disk image is malformed")
    assert err.endswith(f"); move it away to {remedy}\n") and err.count("\n") == 1, err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # no --out started either
    db.rename(tmp_path / "damaged.sqlite")  # as the message says: the run goes on, its cells recomputed
    assert main(argv) == 0


def test_a_page_damaged_after_the_check_is_one_line_too(tmp_path, monkeypatch):
    """Damage that SQLite meets only mid-run (here: the open-time check skipped) is the same
    one-line ConfigError, from a lookup in the cache and from a store's write."""
    from icl_bench.bench import cache as cache_module

    for module in (store, cache_module):
        monkeypatch.setattr(module, "_check_intact", lambda db: None)
    cols = ("x", "status")
    with store.CellStore(tmp_path / "o", cols, resume=False) as db:
        db.put("k", {"x": 1.0, "status": "ok"})
    cache = CellCache(tmp_path / "cache", cols)
    cache.put("k", {"x": 1.0, "status": "ok"})
    cache.close()
    _damage_page(tmp_path / "cache" / "cells.sqlite", "sqlite_autoindex_cells_1")
    _damage_page(tmp_path / "o" / "cells.sqlite", "sqlite_autoindex_cells_1")
    cache = CellCache(tmp_path / "cache", cols)
    try:
        with pytest.raises(ConfigError, match=r"^--cache: .*cells.sqlite is damaged \(database disk image is malformed\)"):
            cache.get(["k"])
    finally:
        cache.close()
    with store.CellStore(tmp_path / "o", cols, resume=True) as db:
        with pytest.raises(ConfigError, match=r"^--out: .*cells.sqlite is damaged \(database disk image is malformed\)"):
            db.put("k9", {"x": 2.0, "status": "ok"})


def test_metadata_lists_every_session_that_ran_in_the_folder(tmp_path, monkeypatch):
    """metadata.json named only the last session (its command and executor), even one that computed
    nothing: an interrupted run finished by --resume lost its first command (found by a review).
    Each session is now recorded in the store, interrupted ones too, and listed in `sessions`."""
    from icl_bench.bench import runner

    raw = {"seed": 0, "n_prompts": 16, "batch_size": 16, "timing": {"repeats": 1},
           "grid": {"N": [4, 6, 8], "R": [10.0], "dtype": ["float64"]}, "solvers": {"ols": {}}}
    cfg, out, real, calls = parse_config(raw), tmp_path / "run", runner.run_cell_task, []

    def stop_at_the_third(cell, **kw):
        calls.append(cell)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(cell, **kw)

    monkeypatch.setattr(runner, "run_cell_task", stop_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        run_matrix(cfg, out, progress=False)
    monkeypatch.setattr(runner, "run_cell_task", real)
    run_matrix(cfg, out, resume=True, progress=False)
    first, last = json.loads((out / "metadata.json").read_text())["sessions"]
    assert (first["status"], first["cells_computed"], first["cells_reused"]) == ("stopped (KeyboardInterrupt)", 2, 0)
    assert (last["status"], last["cells_computed"], last["cells_reused"]) == ("finished", 1, 2)
    assert first["executor"] == {"kind": "local"} and last["executor"] == {"kind": "local", "exclusive_timing": False}
    assert first["started_at"] < first["finished_at"] <= last["started_at"] < last["finished_at"]


def test_a_run_made_while_threads_defaulted_to_0_resumes_with_its_threads(tmp_path):
    """[timing] threads defaulted to 0 (torch's own) before it became 1: a folder made then, from a
    config without [timing], was refused by --resume as another config (found by a review). A config
    that leaves threads unset now resumes it with the recorded count; one that sets another is refused."""
    raw = {k: v for k, v in SMALL.items() if k != "timing"}
    out = tmp_path / "run"
    run_matrix(parse_config({**raw, "timing": {"threads": 0}}), out, progress=False)  # as config.json recorded it
    table = run_matrix(parse_config(raw), out, resume=True, progress=False)
    assert json.loads((out / "config.json").read_text())["timing"]["threads"] == 0 and len(table) > 0
    with pytest.raises(ConfigError, match=r"--resume: .* holds a run of another config"):
        run_matrix(parse_config({**raw, "timing": {"threads": 1}}), out, resume=True, progress=False)


def test_the_cache_serves_no_row_whose_crc_fails_and_default_timing_keeps_plain_keys(tmp_path):
    """A row edited in the cache's file (a bit flip, a tampered value) was served into a run when
    the CRC check was dropped; the run's own store has it (found by a mutation review). Keys of
    rows timed with the defaults carry no tags, so existing caches keep hitting."""
    import sqlite3

    from icl_bench.bench.cache import cache_key

    assert cache_key("K", threads=1, exclusive=False) == "K"
    assert cache_key("K", threads=2, exclusive=True) == "K|threads=2|exclusive"
    cache = CellCache(tmp_path / "cache", ("x", "status"))
    try:
        cache.put("k", {"x": 1.0, "status": "ok"})
        assert cache.get(["k"]) == {"k": {"x": 1.0, "status": "ok"}}
        with sqlite3.connect(tmp_path / "cache" / "cells.sqlite") as db:
            db.execute('UPDATE cells SET "x" = 2.0')
        assert cache.get(["k"]) == {}
    finally:
        cache.close()


def test_a_full_disk_is_an_oserror_with_enospc_naming_the_store(tmp_path, monkeypatch):
    # guards _write: a full disk is ENOSPC (not a generic EIO) on the store's path, for callers of the API
    connect = sqlite3.connect
    monkeypatch.setattr(store.sqlite3, "connect", lambda *a, **k: _FullDisk(connect(*a, **k), fail_after=0))
    with store.CellStore(tmp_path / "o", ("x", "status"), resume=False) as db:
        with pytest.raises(OSError) as err:
            db.put("k", {"x": 1.0, "status": "ok"})
    assert (err.value.errno, err.value.filename) == (errno.ENOSPC, str(tmp_path / "o" / "cells.sqlite"))


def test_a_store_or_cache_of_an_older_schema_gains_the_new_columns_and_misses(tmp_path):
    # guards the ALTER TABLE of both: a file written with fewer result columns is read (its rows fail
    # the CRC: recomputed / a miss), not a "no such column" error, and takes new rows
    old, new = ("x", "status"), ("x", "y", "status")
    with store.CellStore(tmp_path / "o", old, resume=False) as db:
        db.put("k", {"x": 1.0, "status": "ok"})
    cache = CellCache(tmp_path / "cache", old)
    cache.put("k", {"x": 1.0, "status": "ok"})
    cache.close()
    with store.CellStore(tmp_path / "o", new, resume=True) as db:
        assert db.load() == {}
        db.put("k2", {"x": 2.0, "y": 3.0, "status": "ok"})
        assert db.load() == {"k2": {"x": 2.0, "y": 3.0, "status": "ok"}}
    cache = CellCache(tmp_path / "cache", new)
    try:
        assert cache.get(["k"]) == {}
        cache.put("k", {"x": 2.0, "y": 3.0, "status": "ok"})
        assert cache.get(["k"]) == {"k": {"x": 2.0, "y": 3.0, "status": "ok"}}
    finally:
        cache.close()


def test_a_config_json_of_another_shape_reads_as_another_config(tmp_path):
    # guards prepare's except (AttributeError): same_matrix on a config.json whose grid is not a table
    # raised a traceback instead of the one-line refusal
    from icl_bench.bench.cells import same_matrix

    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text('{"grid": "oops", "solvers": {}}')
    with pytest.raises(ConfigError, match=r"^--resume: .* holds a run of another config"):
        store.prepare(out, resume=True, config_json='{"grid": {"N": [4]}, "solvers": {}}', same=same_matrix)
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]


@pytest.mark.parametrize("doc", ["not json", "[1]"])
def test_an_unreadable_first_session_leaves_the_refusal_without_its_command(tmp_path, doc):
    # guards _first_command's except (ValueError, AttributeError): a damaged session record may not
    # turn the "another config" refusal into a traceback; the hint is left out
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text('{"seed": 1}')
    with sqlite3.connect(out / "cells.sqlite") as db:
        db.execute("CREATE TABLE sessions (n INTEGER PRIMARY KEY, doc TEXT NOT NULL)")
        db.execute("INSERT INTO sessions (doc) VALUES (?)", (doc,))
    db.close()
    with pytest.raises(ConfigError, match=r"holds a run of another config .* or choose another --out$"):
        store.prepare(out, resume=True, config_json='{"seed": 2}')


def test_an_old_table_with_several_data_digests_is_not_a_digest_to_compare(tmp_path):
    # guards _table_digest: a folder from before config.json kept the digest, whose table mixes two
    # digests, has no known digest ("": resumed, config.json upgraded); one digest is compared
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text('{"seed": 1}')
    new = json.dumps({"seed": 1, store.DATA_KEY: "c" * 64})
    pd.DataFrame({"data_sha256": ["a" * 64, "b" * 64]}).to_parquet(out / "results.parquet")
    store.prepare(out, resume=True, config_json=new).close()
    assert json.loads((out / "config.json").read_text())[store.DATA_KEY] == "c" * 64
    (out / "config.json").write_text('{"seed": 1}')
    pd.DataFrame({"data_sha256": ["a" * 64, "a" * 64]}).to_parquet(out / "results.parquet")
    with pytest.raises(ConfigError, match=r"^data\.path: the bytes of the CSV file changed .*its cells used aaaaaaaaaaaa"):
        store.prepare(out, resume=True, config_json=new)


def test_a_cache_key_is_tagged_for_every_thread_count_but_one():
    # guards cache_key: threads = 0 (torch's own count) is not the default 1, so its rows get a key of their own
    assert cache_key("K", threads=0, exclusive=False) == "K|threads=0"
    assert cache_key("K", threads=1, exclusive=True) == "K|exclusive"


def test_the_cache_stores_and_serves_ok_rows_only(tmp_path):
    # guards put's and get's status checks: an error row is not stored, and a valid-CRC error row
    # in the file (an older version, another writer) is not served
    cache = CellCache(tmp_path / "cache", ("x", "status"))
    try:
        cache.put("e", {"x": 1.0, "status": "error"})
        with sqlite3.connect(tmp_path / "cache" / "cells.sqlite") as db:
            assert db.execute("SELECT count(*) FROM cells").fetchone() == (0,)
            db.execute("INSERT INTO cells VALUES (?, ?, ?, ?)", ("e", 1.0, "error", store._checksum("e", [1.0, "error"])))
        db.close()
        assert cache.get(["e"]) == {}
    finally:
        cache.close()


def test_a_foreign_cells_table_is_not_used_as_a_cache_and_left_as_it_is(tmp_path):
    # guards CellCache's key/crc check: a database of someone else's with a `cells` table is refused, unchanged
    (tmp_path / "cache").mkdir()
    with sqlite3.connect(tmp_path / "cache" / "cells.sqlite") as db:
        db.execute("CREATE TABLE cells (a, b)")
        db.execute("INSERT INTO cells VALUES (1, 2)")
    db.close()
    before = (tmp_path / "cache" / "cells.sqlite").read_bytes()
    with pytest.raises(ConfigError, match=r"^--cache: cannot use .* as a cell cache \(its table 'cells' is not a cell "
                                          r"cache's \(columns: a, b\)\)$"):
        CellCache(tmp_path / "cache", ("x", "status"))
    assert (tmp_path / "cache" / "cells.sqlite").read_bytes() == before


def test_a_numpy_or_torch_bool_in_a_row_loads_back(tmp_path):
    """_plain stores a bool as an int (SQLite's own form), and a numpy or torch bool too: .item()
    gave a Python bool, stored as 1 but checksummed as True, so the row failed its check and was
    recomputed at every --resume (a mutation review)."""
    import numpy as np
    import torch

    out = tmp_path / "o"
    with store.CellStore(out, ("flag", "status"), resume=False) as db:
        for key, flag in (("py", True), ("np", np.bool_(True)), ("torch", torch.tensor(False))):
            db.put(key, {"flag": flag, "status": "ok"})
    with store.CellStore(out, ("flag", "status"), resume=True) as db:
        rows = db.load()
    assert {k: r["flag"] for k, r in rows.items()} == {"py": 1, "np": 1, "torch": 0}


def test_a_refused_resume_leaves_config_json_as_it_was(tmp_path):
    """A --resume whose config equals the run's but is written otherwise (a grid list reordered:
    config.json is rewritten to the new form) into a folder whose cells.sqlite is not a cell
    store's is refused, and changes nothing: config.json was rewritten before the store was
    checked (a mutation review). A new run writes config.json before its store (kept resumable)."""
    raw = {"seed": 0, "n_prompts": 16, "batch_size": 16, "timing": {"repeats": 1},
           "grid": {"N": [4, 6], "R": [10.0], "dtype": ["float64"]}, "solvers": {"ols": {}}}
    out = tmp_path / "run"
    run_matrix(parse_config(raw), out, progress=False)
    (out / "cells.sqlite").unlink()
    with sqlite3.connect(out / "cells.sqlite") as db:
        db.execute("CREATE TABLE cells (key TEXT PRIMARY KEY, foo)")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ConfigError, match="is not a cell store's"):
        run_matrix(parse_config({**raw, "grid": {**raw["grid"], "N": [6, 4]}}), out, resume=True, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_new_run_writes_config_json_before_its_store(tmp_path, monkeypatch):
    """A new run's config.json is written before cells.sqlite is opened, so a run killed at any
    point after its folder was made has the config --resume reads."""
    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(store.sqlite3, "connect", killed)
    with pytest.raises(KeyboardInterrupt):
        store.CellStore(tmp_path / "o", ("status",), resume=False, config_json='{"seed": 0}')
    assert (tmp_path / "o" / "config.json").read_text() == '{"seed": 0}'
