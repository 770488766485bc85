"""The d axis of the matrix: d = [1] (the default) is the one-dimensional path bit for bit; d > 1
runs the solvers that have a multivariate path and skips the others with the reason."""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict

import pytest
import torch

from icl_bench.bench.cells import cell_prompts, expand_cells, prompt_seed
from icl_bench.bench.config import parse_config
from icl_bench.bench.metrics import prediction_metrics
from icl_bench.bench.runner import run_matrix
from icl_bench.bench.schema import TIMING_COLUMNS
from icl_bench.errors import ConfigError
from icl_bench.prompts.generator import PromptSpec, sample_prompts
from icl_bench.solvers.registry import get_solver

SOLVERS = {"ols": {}, "scipy-lstsq": {}, "gd": {"steps": 4}, "gd-lsa": {"steps": 4}, "ln-closed-form": {}}


def raw(**grid) -> dict:
    return {"seed": 3, "n_prompts": 48, "batch_size": 48, "timing": {"repeats": 1},
            "grid": {"N": [12], "noise": [0.1], "R": [100.0], "dtype": ["float32", "float64"], "device": ["cpu"], **grid},
            "solvers": SOLVERS}


def stable(t):
    return t.drop(columns=list(TIMING_COLUMNS)).reset_index(drop=True)


def test_default_d_is_one_and_cell_keys_and_seeds_are_the_1d_ones():
    cfg = parse_config(raw())
    assert cfg.grid.d == [1]
    for cell in expand_cells(cfg):
        old = {k: v for k, v in asdict(cell).items() if k not in ("d", "ood", "data_sha256", "inputs_sha256", "optional")}  # pre-d, pre-ood key
        assert cell.key == hashlib.sha1(json.dumps(old, sort_keys=True, allow_nan=True).encode()).hexdigest()[:20]
    seed_1d = int.from_bytes(hashlib.sha256(json.dumps([3, 12, 0.1]).encode()).digest()[:7], "little")
    assert prompt_seed(3, 12, 0.1) == prompt_seed(3, 12, 0.1, 1) == seed_1d
    assert prompt_seed(3, 12, 0.1, 2) != seed_1d


def test_d1_matrix_is_the_1d_path_bit_for_bit():
    implicit = run_matrix(parse_config(raw()), progress=False)
    explicit = run_matrix(parse_config(raw(d=[1])), progress=False)
    assert stable(implicit).equals(stable(explicit)) and (implicit.d == 1).all() and (implicit.status == "ok").all()
    # every row equals the 1-D API run by hand: sample_prompts at the grid point's seed, predict, metrics
    for row in implicit.itertuples():
        batch = sample_prompts(PromptSpec(N=12, noise=0.1, R=100.0), 48, seed=prompt_seed(3, 12, 0.1),
                               dtype=row.dtype)
        assert batch.x.shape == (48, 12) and batch.d == 1
        pred = get_solver(row.solver, **json.loads(row.solver_params)).predict(batch)
        m = prediction_metrics(pred, batch)
        assert m["mse_vs_ols"] == row.mse_vs_ols and m["abs_err_p99"] == row.abs_err_p99, row.solver


def test_d3_cells_run_the_multivariate_paths_and_skip_the_rest(tmp_path):
    cfg = raw(d=[1, 3], dtype=["float64"])
    cfg["solvers"] = {**SOLVERS, "trained-l1": {}}
    t = run_matrix(parse_config(cfg), tmp_path / "run", progress=False)
    d3 = t[t.d == 3].set_index("solver")
    assert (d3.drop(index="trained-l1").status == "ok").all(), d3[["status", "message"]]
    assert d3.loc["trained-l1", "status"] == "skipped"
    assert d3.loc["trained-l1", "message"] == "trained-l1 handles one regressor only (d = 1); this cell has d = 3"
    assert d3.loc["ols", "mse_vs_ols"] < 1e-24 and d3.loc["scipy-lstsq", "mse_vs_ols"] < 1e-20
    assert d3.loc["ln-closed-form", "mse_vs_ols"] < 1e-3  # R = 100: O(1/R^4)
    assert d3.loc["gd", "mse_vs_ols"] == d3.loc["gd-lsa", "mse_vs_ols"] or \
        abs(d3.loc["gd", "mse_vs_ols"] / d3.loc["gd-lsa", "mse_vs_ols"] - 1) < 1e-9
    cells = {c.d: c for c in expand_cells(parse_config(cfg)) if c.solver == "ols"}
    assert cells[1].key != cells[3].key
    b = cell_prompts(cells[3].prompts, 12, 0.1, 100.0, 48, 3, "float64", "cpu", 3)
    assert b.x.shape == (48, 12, 3) and b.tokens.shape == (48, 13, 5) and b.d == 3
    assert math.isfinite(d3.loc["ols", "mse_vs_truth"])


def test_a_plugin_without_a_multivariate_path_is_skipped(monkeypatch):
    from icl_bench import Solver, register_solver
    from icl_bench.solvers import registry

    @register_solver("mean-y-test")
    class MeanY(Solver):
        """Predicts the mean of y (a stand-in for a 1-D plugin)."""

        def predict(self, batch):
            return batch.y.mean(dim=1)

    try:
        cfg = raw(d=[2], dtype=["float64"])
        cfg["solvers"] = {"mean-y-test": {}}
        t = run_matrix(parse_config(cfg), progress=False)
        assert t.status.tolist() == ["skipped"] and "d = 2" in t.message.iloc[0]
    finally:
        registry.REGISTRY.unregister("mean-y-test")


@pytest.mark.parametrize("grid,msg", [({"d": [0]}, "grid.d"), ({"d": [1.5]}, "grid.d"), ({"d": [65]}, "grid.d")])
def test_bad_d_is_one_config_error(grid, msg):
    with pytest.raises(ConfigError, match=msg):
        parse_config(raw(**grid))


def test_csv_data_refuses_d_above_one(tmp_path):
    csv = tmp_path / "data.csv"
    csv.write_text("x,y\n" + "\n".join(f"{i},{2 * i}" for i in range(40)))
    cfg = raw(d=[2])
    cfg["data"] = {"path": str(csv), "x": "x", "y": "y"}
    with pytest.raises(ConfigError, match="grid.d"):
        parse_config(cfg)
    assert torch.get_default_dtype() == torch.float32


def test_report_reads_runs_without_a_d_column_and_fixes_d_in_the_headline(tmp_path):
    import pandas as pd

    from icl_bench.report.aggregate import aggregate, headline, load_run, load_runs, representative

    cfg = raw(d=[1, 2], dtype=["float64"])
    cfg["solvers"] = {"ols": {}, "ln-closed-form": {}}
    run_matrix(parse_config(cfg), tmp_path / "run", progress=False)
    table, _ = load_runs([tmp_path / "run"])
    setting = representative(table)
    assert setting["d"] == 1 and representative(table, {"d": "2"})["d"] == 2
    head = headline(aggregate(table), representative(table, {"d": "2"}))
    assert len(head) == 2  # one row per solver: the d = 1 cells are not mixed in
    old = tmp_path / "old"
    old.mkdir()
    pd.read_parquet(tmp_path / "run" / "results.parquet").query("d == 1").drop(columns=["d"]).to_parquet(old / "results.parquet")
    legacy, _ = load_run(old)  # a run written before the d axis existed
    assert (legacy.d == 1).all() and representative(legacy)["d"] == 1
