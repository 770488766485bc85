import json
import math
import os
import sqlite3
import warnings

import pandas as pd
import pytest
import torch

from icl_bench import Solver, register_solver
from icl_bench.cli import main
from icl_bench.bench.config import parse_config
from icl_bench.solvers.registry import REGISTRY
from icl_bench.bench.cells import expand_cells
from icl_bench.bench.runner import run_matrix
from icl_bench.bench.schema import COLUMNS, TIMING_COLUMNS

CONTRACT_COLUMNS = ["solver", "solver_params", "N", "noise", "R", "dtype", "device", "seed", "n_prompts",
                  "mse_vs_ols", "mse_vs_truth", "mse_vs_target", "abs_err_median", "abs_err_p99", "n_nonfinite",
                  "prompts_per_s", "batch_size", "weight_sparsity", "weight_l1", "status", "message"]


def _stable(table: pd.DataFrame) -> pd.DataFrame:
    return table.drop(columns=list(TIMING_COLUMNS)).reset_index(drop=True)


def test_writes_three_files_with_every_design_column(tmp_path, tiny_raw):
    out = tmp_path / "run"
    table = run_matrix(parse_config(tiny_raw), out, progress=False)
    assert set(CONTRACT_COLUMNS) <= set(table.columns)
    for name in ("results.parquet", "results.csv", "metadata.json"):
        assert (out / name).is_file()
    assert _stable(pd.read_parquet(out / "results.parquet")).equals(_stable(table))
    assert len(pd.read_csv(out / "results.csv")) == len(table) == 2 * 2 * 2 * 2
    meta = json.loads((out / "metadata.json").read_text())
    for key in ("config", "seed", "packages", "device", "git_commit", "started_at", "finished_at"):
        assert key in meta
    assert meta["packages"]["torch"] == torch.__version__
    from icl_bench.solvers import fused, fused_cpu  # the CPU and numba's vector width move ols's last bits

    assert meta["device"]["cpu_model"] and meta["device"]["numba_vectors"] == (fused_cpu.describe() if fused.available() else None)
    assert meta["solvers"]["ols"].startswith("plugin icl_bench_baselines.ols:OLS (icl-bench ")  # a plugin's version
    assert sorted(meta["solvers"]) == ["ols", "scipy-lstsq"]  # was on record nowhere (a new-user tryout)
    assert (table.status == "ok").all() and (table.n_nonfinite == 0).all()
    assert (table.prompts_per_s > 0).all() and table.weight_sparsity.isna().all()


def test_ols_and_scipy_agree_on_the_default_grid():
    raw = {"n_prompts": 256, "batch_size": 256, "timing": {"repeats": 1},
           "grid": {"N": [10, 30, 100, 300], "noise": [0.0, 0.1, 0.5], "R": [10.0], "dtype": ["float64"]},
           "solvers": {"ols": {}, "scipy-lstsq": {}}}
    from icl_bench.bench.cells import cell_prompts
    from icl_bench.solvers.registry import get_solver

    for cell in expand_cells(parse_config(raw))[::2]:
        batch = cell_prompts(cell.prompts, cell.N, cell.noise, cell.R, cell.n_prompts, cell.seed, "float64", "cpu")
        a, b = get_solver("ols").predict(batch), get_solver("scipy-lstsq").predict(batch)
        rel = ((a - b).abs() / b.abs().clamp_min(1.0)).max().item()
        assert rel <= 1e-10, (cell.N, cell.noise, rel)


def test_prompts_shared_by_solvers_and_dtypes_of_a_grid_point(tiny_raw):
    table = run_matrix(parse_config(tiny_raw), progress=False)
    # ols in float64 is the reference itself: exactly zero error on every cell
    assert (table[(table.solver == "ols") & (table.dtype == "float64")].mse_vs_ols < 1e-25).all()
    clean = table[(table.noise == 0.0) & (table.solver == "ols")]
    assert (clean.mse_vs_truth < 1e-8).all()


def test_same_config_same_table_twice(tiny_raw):
    cfg = parse_config(tiny_raw)
    a, b = run_matrix(cfg, progress=False), run_matrix(cfg, progress=False)
    pd.testing.assert_frame_equal(_stable(a), _stable(b))
    tiny_raw["seed"] = 1
    c = run_matrix(parse_config(tiny_raw), progress=False)
    assert not (_stable(c).mse_vs_target.values == _stable(a).mse_vs_target.values).all()


def test_cuda_cells_skip_with_reason_when_no_cuda(tiny_raw):
    tiny_raw["grid"]["device"] = ["cpu", "cuda"]
    table = run_matrix(parse_config(tiny_raw), progress=False)
    cuda = table[table.device == "cuda"]
    if torch.cuda.is_available():
        assert (cuda.status == "ok").all()
    else:
        assert (cuda.status == "skipped").all()
        assert cuda.message.str.contains("CUDA is not available").all()
    assert (table[table.device == "cpu"].status == "ok").all()


class Exploding(Solver):
    """Raises inside predict for N > 5."""

    params = {}

    def predict(self, batch):
        if batch.N > 5:
            raise RuntimeError("boom")
        return batch.y.mean(dim=1)


def test_failing_cell_is_a_row_and_run_continues_exit_1(tmp_path, tiny_raw, capsys):
    register_solver("test-exploding")(Exploding)
    try:
        tiny_raw["solvers"] = {"test-exploding": {}, "ols": {}}
        import tomli_w

        (tmp_path / "c.toml").write_text(tomli_w.dumps(tiny_raw))
        code = main(["run", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "o"), "--no-progress"])
        assert code == 1
        table = pd.read_parquet(tmp_path / "o" / "results.parquet")
        bad = table[table.solver == "test-exploding"]
        assert set(bad[bad.N == 12].status) == {"error"} and set(bad[bad.N == 5].status) == {"ok"}
        assert bad[bad.N == 12].message.str.startswith("RuntimeError: boom").all()
        assert (table[table.solver == "ols"].status == "ok").all()
        assert "error: test-exploding" in capsys.readouterr().err
    finally:
        REGISTRY.unregister("test-exploding")


def test_resume_skips_finished_cells_and_refuses_non_empty_out(tmp_path, tiny_raw):
    cfg = parse_config(tiny_raw)
    out = tmp_path / "o"
    first = run_matrix(cfg, out, progress=False)
    with pytest.raises(Exception, match="--out: .* is not empty; pass --resume"):
        run_matrix(cfg, out, progress=False)
    with sqlite3.connect(out / "cells.sqlite") as db:
        keys = [k for (k,) in db.execute("SELECT key FROM cells ORDER BY key")]
        db.execute("DELETE FROM cells WHERE key = ?", (keys[0],))  # lost
        db.execute("UPDATE cells SET mse_vs_ols = 0.5 WHERE key = ?", (keys[1],))  # altered: fails its CRC
        before = {k: s for k, s in db.execute("SELECT key, started_at FROM cells") if k in keys[2:]}
    db.close()
    again = run_matrix(cfg, out, resume=True, progress=False)
    with sqlite3.connect(out / "cells.sqlite") as db:
        after = dict(db.execute("SELECT key, started_at FROM cells"))
    db.close()
    assert {k: after[k] for k in before} == before and len(after) == len(first)  # untouched
    assert json.loads((out / "metadata.json").read_text())["n_cells_reused"] == len(first) - 2
    pd.testing.assert_frame_equal(_stable(first), _stable(again))


def test_csv_data_source_reports_no_truth(tmp_path):
    raw = {"n_prompts": 50, "batch_size": 50, "grid": {"N": [10, 30], "R": [100.0], "dtype": ["float64"]},
           "solvers": {"ols": {}, "scipy-lstsq": {}}, "timing": {"repeats": 1},
           "data": {"path": "matplotlib:msft.csv", "x": "Open", "y": "Close"}}
    table = run_matrix(parse_config(raw), progress=False)
    assert (table.status == "ok").all()
    assert table.mse_vs_truth.isna().all() and table.noise.isna().all()
    assert (table.mse_vs_target > 0).all() and (table.mse_vs_target < 10).all()  # next-day close ~ open: dollars
    assert (table[table.solver == "ols"].mse_vs_ols < 1e-20).all()
    assert (table[table.solver == "scipy-lstsq"].mse_vs_ols < 1e-18).all()


def test_cli_data_flags(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('n_prompts = 20\nbatch_size = 20\n[grid]\nN = [8]\n[solvers.ols]\n[timing]\nrepeats = 1\n')
    code = main(["run", "--config", str(cfg), "--data", "matplotlib:msft.csv", "--x", "Open", "--y", "Close",
                 "--out", str(tmp_path / "o"), "--no-progress"])
    assert code == 0
    table = pd.read_csv(tmp_path / "o" / "results.csv")
    assert json.loads(table.prompts[0])["csv"]["x"] == "Open" and math.isnan(table.mse_vs_truth[0])


def test_batch_size_is_the_size_of_the_calls(tmp_path):
    """batch_size records the prompts per predict() call: with fewer prompts than the config's
    batch_size the one call holds n_prompts of them, and the row says so."""
    raw = {"n_prompts": 24, "batch_size": 64, "grid": {"N": [6]}, "solvers": {"ols": {}}, "timing": {"repeats": 1}}
    table = run_matrix(parse_config(raw), progress=False)
    assert (table.status == "ok").all() and (table.batch_size == 24).all()
    table = run_matrix(parse_config(dict(raw, batch_size=10)), progress=False)
    assert (table.batch_size == 10).all()


def test_every_column_listed_once():
    assert len(COLUMNS) == len(set(COLUMNS))


def test_a_worker_with_other_code_or_checkpoints_gives_an_error_row_not_numbers(tmp_path, monkeypatch):
    # a Dask worker runs run_cell_task with the code and files of its own machine: a cell keyed by
    # the driver's digests must not be computed (and cached) with others
    from icl_bench.bench import cells as cells_mod
    from icl_bench.bench.runner import run_cell_task
    from icl_bench.resources import models_dir

    for side, extra in (("driver", b""), ("worker", b"\n")):
        (tmp_path / side / "models").mkdir(parents=True)
        for f in ("trained-l1-R100.json", "trained-l1-R100.safetensors"):
            src = models_dir() / f
            dst = tmp_path / side / "models" / f
            dst.write_bytes(src.read_bytes() + (extra if f.endswith(".json") else b""))
    raw = {"seed": 0, "n_prompts": 16, "batch_size": 16, "timing": {"repeats": 1},
           "grid": {"N": [8], "R": [100.0], "dtype": ["float64"]},
           "solvers": {"ols": {}, "trained-l1": {"models_dir": "models"}}}
    monkeypatch.chdir(tmp_path / "driver")
    ols, trained = expand_cells(parse_config(raw))
    assert run_cell_task(trained, executor="dask")["status"] == "ok"  # the same files: computed
    monkeypatch.chdir(tmp_path / "worker")  # the worker's relative models_dir holds other bytes
    row = run_cell_task(trained, executor="dask")
    assert row["status"] == "error" and "inputs_sha256" in row["message"] and math.isnan(row["mse_vs_ols"]), row
    # a later run whose driver reads those bytes too (a checkpoint retrained in place): the
    # long-lived worker reads its files again, it keeps no digest of the earlier run
    (_, again) = expand_cells(parse_config(raw))
    assert run_cell_task(again, executor="dask")["status"] == "ok"
    # a solver registered from a script (its module is __main__: on a hand-started worker that is
    # the dask command, another file) cannot be compared, and is not
    cls = type("ScriptMean", (cells_mod.get_solver_class("ols"),), {"__module__": "__main__"})
    monkeypatch.setattr(cells_mod, "get_solver_class", lambda name: cls)
    cells_mod._codes_here.cache_clear()
    assert cells_mod.digest_mismatch(ols.__class__(**{**ols.__dict__, "code_sha256": "0" * 64})) == ""
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path / "worker")
    cells_mod._codes_here.cache_clear()
    other = ols.__class__(**{**ols.__dict__, "code_sha256": "0" * 64})  # the driver ran other code
    row = run_cell_task(other, executor="dask")
    assert row["status"] == "error" and "code_sha256 000000000000 on the driver" in row["message"], row
    assert row["executor"] == "dask" and row["worker"]
    assert run_cell_task(other, executor="local")["status"] == "ok"  # the driver's own process: nothing to compare


def test_more_timing_threads_than_usable_cpus_is_a_warning(tiny_raw, monkeypatch):
    """`[timing] threads = 1000` on a 2-CPU machine was accepted without a word, and every cell's
    time then measured threads waiting for a core: a local run says so (the config stays valid:
    it may be meant for a larger machine)."""
    tiny_raw["solvers"] = {"ols": {}}
    tiny_raw["grid"].update(N=[5], noise=[0.0], dtype=["float64"])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    with pytest.warns(UserWarning, match=r"timing.threads = 3, but this process may use 2 CPUs"):
        run_matrix(parse_config({**tiny_raw, "timing": {"repeats": 1, "threads": 3}}), progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as many threads as CPUs: no warning
        run_matrix(parse_config({**tiny_raw, "timing": {"repeats": 1, "threads": 2}}), progress=False)


@pytest.mark.parametrize("scheduler, warns", [("", True), ("tcp://elsewhere:8786", False)])
def test_the_threads_warning_covers_a_local_cluster_and_not_a_remote_one(tiny_raw, monkeypatch, scheduler, warns):
    """A LocalCluster's workers share this machine's CPUs, so too many threads there warn as on a
    local run; a running cluster's workers have CPUs of their own (a review). The executor is a
    stand-in that runs the cells here, under the dask executor's kind."""
    import icl_bench.bench.runner as runner
    from icl_bench.bench.executors import LocalExecutor

    monkeypatch.setattr(runner, "make_executor", lambda cfg: type("Stand", (LocalExecutor,), {"kind": "dask"})())
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    tiny_raw.update(solvers={"ols": {}}, timing={"repeats": 1, "threads": 3}, executor={"kind": "dask", "scheduler": scheduler})
    tiny_raw["grid"].update(N=[5], noise=[0.0], dtype=["float64"])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run_matrix(parse_config(tiny_raw), progress=False)
    assert any("timing.threads = 3, but this process may use 2 CPUs" in str(w.message) for w in seen) == warns
