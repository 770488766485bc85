"""Determinism: one config + seed gives identical result files in two separate processes (timing
and wall-clock columns aside); another seed gives other prompts."""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import tomli_w
import torch

from icl_bench import PromptSpec, sample_prompts
from icl_bench.bench.config import parse_config
from icl_bench.bench.cells import cell_prompts, expand_cells, prompt_seed
from icl_bench.bench.schema import RESULT_COLUMNS, TIMING_COLUMNS

ROOT = Path(__file__).resolve().parents[1]
TIME_KEYS = ("started_at", "finished_at", "command", "sessions")  # metadata.json's wall-clock fields, and the
#   command (its --out), which `sessions` holds too (compared below without them)
RAW = {"seed": 11, "n_prompts": 50, "batch_size": 20, "timing": {"repeats": 1},
       "grid": {"N": [2, 9], "noise": [0.3], "R": [10.0], "dtype": ["float32", "float64"]}}
# no [solvers]: every registered solver, so each new one is checked as it lands


def _run_twice(cfg: Path, outs: list[Path]) -> None:
    """`icl-bench run` into each folder, as separate processes started side by side."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-m", "icl_bench", "run", "--config", str(cfg), "--out", str(out),
                               "--no-progress"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for out in outs]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode in (0, 1), err.decode()  # 1: some cell errored (reported in its row)


def _csv_without_timing(path: Path) -> str:
    table = pd.read_csv(path, dtype=str, keep_default_na=False)  # the text exactly as written
    return table.drop(columns=list(TIMING_COLUMNS)).to_csv(index=False)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("det")
    (tmp / "c.toml").write_text(tomli_w.dumps(RAW))
    _run_twice(tmp / "c.toml", [tmp / "a", tmp / "b"])
    return tmp / "a", tmp / "b"


def test_same_seed_same_files_in_two_processes(two_runs):
    a, b = two_runs
    ta, tb = pd.read_parquet(a / "results.parquet"), pd.read_parquet(b / "results.parquet")
    assert len(ta) == len(expand_cells(parse_config(RAW)))
    assert set(ta.status) <= {"ok", "skipped"}, ta[ta.status == "error"].message.tolist()  # errors compare equal too
    assert (ta.status == "ok").mean() >= 0.5 and ta[ta.status == "ok"].mse_vs_ols.notna().all()
    pd.testing.assert_frame_equal(ta.drop(columns=list(TIMING_COLUMNS)), tb.drop(columns=list(TIMING_COLUMNS)),
                                  check_exact=True)
    assert _csv_without_timing(a / "results.csv") == _csv_without_timing(b / "results.csv")
    ma, mb = (json.loads((d / "metadata.json").read_text()) for d in (a, b))
    assert {k: v for k, v in ma.items() if k not in TIME_KEYS} == {k: v for k, v in mb.items() if k not in TIME_KEYS}
    assert [{k: v for k, v in s.items() if k not in TIME_KEYS} for s in ma["sessions"]] == \
           [{k: v for k, v in s.items() if k not in TIME_KEYS} for s in mb["sessions"]]
    stable = [c for c in RESULT_COLUMNS if c not in TIMING_COLUMNS]
    sql = f"SELECT key, {', '.join(stable)} FROM cells ORDER BY key"
    rows_a, rows_b = (sqlite3.connect(d / "cells.sqlite").execute(sql).fetchall() for d in (a, b))
    assert len(rows_a) == len(ta) and rows_a == rows_b  # the stored rows too, value for value


def test_different_seeds_give_different_prompts():
    spec = PromptSpec(N=9, noise=0.3, R=10.0)
    a, b = sample_prompts(spec, 50, seed=0), sample_prompts(spec, 50, seed=1)
    for field in ("x", "y", "x_query", "slope", "intercept"):
        assert not torch.equal(getattr(a, field), getattr(b, field)), field
    # through the runner: the run seed reaches every grid point's prompts, and grid points differ
    cfg0, cfg1 = parse_config(RAW), parse_config({**RAW, "seed": 12})
    c0, c1 = expand_cells(cfg0)[0], expand_cells(cfg1)[0]
    p0 = cell_prompts(c0.prompts, c0.N, c0.noise, c0.R, c0.n_prompts, c0.seed, c0.dtype, c0.device)
    p1 = cell_prompts(c1.prompts, c1.N, c1.noise, c1.R, c1.n_prompts, c1.seed, c1.dtype, c1.device)
    assert not torch.equal(p0.x, p1.x)
    seeds = {prompt_seed(11, N, noise) for N in (2, 9) for noise in (0.0, 0.3)}
    assert len(seeds) == 4 and prompt_seed(11, 2, 0.0) != prompt_seed(12, 2, 0.0)


def test_every_R_of_a_grid_point_reads_the_same_prompts():
    """R is the embedding constant, not part of the prompt: each R drew its own prompts, so an
    error-vs-R curve mixed the sampling noise of independent draws into its slope (gd, which does
    not read R, read a slope of -0.04 [-0.96, 0.88] on the default matrix). The R values of a grid
    point now share the prompts (paired), and a solver that ignores R reads the same error at each."""
    from icl_bench.bench.runner import run_matrix

    cfg = parse_config({**RAW, "grid": {**RAW["grid"], "R": [10.0, 1000.0]}, "solvers": {"gd": {}, "ln-closed-form": {}}})
    cells = [c for c in expand_cells(cfg) if c.N == 9 and c.dtype == "float32" and c.solver == "gd"]
    batches = [cell_prompts(c.prompts, c.N, c.noise, c.R, c.n_prompts, c.seed, c.dtype, c.device) for c in cells]
    assert [c.R for c in cells] == [10.0, 1000.0]
    for field in ("x", "y", "x_query", "y_query", "ols_prediction"):
        assert torch.equal(getattr(batches[0], field), getattr(batches[1], field)), field
    assert not torch.equal(batches[0].tokens, batches[1].tokens)  # (R is in the embedding)
    table = run_matrix(cfg, progress=False)
    by_R = table.set_index(["solver", "N", "dtype", "R"])["mse_vs_ols"].unstack("R")
    assert (by_R.loc["gd", 10.0] == by_R.loc["gd", 1000.0]).all()
    assert (by_R.loc["ln-closed-form", 10.0] != by_R.loc["ln-closed-form", 1000.0]).all()  # (it reads R)


def test_data_prompts_are_seeded_too(tmp_path):
    csv = tmp_path / "d.csv"
    csv.write_text("x,y\n" + "\n".join(f"{i},{2 * i + 1}" for i in range(30)) + "\n")
    grid = {k: v for k, v in RAW["grid"].items() if k != "noise"}  # CSV prompts have no noise to set
    raw = {**RAW, "grid": grid, "data": {"path": str(csv), "x": "x", "y": "y"}}
    cells = expand_cells(parse_config(raw))
    c = cells[0]
    one = cell_prompts(c.prompts, c.N, c.noise, c.R, c.n_prompts, c.seed, c.dtype, c.device)
    cell_prompts.cache_clear()
    two = cell_prompts(c.prompts, c.N, c.noise, c.R, c.n_prompts, c.seed, c.dtype, c.device)
    assert one is not two and torch.equal(one.x, two.x) and torch.equal(one.y_query, two.y_query)
    other = expand_cells(parse_config({**raw, "seed": 12}))[0]
    three = cell_prompts(other.prompts, other.N, other.noise, other.R, other.n_prompts, other.seed, other.dtype, other.device)
    assert not torch.equal(one.x, three.x)
