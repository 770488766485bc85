"""Crash safety: a run killed at any instant resumes to the table an uninterrupted run gives,
recomputing only the cells it had not finished; nothing half-written is ever merged."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import tomli_w

from icl_bench.bench import store as rundir
from icl_bench.bench.config import parse_config
from icl_bench.errors import ConfigError
from icl_bench.bench.cells import expand_cells
from icl_bench.bench.runner import run_matrix
from icl_bench.bench.schema import TIMING_COLUMNS

ROOT = Path(__file__).resolve().parents[1]  # the checkout under test


def _cli(*args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "icl_bench", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _stable(table: pd.DataFrame) -> pd.DataFrame:
    return table.drop(columns=list(TIMING_COLUMNS)).reset_index(drop=True)


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    """name -> (inode, mtime_ns) of the finished cell files."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.glob("*.json")}


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
    while len(list((out / "cells").glob("*.json"))) < 2:  # some cells finished ...
        assert proc.poll() is None, f"run ended before it could be killed: {proc.communicate()}"
        assert time.monotonic() < deadline, "no cell finished in 120 s"
        time.sleep(0.005)
    proc.kill()  # SIGKILL: no cleanup, no finally blocks
    proc.communicate()
    assert proc.returncode == -9
    done = _files(out / "cells")
    assert 2 <= len(done) < total  # ... but not all
    assert not (out / "results.parquet").exists() and not (out / "metadata.json").exists()

    resumed = _cli("run", "--config", str(cfg_path), "--out", str(out), "--no-progress", "--resume")
    stdout, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr
    after = _files(out / "cells")
    assert len(after) == total and not list((out / "cells").glob(".*.tmp"))
    assert {k: after[k] for k in done} == done  # finished cells were neither recomputed nor rewritten
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["n_cells_reused"] == len(done) and meta["n_cells"] == total
    reference = run_matrix(parse_config(SLOW), progress=False)  # uninterrupted, in memory
    pd.testing.assert_frame_equal(_stable(pd.read_parquet(out / "results.parquet")), _stable(reference))


KILL_AT_THIRD_RENAME = """
import os, signal, sys
real, calls = os.replace, []
def replace(src, dst):
    calls.append(dst)
    if len(calls) == 3:  # the third cell's temp file is written and fsynced, not yet renamed
        os.kill(os.getpid(), signal.SIGKILL)
    real(src, dst)
os.replace = replace
from icl_bench.cli import main
sys.exit(main(sys.argv[1:]))
"""

SMALL = {"seed": 1, "n_prompts": 40, "batch_size": 40, "timing": {"repeats": 1},
         "grid": {"N": [3, 6], "noise": [0.0, 0.5], "R": [10.0], "dtype": ["float32"]},
         "solvers": {"ols": {}, "scipy-lstsq": {}}}


def test_kill_between_temp_write_and_rename(tmp_path):
    cfg_path, out = tmp_path / "small.toml", tmp_path / "run"
    cfg_path.write_text(tomli_w.dumps(SMALL))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", KILL_AT_THIRD_RENAME, "run", "--config", str(cfg_path),
                        "--out", str(out), "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == -9, p.stderr
    stale = list((out / "cells").glob(".*.tmp"))
    assert len(stale) == 1 and json.loads(stale[0].read_text())["status"] == "ok"  # complete, but never renamed
    done = _files(out / "cells")
    assert len(done) == 1  # renames: config.json, the first cell, then the kill before the second
    (out / ".my-own-notes.tmp").write_text("not ours")  # a user's file: left alone
    (out / ".results.csv.123-abcd.tmp").write_text("half a ta")  # a table write cut short
    table = run_matrix(parse_config(SMALL), out, resume=True, progress=False)
    assert not list((out / "cells").glob(".*.tmp"))  # the orphan is cleaned up, not merged
    assert [p.name for p in out.glob(".*.tmp")] == [".my-own-notes.tmp"]
    assert {k: v for k, v in _files(out / "cells").items() if k in done} == done
    assert len(_files(out / "cells")) == len(table) == 8
    pd.testing.assert_frame_equal(_stable(table), _stable(run_matrix(parse_config(SMALL), progress=False)))


CORRUPTIONS = {
    "empty": b"",
    "truncated": None,  # the first 40 bytes of the real file
    "not-json": b"\x00\x00\x00garbage",
    "not-utf8": b'{"status": "\xff\xfe"}',
    "json-list": b"[1, 2, 3]",
    "missing-column": None,  # the real row without mse_vs_ols
    "bad-status": None,  # the real row with status "banana"
    "another-cell": None,  # a valid row of a different cell under this cell's name
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_cell_file_is_recomputed_never_merged(tmp_path, kind):
    out = tmp_path / "run"
    first = run_matrix(parse_config(SMALL), out, progress=False)
    cells = sorted((out / "cells").glob("*.json"))
    victim, other = cells[0], cells[1]
    row = json.loads(victim.read_text())
    data = {"truncated": victim.read_bytes()[:40], "another-cell": other.read_bytes(),
            "missing-column": json.dumps({k: v for k, v in row.items() if k != "mse_vs_ols"}).encode(),
            "bad-status": json.dumps({**row, "status": "banana"}).encode()}.get(kind, CORRUPTIONS[kind])
    victim.write_bytes(data)
    others = {k: v for k, v in _files(out / "cells").items() if k != victim.name}
    again = run_matrix(parse_config(SMALL), out, resume=True, progress=False)
    assert json.loads(victim.read_text())["_key"] == victim.stem  # rewritten with its own row
    assert {k: v for k, v in _files(out / "cells").items() if k != victim.name} == others
    assert json.loads((out / "metadata.json").read_text())["n_cells_reused"] == len(first) - 1
    pd.testing.assert_frame_equal(_stable(first), _stable(again))


def test_resume_with_another_config_is_refused_and_changes_nothing(tmp_path):
    out = tmp_path / "run"
    run_matrix(parse_config(SMALL), out, progress=False)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match=r"--resume: .* holds a run of another config"):
        run_matrix(parse_config({**SMALL, "seed": 2}), out, resume=True, progress=False)
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
    real = rundir.write_atomic

    def dies_at_csv(path, data):
        if path.name == "results.csv":
            raise KeyboardInterrupt  # stands in for a crash between the two table writes
        real(path, data)

    monkeypatch.setattr(rundir, "write_atomic", dies_at_csv)
    with pytest.raises(KeyboardInterrupt):
        run_matrix(parse_config(SMALL), out, resume=True, progress=False)
    assert not (out / "metadata.json").exists()  # the rewritten parquet is not vouched for by old metadata
    monkeypatch.setattr(rundir, "write_atomic", real)
    table = run_matrix(parse_config(SMALL), out, resume=True, progress=False)
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["n_cells_reused"] == 8 and len(pd.read_csv(out / "results.csv")) == len(table) == 8


def test_every_write_is_renamed_into_place_and_the_folder_fsynced(tmp_path, monkeypatch):
    synced, renamed = [], []
    from icl_bench import files

    real_fsync_dir, real_replace = files.fsync_dir, os.replace
    monkeypatch.setattr(files, "fsync_dir", lambda p: (synced.append(Path(p).name), real_fsync_dir(p)))
    monkeypatch.setattr(files.os, "replace", lambda a, b: (renamed.append(Path(b).name), real_replace(a, b)))
    out = tmp_path / "run"
    run_matrix(parse_config(SMALL), out, progress=False)
    assert len(renamed) == 1 + 8 + 3 and renamed[0] == "config.json" and renamed[-1] == "metadata.json"
    assert synced.count("cells") == 8 and synced.count("run") >= 3
    assert sorted(p.name for p in out.iterdir()) == [".icl-bench.lock", "cells", "config.json", "metadata.json",
                                                      "results.csv", "results.parquet"]


def test_a_second_writer_is_refused_while_the_first_holds_the_folder(tmp_path):
    out = tmp_path / "run"
    run_matrix(parse_config(SMALL), out, progress=False)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    lock = rundir.prepare(out, resume=True)  # stands in for a run in progress
    try:
        with pytest.raises(ConfigError, match="--out: .* is in use by another icl-bench run"):
            run_matrix(parse_config(SMALL), out, resume=True, progress=False)
    finally:
        lock.close()
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    run_matrix(parse_config(SMALL), out, resume=True, progress=False)  # released: fine again


def test_resume_after_the_data_file_changed_recomputes(tmp_path):
    data = tmp_path / "d.csv"
    data.write_text("x,y\n" + "".join(f"{i},{2 * i + 1}\n" for i in range(20)))
    raw = {**SMALL, "data": {"path": str(data), "x": "x", "y": "y"}}
    out = tmp_path / "run"
    run_matrix(parse_config(raw), out, progress=False)
    data.write_text("x,y\n" + "".join(f"{i},{-3 * i}\n" for i in range(20)))  # same name, new numbers
    from icl_bench.prompts.data import _columns

    _columns.cache_clear()
    table = run_matrix(parse_config(raw), out, resume=True, progress=False)
    assert json.loads((out / "metadata.json").read_text())["n_cells_reused"] == 0
    pd.testing.assert_frame_equal(_stable(table), _stable(run_matrix(parse_config(raw), progress=False)))
