"""Report: aggregation equals a direct pandas computation, plots have the right axes and one
line / bar per solver, `icl-bench publish` writes md / CSV / PNG / HTML atomically, bad input is
one line and exit 2. One tiny run (64 prompts per cell) is shared by the module."""
import json
import os
import math
import shutil
import statistics
import warnings
from pathlib import Path

import numpy as np
import scipy.stats
import pandas as pd
import pytest
import torch
from scipy import stats

from icl_bench import Param, Solver, register_solver
from icl_bench.cli import main
from icl_bench.errors import ConfigError
from icl_bench.bench.config import parse_config
from icl_bench.solvers.registry import REGISTRY
from icl_bench.bench.runner import run_matrix
from icl_bench.solvers.transformer import Transformer, TransformerConfig


class PlusInverseSteps(Solver):
    """OLS + 1/steps: MSE vs OLS is exactly 1/steps^2 (a stand-in for an iterative solver)."""

    params = {"steps": Param(1, "iterations", min=1)}

    def predict(self, batch):
        return batch.ols_prediction.to(batch.dtype) + 1.0 / self.values["steps"]


class MeanWithWeights(Solver):
    """Context mean of y, with a fixed 2x2 'weight matrix': sparsity 0.5, L1 3.00001."""

    def predict(self, batch):
        return batch.y.mean(1)

    def weights(self):
        return {"w": torch.tensor([[1.0, 0.0], [1e-5, 2.0]], dtype=torch.float64)}


class FailsAtN12(Solver):
    """OLS, except that it raises at N = 12 (an error row every report must list)."""

    def predict(self, batch):
        if batch.x.shape[1] == 12:
            raise RuntimeError("boom at N=12")
        return batch.ols_prediction.to(batch.dtype)


TEST_SOLVERS = {"test-steps": PlusInverseSteps, "test-weighted": MeanWithWeights, "test-fails": FailsAtN12}
RAW = {
    "seed": 0, "n_prompts": 64, "batch_size": 64, "timing": {"repeats": 1},
    "grid": {"N": [5, 12], "noise": [0.0, 0.1], "R": [10.0, 100.0], "dtype": ["float32", "float64"], "device": ["cpu"]},
    "solvers": {"ols": {}, "scipy-lstsq": {}, "test-steps": {"steps": [1, 2, 4]}, "test-weighted": {}, "test-fails": {}},
}
SERIES = ["ols", "scipy-lstsq", "test-fails", "test-steps steps=1", "test-steps steps=2", "test-steps steps=4", "test-weighted"]


@pytest.fixture(scope="module")
def solvers():
    for name, cls in TEST_SOLVERS.items():
        register_solver(name)(cls)
    yield
    for name in TEST_SOLVERS:
        REGISTRY.unregister(name)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, solvers):
    out = tmp_path_factory.mktemp("runs") / "seed0"
    run_matrix(parse_config(RAW), out, progress=False)
    return out


@pytest.fixture(scope="module")
def published(run_dir):
    """The run published by the CLI. The model plots (weights, probes) have their own tests and
    are the slowest to draw, so this report leaves them out (a note says so)."""
    from icl_bench.report import model_plots
    from icl_bench.report import publish as pub

    out = run_dir.parent / "published"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_plots, "collect_models", lambda *a, **k: ({}, ["model plots left out (fast test)"]))
        mp.setattr(pub, "_close", FIGS.update)  # keep the drawn figures: the plot tests check them
        assert main(["publish", str(run_dir), "--out", str(out)]) == 0
    return out


FIGS = {}  # the figures the published report drew, by name (drawing them again would double the time)


@pytest.fixture(scope="module")
def figs(published):
    return FIGS


@pytest.fixture(scope="module")
def tables(run_dir):
    from icl_bench.report import aggregate as report

    table, _ = report.load_runs([run_dir])
    summary = report.aggregate(table)
    return table, summary, report.representative(table)


def test_publish_writes_markdown_csv_png_and_html(published):
    for name in ("index.html", "report.md", "headline.md", "summary.csv", "summary.md", "failures.csv",
                 "failures.md", "sparsity.csv", "sparsity.md", "results.csv", "publish.json"):
        assert (published / name).is_file(), name
    pngs = sorted(p.name for p in (published / "plots").glob("*.png"))
    assert {"mse_vs_n.png", "mse_vs_r.png", "gd_steps.png", "throughput.png"} <= set(pngs)
    page = (published / "index.html").read_text()
    for name in pngs:
        assert f'<a href="plots/{name}"><img src="plots/{name}"' in page  # every figure links to its full size
        assert (published / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "git_commit" in page and "packages" in page and "config" in page
    md = (published / "report.md").read_text()  # the markdown names its runs' facts and the scaling fits' setting too
    assert f"## Runs\n\n- `{published.parent / 'seed0'}`: command " in md and "status_counts {" in md
    assert ", git_commit " in md  # the command that made the run first (its seed and commit follow)
    assert "Against R at N = 5, noise = 0, device = cpu; against N at R = 10, noise = 0, device = cpu;" in md
    # the interval's caveat beside the headline on the page too, not only in the markdown (a review)
    assert ('<p class="note">The 95 % CI (over the prompts, on the log scale: [m / f, m · f], f = exp(t · se / m), not m ± t · se) '
            'under-covers these heavy-tailed errors, as '
            "measured and described in docs/report.md (<code>icl-bench docs report</code>)") in page
    assert "results/ci_coverage.md" not in page  # not in an installed package: the docs it ships are cited (a review)
    assert "; the 95 % CI (over the prompts, on the log scale: [m / f, m · f]" in (published / "headline.md").read_text()
    head = (published / "headline.md").read_text()
    assert f"icl-bench publish {published.parent / 'seed0'} --out {published}`" in head  # --force was not passed
    assert f"--out {published}</code> (add <code>--force</code> to regenerate" in page
    assert "`" not in page and "<code>icl-bench run --config ood</code>" in page  # notes' code spans, as report.md's
    assert "`icl-bench run --config ood`" in md
    assert oct((published).stat().st_mode & 0o777) == "0o755" and oct((published / "plots").stat().st_mode & 0o777) == "0o755"
    assert {oct(p.stat().st_mode & 0o777) for p in published.rglob("*") if p.is_file()} == {"0o644"}
    assert not [p for p in published.parent.iterdir() if p.name.startswith(".")]  # no temp folders left


def test_summary_equals_direct_pandas_aggregation(run_dir, published):
    raw = pd.read_parquet(run_dir / "results.parquet")
    ok = raw[raw.status == "ok"]
    keys = ["solver", "solver_params", "N", "noise", "R", "dtype", "device"]
    direct = ok.groupby(keys).agg(mse_vs_ols=("mse_vs_ols", "mean"), mse_vs_truth=("mse_vs_truth", "mean"),
                                  prompts_per_s=("prompts_per_s", "median"), n_prompts=("n_prompts", "sum"))
    summary = pd.read_csv(published / "summary.csv", dtype={"solver_params": str}).set_index(keys).sort_index()
    direct = direct.sort_index()
    assert list(summary.index) == list(direct.index)
    for col in direct.columns:
        np.testing.assert_allclose(summary[col], direct[col], rtol=1e-12, atol=0)
    # 95 % CI: the delta-method log interval of report.py, recomputed here with scipy
    row = ok[(ok.solver == "test-weighted") & (ok.N == 12)].iloc[0]
    t = stats.t.ppf(0.975, row.n_prompts - 1)
    f = math.exp(t * row.mse_vs_ols_se / row.mse_vs_ols)
    got = summary.loc[tuple(row[k] for k in keys)]
    assert got.mse_vs_ols_ci_low == pytest.approx(row.mse_vs_ols / f, rel=1e-12)
    assert got.mse_vs_ols_ci_high == pytest.approx(row.mse_vs_ols * f, rel=1e-12)
    steps4 = summary.xs(('test-steps', '{"steps": 4}'), level=("solver", "solver_params"))
    np.testing.assert_allclose(steps4.mse_vs_ols, 1 / 16, rtol=1e-5)


def test_standard_error_column_is_std_over_sqrt_n(solvers):
    from icl_bench.solvers.registry import get_solver
    from icl_bench.bench.cells import Cell, cell_prompts
    from icl_bench.bench.runner import run_cell

    cell = Cell("test-weighted", "{}", 12, 0.1, 10.0, "float64", "cpu", 0, 64, 64, json.dumps({}), 1, 1.0)
    row = run_cell(cell)
    batch = cell_prompts(cell.prompts, 12, 0.1, 10.0, 64, 0, "float64", "cpu")
    sq = [float(v) for v in (get_solver("test-weighted").predict(batch) - batch.ols_prediction) ** 2]
    assert row["mse_vs_ols"] == pytest.approx(statistics.fmean(sq), rel=1e-12)
    assert row["mse_vs_ols_se"] == pytest.approx(statistics.stdev(sq) / math.sqrt(64), rel=1e-12)  # ddof = 1


def test_standard_error_known_value():
    """Squared errors 1, 4, 9, 16: mean 7.5, sample std sqrt(43), standard error sqrt(43) / 2."""
    from icl_bench import make_batch
    from icl_bench.bench.metrics import prediction_metrics

    batch = make_batch([[0.0, 1.0, 2.0]] * 4, [[0.0, 1.0, 2.0]] * 4, [0.0] * 4, R=10.0)  # OLS = 0
    m = prediction_metrics(torch.tensor([1.0, -2.0, 3.0, -4.0], dtype=torch.float64), batch)
    assert m["mse_vs_ols"] == 7.5 and m["mse_vs_ols_se"] == pytest.approx(math.sqrt(43) / 2, rel=1e-14)
    # the quantiles of |prediction - OLS| are the ones their names say (torch.quantile's linear
    # interpolation): 1, 2, 3, 4 -> median 2.5, 99th percentile 3 + 0.97 (a mutation review: p99 as p90 passed)
    assert m["abs_err_median"] == 2.5 and m["abs_err_p99"] == pytest.approx(3.97, rel=1e-14)
    # one finite squared error: its mean has no standard error (NaN), not a zero-width interval
    one = prediction_metrics(torch.tensor([2.0, math.nan, math.nan, math.nan], dtype=torch.float64), batch)
    assert one["mse_vs_ols"] == 4.0 and math.isnan(one["mse_vs_ols_se"])


def test_error_vs_truth_and_its_standard_error_are_over_the_well_posed_prompts():
    """mse_vs_truth and mse_vs_truth_se are over the prompts where the answer, the OLS reference
    and the truth are all finite: a sampled prompt with constant x has a truth but no least-squares
    answer. OLS = 0, 0, 0, NaN; truth 1, 0, -1, 5; answers 1, 2, 4, 0: squared errors vs truth
    0, 4, 25 (the fourth left out), vs OLS 1, 4, 16. Every answer is finite, so the shortcut for
    all prompts scored must count the ill-posed one out. (A mutation review: scoring the fourth,
    reporting mse_vs_ols_se as mse_vs_truth_se, or passing n_ok for n_scored passed every test.)"""
    from dataclasses import replace

    from icl_bench import make_batch
    from icl_bench.bench.metrics import prediction_metrics

    batch = make_batch([[0.0, 1.0, 2.0]] * 3 + [[1.0, 1.0, 1.0]], [[0.0, 1.0, 2.0]] * 4, [0.0] * 4, R=10.0)
    batch = replace(batch, y_query_clean=torch.tensor([1.0, 0.0, -1.0, 5.0], dtype=torch.float64))
    m = prediction_metrics(torch.tensor([1.0, 2.0, 4.0, 0.0], dtype=torch.float64), batch)
    assert m["mse_vs_ols"] == 7.0 and m["mse_vs_truth"] == pytest.approx(29 / 3, rel=1e-14)
    assert m["mse_vs_truth_se"] == pytest.approx(statistics.stdev([0, 4, 25]) / math.sqrt(3), rel=1e-14)
    assert m["mse_vs_ols_se"] == pytest.approx(statistics.stdev([1, 4, 16]) / math.sqrt(3), rel=1e-14)


def test_seeds_pool_by_the_prompts_each_scored_with_the_median_of_their_medians():
    """Three seeds of 100 prompts: 20 ill-posed in the second, 10 failed answers in the third, so
    each mean is over 100, 80, 90 prompts. The pooled mean and standard error weight each seed by
    those counts, the interval is the module docstring's, and abs_err_median is the median of the
    seeds' medians (a mutation review: counting ill-posed prompts as scored, an unweighted standard
    error and the mean of the medians each passed every test)."""
    from icl_bench.report import aggregate as report

    cell = {"solver": "s", "solver_params": "{}", "N": 10, "noise": 0.1, "R": 10.0, "dtype": "float64", "device": "cpu",
            "d": 1, "ood": "none", "prompts": "", "series": "s", "series_rank": 0, "status": "ok", "prompts_per_s": 1.0}
    seeds = [(0, 0, 0, 1.0, 0.1, 1.0), (1, 20, 0, 2.0, 0.2, 2.0), (2, 0, 10, 4.0, 0.3, 10.0)]
    table = pd.DataFrame([{**cell, "seed": seed, "n_prompts": 100, "n_ill_posed": ill, "n_nonfinite_well_posed": bad,
                           "n_nonfinite": ill + bad, "mse_vs_ols": m, "mse_vs_ols_se": se, "mse_vs_truth": m,
                           "mse_vs_truth_se": se, "mse_vs_target": m, "abs_err_median": med}
                          for seed, ill, bad, m, se, med in seeds])
    (row,) = report.aggregate(table).to_dict("records")
    n = np.array([100, 80, 90])
    mean, sem = (n * [1.0, 2.0, 4.0]).sum() / 270, math.sqrt(((n * [0.1, 0.2, 0.3]) ** 2).sum()) / 270
    assert row["mse_vs_ols"] == pytest.approx(mean, rel=1e-14) and row["mse_vs_ols_se"] == pytest.approx(sem, rel=1e-14)
    f = math.exp(scipy.stats.t.ppf(0.975, 269) * sem / mean)
    assert (row["mse_vs_ols_ci_low"], row["mse_vs_ols_ci_high"]) == pytest.approx((mean / f, mean * f), rel=1e-12)
    assert row["abs_err_median"] == 2.0 and (row["n_seeds"], row["n_prompts"], row["n_ill_posed"]) == (3, 300, 20)
    assert row["n_nonfinite_well_posed"] == 10


def test_seeds_pool_and_repeated_runs_count_once(run_dir, tmp_path, solvers):
    from icl_bench.report import aggregate as report

    raw1 = {**RAW, "seed": 1, "solvers": {"test-weighted": {}}}
    run_matrix(parse_config(raw1), tmp_path / "seed1", progress=False)
    shutil.copytree(run_dir, tmp_path / "seed0-again")  # a repeated run: same prompts, same errors
    table, _ = report.load_runs([run_dir, tmp_path / "seed1", tmp_path / "seed0-again"])
    s = report.aggregate(table).set_index(["solver", "N", "noise", "R", "dtype"])
    got = s.loc[("test-weighted", 12, 0.1, 10.0, "float64")]
    rows = table[(table.solver == "test-weighted") & (table.N == 12) & (table.noise == 0.1) & (table.R == 10.0)
                 & (table.dtype == "float64")].drop_duplicates("seed")
    assert got.n_seeds == 2 and got.n_prompts == 128
    assert got.mse_vs_ols == pytest.approx(rows.mse_vs_ols.mean(), rel=1e-12)
    assert got.mse_vs_ols_se == pytest.approx(math.sqrt((rows.mse_vs_ols_se ** 2).sum()) / 2, rel=1e-12)


def test_runs_with_another_n_prompts_for_a_cell_and_seed_are_refused(run_dir, tmp_path, solvers, capsys):
    """Same cell and seed, other n_prompts: other prompts (not the first n of the larger batch), so
    the rows are neither repeats nor independent seeds: publish refuses them in one line, exit 2,
    and writes nothing; the same runs with another seed are pooled as before."""
    raw = {**RAW, "n_prompts": 32, "solvers": {"test-weighted": {}}, "grid": {**RAW["grid"], "N": [12]}}
    run_matrix(parse_config(raw), tmp_path / "n32", progress=False)
    out = tmp_path / "out"
    code, err = _cli(capsys, run_dir, tmp_path / "n32", "--out", out)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err and not out.exists()
    assert "test-weighted N=12" in err and "cpu seed=0 has n_prompts 32 in" in err and "64 in" in err, err
    run_matrix(parse_config({**raw, "seed": 1}), tmp_path / "n32-seed1", progress=False)
    assert _cli(capsys, run_dir, tmp_path / "n32-seed1", "--out", out)[0] == 0


def test_runs_over_other_data_or_checkpoints_for_a_cell_and_seed_are_refused(tmp_path, capsys):
    """Two runs of one CSV cell and seed over other bytes under the same path are refused (the rows
    record data_sha256), and so are rows whose solver read other files (inputs_sha256); the same
    bytes twice pool as repeats, and rows of runs older than these columns ("") are not compared."""
    from icl_bench.report import aggregate as report

    data = tmp_path / "d.csv"
    raw = {"seed": 0, "n_prompts": 16, "batch_size": 16, "timing": {"repeats": 1},
           "grid": {"N": [5], "R": [10.0], "dtype": ["float64"], "device": ["cpu"]},
           "solvers": {"ols": {}}, "data": {"path": str(data), "x": "x", "y": "y"}}
    for name, scale in (("a", 1), ("again", 1), ("b", 100)):
        data.write_text("x,y\n" + "".join(f"{i},{scale * (i % 7)}\n" for i in range(40)))
        run_matrix(parse_config(raw), tmp_path / name, progress=False)
    table, _ = report.load_runs([tmp_path / "a", tmp_path / "again"])  # the same bytes: repeats
    assert table["data_sha256"].str.len().eq(64).all() and report.aggregate(table).n_seeds.tolist() == [1]
    code, err = _cli(capsys, tmp_path / "a", tmp_path / "b", "--out", tmp_path / "out")
    assert code == 2 and err.count("\n") == 1 and not (tmp_path / "out").exists()
    assert "ols N=5 noise=nan R=10 float64 cpu seed=0 has data_sha256 " in err and "CSV file's bytes differ" in err, err
    for stem, digest in (("c1", "1" * 64), ("c2", "2" * 64), ("old", None)):  # a checkpoint's digest, or none
        (tmp_path / stem).mkdir()
        t = pd.read_parquet(tmp_path / "a" / "results.parquet")
        t = t.drop(columns=["inputs_sha256"]) if digest is None else t.assign(inputs_sha256=digest)
        t.to_parquet(tmp_path / stem / "results.parquet")
    with pytest.raises(ConfigError, match=r"has inputs_sha256 111111111111 in .*c1, 222222222222 in .*c2 .*other files"):
        report.load_runs([tmp_path / "c1", tmp_path / "c2"])
    assert len(report.load_runs([tmp_path / "c1", tmp_path / "old"])[0]) == 2  # an older run: not compared


def _one_cell_twice(**cols):
    """Result rows of one gd cell (steps=2) at N = 4 and 8, seed 0, from runs a and b; `cols`: per-run values."""
    base = {"solver": "gd", "solver_params": '{"steps": 2}', "noise": 0.1, "R": 10.0, "dtype": "float64",
            "device": "cpu", "d": 1, "ood": "none", "prompts": "", "seed": 0, "status": "ok", "n_prompts": 16,
            "data_sha256": "", "inputs_sha256": "", "code_sha256": ""}
    return pd.DataFrame([{**base, "N": n, "run": run, **{k: v[i] for k, v in cols.items()}}
                         for n in (4, 8) for i, run in enumerate("ab")])


def test_repeats_of_several_cells_name_the_first_its_parameters_and_the_count():
    # guards check_repeats' message: the solver's parameters are named, and "one of 2 such cells"
    from icl_bench.report.load import check_repeats

    with pytest.raises(ConfigError, match=r'^RUN_DIR: gd \{"steps": 2\} N=4 noise=0.1 R=10 float64 cpu seed=0 has '
                                          r"n_prompts 16 in a, 32 in b \(one of 2 such cells\): another n_prompts"):
        check_repeats(_one_cell_twice(n_prompts=[16, 32]))


def test_rows_that_are_not_ok_are_not_compared_as_repeats():
    # guards check_repeats' ok filter: error / skipped rows (no numbers to pool) of other code or n_prompts pass
    from icl_bench.report.load import check_repeats

    check_repeats(_one_cell_twice(status=["error", "error"], n_prompts=[16, 32], code_sha256=["1" * 64, "2" * 64]))
    check_repeats(_one_cell_twice(status=["ok", "skipped"], n_prompts=[16, 32]))


def test_runs_without_standard_errors_get_nan_intervals(run_dir, tmp_path):
    from icl_bench.report import aggregate as report

    old = tmp_path / "old-run"
    old.mkdir()
    pd.read_parquet(run_dir / "results.parquet").drop(columns=["mse_vs_ols_se", "mse_vs_truth_se"]).to_parquet(
        old / "results.parquet")
    table, metas = report.load_runs([old])
    s = report.aggregate(table)
    assert metas == {str(old): None} and s.mse_vs_ols.notna().all()
    assert s.mse_vs_ols_ci_low[s.mse_vs_ols > 0].isna().all()


def test_tables_of_older_versions_still_load(run_dir, tmp_path):
    """The schema check (report/validate.py) refuses what icl-bench never wrote, not what older
    versions wrote: whole-number floats in integer columns, null messages, NaN n_nonfinite and
    batch_size, no d / ood / prompts / digest / standard-error columns."""
    from icl_bench.report import aggregate as report

    old = tmp_path / "old-run"
    old.mkdir()
    t = pd.read_parquet(run_dir / "results.parquet")
    t = t.astype({"N": "float64", "seed": "float64"}).assign(message=None, n_nonfinite=math.nan, batch_size=math.nan)
    t.drop(columns=["d", "ood", "prompts", "data_sha256", "inputs_sha256", "mse_vs_ols_se", "mse_vs_truth_se"]).to_parquet(
        old / "results.parquet")
    table, _ = report.load_runs([old])
    assert len(table) == len(t) and table["N"].dtype == "int64" and table["seed"].dtype == "int64"
    assert set(table["N"]) == {5, 12} and (table["d"] == 1).all() and (table["ood"] == "none").all()
    assert report.aggregate(table).mse_vs_ols.notna().any() and not report.failures(table).empty


def test_standard_errors_far_above_the_mean_give_an_unbounded_interval():
    """A standard error far above its mean (no run writes one; a foreign table can) gives the
    interval [0, inf], not an OverflowError from exp."""
    from icl_bench.report import aggregate as report

    row = dict(solver="s", solver_params="{}", N=10, noise=0.1, R=100.0, dtype="float32", device="cpu", d=1,
               ood="none", prompts="", series="s", series_rank=0, status="ok", prompts_per_s=1.0, seed=0,
               n_prompts=16, n_nonfinite=0, mse_vs_ols=1e-31, mse_vs_ols_se=1.0, mse_vs_truth=1.0, mse_vs_truth_se=0.1)
    got = report.aggregate(pd.DataFrame([row])).iloc[0]
    assert got.mse_vs_ols == 1e-31 and got.mse_vs_ols_ci_low == 0 and got.mse_vs_ols_ci_high == math.inf


def test_failed_cells_are_listed_never_dropped(run_dir, published):
    fails = pd.read_csv(published / "failures.csv")
    assert len(fails) == 8 and set(fails.solver) == {"test-fails"} and set(fails.N) == {12}
    assert fails.message.str.startswith("RuntimeError: boom at N=12").all()
    md = (published / "failures.md").read_text()
    assert "boom at N=12" in md and "| error" in md
    assert "boom at N=12" in (published / "index.html").read_text()
    summary = pd.read_csv(published / "summary.csv")
    assert not ((summary.solver == "test-fails") & (summary.N == 12)).any()


def test_sparsity_table_lists_solvers_with_weights(published):
    sp = pd.read_csv(published / "sparsity.csv")
    assert set(sp.solver) == {"test-weighted"}
    np.testing.assert_allclose(sp.weight_sparsity, 0.5)
    np.testing.assert_allclose(sp.weight_l1, 3.00001)
    assert sp.n_cells.sum() == 16


def test_headline_is_the_summary_at_the_representative_setting(published, tables):
    from icl_bench.report.aggregate import headline

    _, summary, setting = tables
    assert setting == {"N": 5, "noise": 0.0, "R": 10.0, "dtype": "float32", "device": "cpu", "d": 1, "ood": "none"}
    head = headline(summary, setting).set_index("series")
    assert list(head.index) == SERIES and list(head.columns) == ["N=5", "N=12"]
    row = summary[(summary.series == "ols") & (summary.N == 12) & (summary.noise == 0.0) & (summary.R == 10.0)
                  & (summary.dtype == "float32")].iloc[0]
    assert head.loc["ols", "N=12"].startswith(f"{row.mse_vs_ols:.3g} [")
    assert head.loc["test-fails", "N=12"] == "(no ok cell)"
    assert "| test-steps steps=4" in (published / "headline.md").read_text()


def test_the_median_table_is_the_typical_prompts_squared_error_from_the_rows(published, tables):
    """The mean's interval under-covers heavy-tailed errors (results/ci_coverage.md), and a few prompts
    carry most of a mean: the headline now has the median squared error beside it, read from each
    cell's abs_err_median (median |prediction - OLS| over its prompts), squared."""
    from icl_bench.report.aggregate import headline

    table, summary, setting = tables
    typical = headline(summary, setting, table, stat="median").set_index("series")
    assert list(typical.columns) == ["N=5", "N=12"] and typical.loc["test-fails", "N=12"] == "(no ok cell)"
    ok = table[(table.status == "ok") & (table.noise == 0.0) & (table.R == 10.0) & (table.dtype == "float32")]
    for (series, n), g in ok.groupby(["series", "N"]):
        assert typical.loc[series, f"N={n}"] == f"{g.abs_err_median.median() ** 2:.3g}", (series, n)
    # NaN answers are flagged as in the mean table (a median over the finite answers alone read as good
    # as ols; found by a review), and a run without the column reads "(not recorded)", not a bare nan
    at = ((summary.series == "ols") & (summary.noise == 0.0) & (summary.R == 10.0) & (summary.dtype == "float32"))
    hit = summary.copy()
    hit.loc[at & (summary.N == 12), ["n_nonfinite", "n_nonfinite_well_posed"]] = 5
    hit.loc[at & (summary.N == 5), "abs_err_median"] = np.nan
    flagged = headline(hit, setting, table, stat="median").set_index("series")
    assert flagged.loc["ols", "N=12"].endswith(" (5 of 64 NaN/inf)") and flagged.loc["ols", "N=5"] == "(not recorded)"
    md = (published / "headline.md").read_text()
    assert "#### Median squared error vs OLS, (median |prediction − OLS|)², by solver and N" in md
    assert md.index("#### Median") > md.index("### Mean MSE vs OLS") and "A typical prompt's error" in md
    assert "Median squared error vs OLS" in (published / "index.html").read_text()


def _lines(ax):
    return sorted(line.get_label() for line in ax.get_lines())


def _legend(fig):
    return [t.get_text() for t in fig.legends[0].get_texts()]


REFERENCE_NOTE = ("weights.png and probes.png draw the LayerNorm construction (R = 10) for reference only: no transformer "
                  "solver with LayerNorm weights (ln-closed-form, a trained-* checkpoint) has ok cells at the setting, and "
                  "no --checkpoint with LayerNorm weights was given")


# test-fails is OLS where it runs (N = 5), drawn on top of scipy-lstsq there: a twin, though it
# failed at N = 12 (the twin test compared whole key sets, so a failed point hid it: a review)
DRAWN = [f"{s} (= scipy-lstsq)" if s == "test-fails" else s for s in SERIES]


def test_line_plots_have_labelled_axes_and_one_line_per_solver(figs):
    from icl_bench.report import style

    fig = figs["mse_vs_n"]  # plots.mse_vs_n(summary, setting) at the representative setting
    assert [ax.get_title() for ax in fig.axes] == ["noise σ = 0", "noise σ = 0.1"]
    for ax in fig.axes:
        assert ax.get_xlabel() == "context length N (examples)" and _lines(ax) == sorted(DRAWN)
        assert [t.get_text() for t in ax.get_xticklabels()] == ["5", "12"]  # ticks at the grid values only
    assert fig.axes[0].get_ylabel() == "MSE vs OLS prediction (y units²)" and fig.axes[0].get_yscale() == "log"
    # one legend for the figure, in series order; ols and scipy-lstsq sit at the float floor, so the
    # floor line's entry follows (added with the floor line: test_error_plots_draw_rounding_on_a_float_floor_line)
    assert _legend(fig) == DRAWN + [style.FLOOR_LABEL]
    fig = figs["mse_vs_r"]
    assert [ax.get_title() for ax in fig.axes] == ["dtype = float32", "dtype = float64"]
    for ax in fig.axes:
        assert ax.get_xlabel() == "embedding constant R (token units)" and ax.get_xscale() == "log"
        assert _lines(ax) == sorted(SERIES)  # at N = 5 test-fails has ok cells too


def test_linear_error_panels_of_one_dtype_share_their_y_range(tables):
    # values within two decades and above the floor: a linear axis, on which the noise panels of
    # mse_vs_n must still compare (found by a review: each panel had its own range, unsaid)
    from icl_bench.report import plots

    _, summary, setting = tables
    s = summary[(summary.solver == "test-steps") & (summary.dtype == setting["dtype"])].copy()
    s = s[s.solver_params == s.solver_params.iloc[0]]
    scale = np.where(s.noise == 0.0, 1.0, 10.0)  # the two noise panels an order of magnitude apart
    for c in ("mse_vs_ols", "mse_vs_ols_ci_low", "mse_vs_ols_ci_high"):
        s[c] = scale * (1.0 + s.N / 10) * {"mse_vs_ols": 1.0, "mse_vs_ols_ci_low": 0.9, "mse_vs_ols_ci_high": 1.1}[c]
    fig = plots.mse_vs_n(s, setting)
    a, b = fig.axes[:2]
    assert a.get_yscale() == b.get_yscale() == "linear" and a.get_ylim() == b.get_ylim()
    assert a.get_ylim()[1] >= s.mse_vs_ols_ci_high.max()


def test_error_plots_draw_rounding_on_a_float_floor_line(tables, figs):
    """mse_vs_r shared one log axis between its float32 and float64 panels, from float64 ols at 1e-31
    to 1: ten of thirteen series were squeezed into its top tenth (found by a new-user tryout). A
    mean at or below the float floor of its dtype is drawn on a marked line at the bottom of its
    panel (the floor marker, per series), each dtype's panels have their own y range, nothing above
    the floor is hidden, and the note and legend say what was done; mse_vs_n draws the same."""
    from matplotlib.collections import PolyCollection
    from matplotlib.markers import MarkerStyle

    from icl_bench.report import plots, scaling, style

    _, summary, setting = tables
    s = summary.copy()  # test-weighted in float64 at 1e-20: above its floor, below float32's; its band
    low = (s.solver == "test-weighted") & (s.dtype == "float64")  # in float32 reaches 0 (the floor)
    s.loc[low, ["mse_vs_ols", "mse_vs_ols_ci_low", "mse_vs_ols_ci_high"]] = [1e-20, 5e-21, 2e-20]
    s.loc[(s.solver == "test-weighted") & (s.dtype == "float32"), "mse_vs_ols_ci_low"] = 0.0
    fig = plots.mse_vs_r(s, setting)
    f32, f64 = fig.axes
    assert not f32.get_shared_y_axes().joined(f32, f64)
    assert f32.get_ylim()[0] > 1e-11 and f64.get_ylim()[0] < 5e-21  # float64's 1e-20 does not stretch float32's
    marker = MarkerStyle(style.FLOOR_MARKER)
    marker = marker.get_path().transformed(marker.get_transform()).vertices
    for ax, dtype in ((f32, "float32"), (f64, "float64")):
        (floor,) = [c for c in ax.collections if c.get_gid() == "float-floor"]
        y = floor.get_segments()[0][0][1]
        lines = {ln.get_label(): ln for ln in ax.get_lines()}
        assert ax.get_ylim()[0] < y < min(np.nanmin(ln.get_ydata()) for ln in lines.values() if ln.get_label() != "ols"
                                          and not np.isnan(ln.get_ydata()).all())
        ticks = dict(zip(ax.get_yticks(), (t.get_text() for t in ax.get_yticklabels())))
        assert ticks[y] == f"≤{scaling.float_floor(dtype):.2g}", ticks
        for series in ("ols", "scipy-lstsq", "test-fails"):  # 1e-14, 1e-31 and 0: on the line, as the floor marker
            (pts,) = [c for c in ax.collections if c.get_gid() == f"float-floor:{series}"]
            assert np.allclose(pts.get_offsets()[:, 1], y) and sorted(pts.get_offsets()[:, 0]) == [10.0, 100.0]
            assert np.allclose(pts.get_paths()[0].vertices, marker)
            assert np.isnan(lines[series].get_ydata()).all()  # not at their value
        assert list(lines["test-steps steps=4"].get_ydata()) == pytest.approx([1 / 16] * 2, rel=1e-5)
        # no band below the line; test-weighted's float32 band, down to 0, ends on it
        bands = min(p.get_paths()[0].vertices[:, 1].min() for p in ax.collections
                    if isinstance(p, PolyCollection) and p.get_paths())
        assert bands >= y * (1 - 1e-12) and (bands == pytest.approx(y, rel=1e-12, abs=0)) == (dtype == "float32")
    assert list(lines["test-weighted"].get_ydata()) == [1e-20, 1e-20] and f64.get_ylim()[0] < 5e-21
    assert _legend(fig)[-1] == style.FLOOR_LABEL
    note = " ".join(" ".join(t.get_text() for t in fig.texts).split())
    assert ("↓ on the dashed line: a mean MSE at or below the float floor (100 eps)² of its dtype (float32 1.4e-10, "
            "float64 4.9e-28), i.e. rounding, not method error") in note, note
    assert "in legend order: ols 4 of 4 points, scipy-lstsq 4 of 4 points, test-fails 4 of 4 points (2 exactly 0)" in note
    assert "; y range per dtype" in note and "large open circles" not in note
    for ax in figs["mse_vs_n"].axes:  # the same code path: one panel per noise, float32
        assert [c.get_gid() for c in ax.collections if str(c.get_gid()).startswith("float-floor")][:3] == [
            "float-floor:ols", "float-floor:scipy-lstsq", "float-floor:test-fails"]
        assert [t.get_text() for t in ax.get_yticklabels()][0] == "≤1.4e-10"


def test_series_labels_carry_every_distinguishing_parameter():
    from icl_bench.report.aggregate import add_series

    t = pd.DataFrame({"solver": ["gd", "gd-lsa", "gd-lsa", "gd-lsa", "ols", "trained-l1"],
                      "solver_params": ['{"steps": 8}', '{"steps": 16}', '{"steps": 1}', '{"steps": 4}', "{}",
                                        '{"models_dir": ""}']})
    s = add_series(t).sort_values("series_rank")
    # gd ran with one steps value only, but steps tells it apart from gd-lsa; numbers sort numerically
    assert s.series.tolist() == ["gd steps=8", "gd-lsa steps=1", "gd-lsa steps=4", "gd-lsa steps=16", "ols", "trained-l1"]
    # text that is empty or holds a space is quoted: `models_dir=` read as a value left out
    t = pd.DataFrame({"solver": ["trained-l1"] * 3,
                      "solver_params": ['{"models_dir": ""}', '{"models_dir": "my models"}', '{"models_dir": "m"}']})
    assert sorted(add_series(t).series) == ['trained-l1 models_dir=""', 'trained-l1 models_dir="my models"',
                                            "trained-l1 models_dir=m"]
    # text that does not print is escaped: a newline or NUL split the WARNING line (adversarial tester)
    t = pd.DataFrame({"solver": ["x", "x"], "solver_params": [json.dumps({"s": "a\nb"}), json.dumps({"s": "x\u0000y"})]})
    assert sorted(add_series(t).series) == ['x s="a\\nb"', 'x s="x\\u0000y"']
    # a boolean as a config writes it (TOML), not Python's True / False (a plugin author's review)
    t = pd.DataFrame({"solver": ["ridge", "ridge"], "solver_params": ['{"center": false}', '{"center": true}']})
    assert add_series(t).sort_values("series_rank").series.tolist() == ["ridge center=false", "ridge center=true"]
    # runs of gd at its default steps and at steps = 4, published together: both read "gd" (one
    # series, two sets of numbers); a parameter set in one and left out in the other is shown
    t = pd.DataFrame({"solver": ["gd", "gd", "ols"], "solver_params": ["{}", '{"steps": 4}', "{}"]})
    assert add_series(t).series.tolist() == ["gd", "gd steps=4", "ols"]
    t = pd.DataFrame({"solver": ["x", "x"], "solver_params": ["[1]", "[2]"]})  # not a dict (a foreign table): the JSON
    assert add_series(t).series.tolist() == ["x [1]", "x [2]"]


@pytest.mark.parametrize("solver, params, label", [
    ("gd-lsa", '{"steps": 2}', "gd-lsa steps=2"),  # the trained config's one value: not the default 16
    ("gd", '{"lr": 1, "steps": 16}', "gd lr=1"),  # 1 is the float 1.0, not 0.4; steps at its default stays out
    ("gd", '{"lr": 0.4, "variant": "masked"}', "gd"),  # every value the default
    ("no-such-plugin", '{"k": 3}', "no-such-plugin"),  # not installed here: its default is unknown
])
def test_a_parameter_off_its_default_is_in_the_label_even_with_one_value(solver, params, label):
    """The trained config runs gd-lsa at steps = 2 only: its label read a bare "gd-lsa", which reads
    as the default (steps 16) in the headline, summary and plots (found by a new-user tryout)."""
    from icl_bench.report.aggregate import add_series

    t = pd.DataFrame({"solver": [solver, "ols"], "solver_params": [params, "{}"]})
    assert add_series(t).series.tolist() == [label, "ols"]


@pytest.fixture(scope="module")
def twins_summary(tmp_path_factory):
    """gd and gd-lsa at the same steps (identical numbers) at two N and one R: the overlay, and the
    plot against R skipped."""
    from icl_bench.report import aggregate as report

    raw = {"seed": 0, "n_prompts": 32, "batch_size": 32, "timing": {"repeats": 1},
           "grid": {"N": [8, 16], "noise": [0.1], "R": [100.0], "dtype": ["float64"], "device": ["cpu"]},
           "solvers": {"gd": {"steps": [1, 4]}, "gd-lsa": {"steps": [1, 4]}, "ols": {}}}
    out = tmp_path_factory.mktemp("twins") / "run"
    run_matrix(parse_config(raw), out, progress=False)
    table, _ = report.load_runs([out])
    return table, report.aggregate(table), report.representative(table)


def test_identical_series_are_overlaid_and_named_and_one_value_axes_are_centred(twins_summary):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from icl_bench.report import plot_gaps, plots, style

    _, summary, setting = twins_summary
    fig = plots.mse_vs_n(summary, setting)
    assert _legend(fig) == ["gd steps=1", "gd steps=4", "gd-lsa steps=1 (= gd steps=1)",
                            "gd-lsa steps=4 (= gd steps=4)", "ols", style.FLOOR_LABEL]  # ols at float64's floor
    (ax,) = fig.axes
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    twin, first = lines["gd-lsa steps=4 (= gd steps=4)"], lines["gd steps=4"]
    assert twin.get_markerfacecolor() == "none" and twin.get_markersize() > first.get_markersize()
    assert twin.get_color() != first.get_color() and twin.get_marker() == first.get_marker()  # same family and steps
    note = " ".join(fig.texts[-1].get_text().split())
    assert "gd-lsa steps=1 coincides with gd steps=1 (" in note and "gd-lsa steps=4 coincides with gd steps=4 (" in note
    assert [t.get_text() for t in ax.get_xticklabels()] == ["8", "16"]
    ax = Figure().subplots()
    style.grid_axis(ax, [8], log=False)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["8"] and ax.get_xlim() == (4.0, 12.0)
    style.grid_axis(ax, [100.0], log=True)
    assert ax.get_xlim() == (50.0, 200.0)
    # one point per series shows no trend: skipped with the reason, like gd_steps when steps did not vary
    with pytest.raises(plots.PlotSkipped, match=r"mse_vs_r: R did not vary \(R = 100\); add a list of R values"):
        plots.mse_vs_r(summary, setting)
    with pytest.raises(plots.PlotSkipped, match=r"mse_vs_n: N did not vary \(N = 8\)"):
        plots.mse_vs_n(summary[summary.N == 8], setting)
    # N varied, but only N = 8 has ok cells (N <= d at d = 3): not "did not vary ... add a list" (a review)
    failed = summary[summary.N == 16].assign(failed=True, mse_vs_ols=np.nan)
    with pytest.raises(plots.PlotSkipped, match=r"^mse_vs_n: only N = 8 has ok cells at this setting \(every cell at "
                                                r"N = 16 errored or was skipped: failures.md\)$"):
        plots.mse_vs_n(pd.concat([summary[summary.N == 8].assign(failed=False), failed]), setting)
    # R varies at another N of the runs (two runs published together; the setting's N is only the
    # other run's): the note says where, not "add a list of R values" (a review)
    other = summary[summary.N == 16].assign(N=32)
    other = pd.concat([other.assign(R=10.0), other.assign(R=1000.0)])
    with pytest.raises(plots.PlotSkipped, match=r"^mse_vs_r: R took one value at this setting \(R = 100\); the runs "
                                                r"have R = 10, 1000 at N = 32; publish with --at N=32 to draw it$"):
        plots.mse_vs_r(pd.concat([summary, other]), setting)
    assert plot_gaps.varied_elsewhere(summary, setting, ("N", "noise", "device", "d", "ood"), "R") == ""
    fig = plots.gd_steps(summary, setting)
    assert _legend(fig) == ["gd", "gd-lsa (= gd)", "ols (no steps)", style.FLOOR_LABEL]
    with pytest.raises(plots.PlotSkipped, match=r"steps did not vary \(gd steps=4, gd-lsa steps=4\)"):
        plots.gd_steps(summary[summary.solver_params == '{"steps": 4}'], setting)
    # gd-lsa left at its default steps records no parameters: it is a point at that K (16), not a
    # level line "(no steps)" that claimed its error at every K; the one-panel title is wrapped
    one = summary[summary.N == 8]  # one panel: the narrowest figure, where the title was cut off
    default = one[one.solver == "gd-lsa"].head(1).assign(solver_params="{}", series="gd-lsa")
    fig = plots.gd_steps(pd.concat([one[one.solver != "gd-lsa"], default]), setting)
    lines = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}
    assert "gd-lsa (no steps)" not in lines and list(lines["gd-lsa"].get_xdata()) == [16.0]
    box = fig._suptitle.get_window_extent(FigureCanvasAgg(fig).get_renderer())  # in pixels
    assert plots._steps("gd-lsa", "{}") == 16 and plots._steps("no-such-solver", "{}") is None
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width, (box, fig._suptitle.get_text())


def test_the_notes_of_what_a_plot_cannot_draw_reach_a_drawable_setting():
    """A review of the notes: (1) the --at hint must pin every axis that takes several values, or
    report.representative picks another noise and the plot is skipped again; (2) a NaN axis value
    (a CSV run's noise) is written --at noise=nan, which --at accepts, not "n/a"; (3) a failed
    point on a CSV run's one NaN noise panel has no empty "(noise = )"; (4) gd_steps names a panel
    whose level line (a solver without steps) failed there."""
    from icl_bench.report import plot_gaps

    axes = ("N", "noise", "device", "d", "ood")
    row = {"device": "cpu", "d": 1, "ood": "none", "mse_vs_ols": 1.0, "failed": False}
    summary = pd.DataFrame([{**row, "N": n, "noise": z, "R": r} for n, z, r in
                            ((20, 0.1, 100.0), (10, 0.0, 100.0), (10, 0.1, 10.0), (10, 0.1, 100.0), (30, 0.0, 100.0))])
    setting = {"N": 20, "noise": 0.1, "device": "cpu", "d": 1, "ood": "none"}
    assert plot_gaps.varied_elsewhere(summary, setting, axes, "R") == (
        "the runs have R = 10, 100 at N = 10; publish with --at N=10 --at noise=0.1 to draw it")
    csv = pd.DataFrame([{**row, "N": n, "noise": math.nan, "R": r} for n, r in ((10, 10.0), (10, 100.0))])
    hint = plot_gaps.varied_elsewhere(pd.concat([csv, summary[summary.N == 20]]), setting, axes, "R")
    assert hint.endswith("publish with --at N=10 --at noise=nan to draw it"), hint
    data = pd.DataFrame([{"series": "s", "series_rank": 0, "N": n, "noise": math.nan, "failed": n == 10}
                         for n in (10, 20, 40)])
    assert plot_gaps.gaps(data, "N", "noise")[1] == "not drawn, every cell errored or was skipped (failures.md): s at N = 10"
    level = pd.DataFrame([{"series": s, "series_rank": i, "N": n, "failed": s == "ref" and n == 10}
                          for i, s in enumerate(("ref", "gone")) for n in (10, 30)])
    level.loc[level.series == "gone", "failed"] = True
    assert plot_gaps.level_outside(level) == ("not drawn, every cell errored or was skipped (failures.md): ref at N = 10; "
                                              "gone (no ok point in this figure)")
    assert plot_gaps.joined("not drawn, x: a", "", "not drawn, x: b") == "not drawn, x: a; b"


def test_a_steps_default_that_is_no_number_is_no_point_on_the_k_axis(monkeypatch):
    """A plugin whose `steps` defaults to "auto" crashed publish (float("auto")) once defaults were
    read; such a default (or a bool) gives no K: the series is a level line, as before."""
    from icl_bench.report import plots
    from icl_bench.solvers.base import Param

    class Auto:
        params = {"steps": Param("auto", "K or auto", choices=("auto", "4"))}

    class Flag:
        params = {"steps": Param(True, "on / off")}

    monkeypatch.setattr(plots, "get_solver_class", {"auto-k": Auto, "flag-k": Flag}.__getitem__)
    assert plots._steps("auto-k", "{}") is None and plots._steps("flag-k", "{}") is None
    assert plots._steps("auto-k", '{"steps": 4}') == 4
    assert plots._steps("auto-k", '{"steps": "auto"}') is None and plots._steps("flag-k", '{"steps": true}') is None
    Flag.params = {"steps": Param(np.int64(8), "K")}  # a numpy integer is a K
    assert plots._steps("flag-k", "{}") == 8


def test_series_that_coincide_on_the_plot_are_marked_with_their_difference():
    from icl_bench.report import style

    # gd and gd-lsa at steps = 16 in float32 on the default matrix: one point 1.1e-4 apart (relative)
    gd = [4.49e-5, 3.0e-6, 1.0e-6]
    t = pd.DataFrame({"series": ["gd steps=16"] * 3 + ["gd-lsa steps=16"] * 3 + ["other"] * 3,
                      "series_rank": [0] * 3 + [1] * 3 + [2] * 3, "N": [10, 100, 300] * 3,
                      "mse_vs_ols": gd + [gd[0], gd[1], gd[2] * (1 + 1.1e-4)] + [v * 1.05 for v in gd]})
    twins = style.identical_series(t, ["N"], "mse_vs_ols")
    assert list(twins) == ["gd-lsa steps=16"] and twins["gd-lsa steps=16"][0] == "gd steps=16"  # 5 % apart is visible
    assert twins["gd-lsa steps=16"][1] == pytest.approx(1.1e-4, rel=1e-3)
    assert style.twins_note(twins) == ("gd-lsa steps=16 coincides with gd steps=16 (largest relative difference 0.00011; "
                                       "open markers on top)")
    nan = pd.DataFrame({"series": ["all-nan"] * 2 + ["half-nan"] * 2, "series_rank": [0, 0, 1, 1], "N": [10, 30] * 2,
                        "mse_vs_ols": [np.nan] * 4})
    assert style.identical_series(nan, ["N"], "mse_vs_ols") == {}  # nothing drawn hides nothing (a review)


def test_gd_steps_plot_lines_beside_solvers_without_steps(tables, figs):
    from icl_bench.report import plots

    _, summary, setting = tables
    fig = figs["gd_steps"]
    assert [ax.get_title() for ax in fig.axes] == ["N = 5", "N = 12"]
    assert fig.axes[0].get_xlabel() == "GD steps K (= LSA layers)"
    others = [s for s in SERIES if not s.startswith("test-steps")]
    assert _lines(fig.axes[0]) == sorted(["test-steps"] + [f"{s} (no steps{'; = scipy-lstsq' * (s == 'test-fails')})"
                                                           for s in others])  # (DRAWN's twin)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["1", "2", "4"]
    y = dict(zip(*fig.axes[0].get_lines()[0].get_data()))
    assert y[4.0] == pytest.approx(1 / 16, rel=1e-5)
    with pytest.raises(plots.PlotSkipped, match="no solver in the runs set a `steps` parameter"):
        plots.gd_steps(summary[summary.solver != "test-steps"], setting)
    # a level line carries its series' marker at every steps value, so two parameter sets of one
    # solver without steps differ (they were one colour, one dash, no marker); no zero-MSE point,
    # so the note does not speak of one (it always did)
    levels = {ln.get_label(): ln for ln in fig.axes[0].get_lines() if ln.get_label().endswith("(no steps)")}
    assert all(list(ln.get_xdata()) == [1.0, 2.0, 4.0] and ln.get_marker() not in ("None", "", None) for ln in levels.values())
    two = summary[summary.solver == "ols"]
    two = pd.concat([summary, two.assign(solver_params='{"a": 1}', series="ols a=1", series_rank=two.series_rank + 0.5)])
    fig2 = plots.gd_steps(two, setting)
    lines = {ln.get_label(): ln for ln in fig2.axes[0].get_lines()}
    assert lines["ols (no steps)"].get_marker() != lines["ols a=1 (no steps; = ols)"].get_marker()
    # equal level lines hid each other with no word (a new-user tryout): named, as in mse_vs_n
    assert lines["ols a=1 (no steps; = ols)"].get_markersize() > lines["ols (no steps)"].get_markersize()
    assert "ols a=1 coincides with ols (equal; open markers on top)" in " ".join(t.get_text() for t in fig2.texts)
    assert "exactly 0" not in " ".join(t.get_text() for t in fig.texts)
    zero = summary.assign(mse_vs_ols=summary.mse_vs_ols.where(summary.solver != "ols", 0.0))
    fig = plots.gd_steps(zero, setting)
    note = " ".join(" ".join(t.get_text() for t in fig.texts).split())
    assert "series side by side in legend order: ols 2 of 2 points" in note and "(2 exactly 0)" in note, note
    # a level line at the float floor is drawn on the floor line, the axis above it spanning only the
    # values above it (float32 ols at 1e-14 squeezed the other lines into the top half, as in mse_vs_r)
    ax = fig.axes[0]
    gids = {c.get_gid() for c in ax.collections}
    assert {"float-floor", "float-floor:ols"} <= gids, gids
    assert [t.get_text() for t in ax.get_yticklabels()][0] == "≤1.4e-10"
    above = zero[(zero.N == 5) & (zero.mse_vs_ols > 1.4e-10)].mse_vs_ols
    assert ax.get_ylim()[1] < 10 * above.max()
    # a solver that answered nothing (mean NaN) has no line: it was drawn at the axis floor, the best
    # line in the figure (found by a new-user tryout)
    nan = summary.assign(mse_vs_ols=summary.mse_vs_ols.where(summary.solver != "ols", np.nan))
    ax = plots.gd_steps(nan, setting).axes[0]
    assert np.isnan(ax.get_lines()[[ln.get_label() for ln in ax.get_lines()].index("ols (no steps)")].get_ydata()).all()
    assert "float-floor:ols" not in {c.get_gid() for c in ax.collections}


def test_series_that_answered_nan_on_well_posed_prompts_are_flagged_in_the_plots(twins_summary):
    """A solver that answered NaN on half the well-posed prompts has its MSE over the other half:
    it read as the best series, unmarked, while the headline said "(32 of 64 NaN)" (found by a
    new-user tryout). Its legend label says how many, summed over the points drawn, and the note why."""
    from icl_bench.report import plots, style

    _, summary, setting = twins_summary  # 32 prompts per cell, N = 8 and 16
    nan = summary.solver.isin(["ols", "gd-lsa"])
    summary = summary.assign(n_nonfinite=summary.n_nonfinite.where(~nan, 16),
                             n_nonfinite_well_posed=summary.n_nonfinite_well_posed.where(~nan, 16))
    fig = plots.mse_vs_n(summary, setting)
    assert _legend(fig) == ["gd steps=1", "gd steps=4", "gd-lsa steps=1 (NaN/inf on 32 of 64 well-posed) (= gd steps=1)",
                            "gd-lsa steps=4 (NaN/inf on 32 of 64 well-posed) (= gd steps=4)",
                            "ols (NaN/inf on 32 of 64 well-posed)", style.FLOOR_LABEL]  # ols at float64's floor
    note = " ".join(fig.texts[-1].get_text().split())
    assert "NaN/inf on k of n well-posed: the solver answered NaN or inf on k of the n prompts" in note, note
    fig = plots.gd_steps(summary, setting)  # per line: gd-lsa over its steps and N
    assert _legend(fig) == ["gd", "gd-lsa (NaN/inf on 64 of 128 well-posed) (= gd)",
                            "ols (NaN/inf on 32 of 64 well-posed) (no steps)", style.FLOOR_LABEL]  # ols at the floor
    assert "NaN/inf on k of n well-posed" in " ".join(fig.texts[-1].get_text().split())
    ill = summary.assign(n_ill_posed=8, n_nonfinite=8, n_nonfinite_well_posed=0)  # NaN on ill-posed prompts: right
    assert not any("NaN" in label for label in _legend(plots.mse_vs_n(ill, setting)))


def test_series_whose_mean_overflowed_are_flagged_and_an_all_nan_plot_is_skipped(twins_summary):
    """A diverging gd's squared errors overflow to inf: its series had no line but a legend entry,
    and the note said nothing; a run of only a NaN-answering solver drew an empty frame with a
    negative y axis (found by a review). The series' label counts its inf points, the note says why,
    and a plot with no finite mean is skipped with its reason."""
    from icl_bench.report import plots
    from icl_bench.report.figure import INF_NOTE, NAN_NOTE, PlotSkipped

    _, summary, setting = twins_summary  # N = 8 and 16
    blown = summary.assign(mse_vs_ols=summary.mse_vs_ols.where(~((summary.solver == "ols") & (summary.N == 8)), np.inf))
    for fig in (plots.mse_vs_n(blown, setting), plots.gd_steps(blown, setting)):
        assert [s for s in _legend(fig) if s.startswith("ols")][0].startswith("ols (MSE off the scale at 1 of 2 points)")
        note = " ".join(fig.texts[-1].get_text().split())
        assert " ".join(INF_NOTE.split()) in note and "NaN/inf on k" not in note, note
    both = blown.assign(n_nonfinite_well_posed=blown.n_nonfinite_well_posed.where(blown.solver != "ols", 16))
    label = [s for s in _legend(plots.mse_vs_n(both, setting)) if s.startswith("ols")][0]
    assert label.startswith("ols (NaN/inf on 32 of 64 well-posed; MSE off the scale at 1 of 2 points)"), label
    note = " ".join(plots.gd_steps(both, setting).texts[-1].get_text().split())
    assert note.count(" ".join(INF_NOTE.split())) == 1 and note.count(" ".join(NAN_NOTE.split())) == 1, note
    for fill in (np.nan, np.inf):
        with pytest.raises(PlotSkipped, match="no ok cell with a finite mean MSE"):
            plots.mse_vs_n(summary.assign(mse_vs_ols=fill), setting)
        with pytest.raises(PlotSkipped, match=r"^gd_steps: no ok cell of a solver with `steps` \(gd, gd-lsa\) has a "
                                              r"finite mean MSE at "):
            plots.gd_steps(summary.assign(mse_vs_ols=fill), setting)
    assert not any("off the scale" in label for label in _legend(plots.mse_vs_n(summary, setting)))
    # a finite mean near the top of float64 (a diverging gd at 2e303) overflowed the axis margins, and
    # matplotlib's "Axis limits cannot be NaN or Inf" ended publish (a review): flagged as off the scale
    huge = summary.solver == "gd"
    near = summary.assign(mse_vs_ols=summary.mse_vs_ols.where(~huge, 2e303),
                          mse_vs_ols_ci_high=summary.mse_vs_ols_ci_high.where(~huge, 1e308))
    fig = plots.mse_vs_n(near, setting)
    fig.canvas.draw()  # (the limits are checked when drawn)
    assert all("off the scale at 2 of 2 points" in s for s in _legend(fig) if s.startswith("gd ")), _legend(fig)
    # below DRAW_MAX, matplotlib's own autoscaling of data near 1e300 overflowed its margins to inf
    # while the limits were being set: the axis turns autoscaling off first (found reading the change)
    near = summary.assign(mse_vs_ols=summary.mse_vs_ols.where(~huge, 1e290),
                          mse_vs_ols_ci_high=summary.mse_vs_ols_ci_high.where(~huge, 9.9e299))
    fig = plots.mse_vs_n(near, setting)
    fig.canvas.draw()
    assert not any("off the scale" in s for s in _legend(fig)) and fig.axes[0].get_ylim()[1] > 9.9e299


def test_an_overflowed_mean_or_interval_is_named_in_the_notes(tables):
    """A diverging gd read "inf [nan, nan]" or "3.9e+257 [nan, nan]" in the headline with no word
    why (found by a review): the headline's and the report's notes name the overflow."""
    from icl_bench.report.aggregate import KEYS, no_answer_notes

    table = tables[0]
    assert not [n for n in no_answer_notes(table) if "overflowed" in n]
    name = table.series.iloc[0]
    one = table.index[table.series == name][:1]
    n_cells = len(table[table.series == name].drop_duplicates([*KEYS, "seed"]))
    said = {"mse_vs_ols": f"{name}: its squared errors overflowed to inf (answers beyond ~1e154: it diverged) in 1 of "
                          f"{n_cells} cells; its mean MSE there is inf",
            "mse_vs_ols_se": f"{name}: the standard error of its MSE overflowed to inf (squared errors beyond ~1e154: it "
                             f"diverged) in 1 of {n_cells} cells; its interval there is NaN"}  # (the mean is finite)
    for col, line in said.items():
        notes = no_answer_notes(table.assign(**{col: table[col].where(~table.index.isin(one), np.inf)}))
        assert [n for n in notes if "overflowed" in n] == [line]
    both = table.assign(mse_vs_ols=np.inf, mse_vs_ols_se=np.inf)  # an inf mean's inf error: the mean's line alone
    assert not [n for n in no_answer_notes(both) if "standard error of its MSE" in n]


def test_one_setting_solvers_of_a_family_get_their_own_markers():
    """trained-l1, -l1-noaug, -lsa and -nol1 each run with one parameter set: they were four circles
    in similar shades of one colour (found by a new-user tryout); parameter sets of one solver still
    take their rank's marker, so gd steps=4 and gd-lsa steps=4 share one."""
    from icl_bench.report import series

    rows = pd.DataFrame({"series": ["trained-l1", "trained-l1-noaug", "trained-lsa", "trained-nol1",
                                    "gd steps=1", "gd steps=4", "gd-lsa steps=1", "gd-lsa steps=4"],
                         "solver": ["trained-l1", "trained-l1-noaug", "trained-lsa", "trained-nol1",
                                    "gd", "gd", "gd-lsa", "gd-lsa"], "series_rank": range(8)})
    st = series.series_styles(rows)
    assert len({st[s]["marker"] for s in rows.series[:4]}) == 4
    assert st["gd steps=4"]["marker"] == st["gd-lsa steps=4"]["marker"] != st["gd steps=1"]["marker"]


def test_throughput_plot_one_dot_per_solver_and_dtype_at_the_median(tables, figs):
    from icl_bench.report import plots

    table, _, _ = tables
    fig = figs["throughput"]
    (ax,) = fig.axes
    assert ax.get_xlabel() == "throughput (prompts / s)" and ax.get_title() == "device = cpu"
    assert [t.get_text() for t in ax.get_yticklabels()] == SERIES  # one row per series: labels cannot collide
    assert not ax.patches  # dots, not bars: a bar on a log axis starts at an arbitrary floor and misstates ratios
    ok = table[table.status == "ok"]
    for dtype, bars in zip(["float32", "float64"], ax.containers):
        median = ok[ok.dtype == dtype].groupby("series").prompts_per_s.median().reindex(SERIES)
        np.testing.assert_allclose(bars[0].get_xdata(), median, rtol=1e-12)  # the dot is at the median
        assert {plots._rate(v) for v in median} <= {t.get_text() for t in ax.texts}  # and says its value
    assert plots._rate(219_400) == "219k" and plots._rate(1.5e6) == "1.5M" and plots._rate(42.0) == "42"
    assert _legend(fig) == ["float32", "float64"]
    # a dtype has one colour in every figure: float64 was blue alone and orange beside float32 (a review)
    both = [c[0].get_color() for c in ax.containers]
    alone = plots.throughput(table[table.dtype == "float64"]).axes[0].containers[0][0].get_color()
    assert alone == both[1] != both[0]
    fig = plots.throughput(pd.concat([table, table[table.solver == "ols"].assign(device="cuda")]))
    assert [ax.get_title() for ax in fig.axes] == ["device = cpu", "device = cuda"]
    assert [len(c[0].get_xdata()) for c in fig.axes[1].containers] == [1, 1]  # only ols ran on cuda
    # a solver answering NaN is fast at it: it read as the fastest, unflagged (found by a new-user tryout)
    nan = table.assign(n_nonfinite_well_posed=table.n_nonfinite_well_posed.where(table.solver != "ols", 3))
    # d = 2 cells of one solver pooled with d = 1 cells of the others reversed their order (a review)
    two = pd.concat([table, table[table.solver == "ols"].assign(d=2, prompts_per_s=1.0)])
    setting = {"d": 1, "ood": "none"}
    fig = plots.throughput(two, setting)
    assert fig._suptitle.get_text().endswith("cells, d = 1)")
    ols_dots = [c[0].get_xdata() for c in fig.axes[0].containers]
    assert min(v for xs in ols_dots for v in xs) > 1.0  # the d = 2 rows (1 prompt/s) are not in it
    fig = plots.throughput(nan)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert [s for s in labels if s.startswith("ols")] == [f"ols (NaN/inf on {3 * int((ok.solver == 'ols').sum())} of "
                                                          f"{int(ok[ok.solver == 'ols'].n_prompts.sum())} well-posed)"]
    note = " ".join(fig.texts[-1].get_text().split())
    assert "with a least-squares answer; its prompts/s counts them too" in note and "MSE" not in note, note


def test_log_axes_of_narrow_ranges_get_enough_ticks():
    from matplotlib.figure import Figure

    from icl_bench.report import style

    ax = Figure().subplots()
    ax.plot([2e4, 6e4], [1, 2])
    ax.set_xscale("log")
    style.log_ticks(ax, "x", [2e4, 6e4])
    ax.figure.canvas.draw()
    shown = [t.get_text() for t in ax.get_xticklabels() if 2e4 <= t.get_position()[0] <= 6e4]
    assert shown == ["20000", "50000"]  # 2x and 5x ticks below two decades, not a lone 1e4 / 1e5


def test_weight_heatmaps_show_symmetry_reduced_maps(monkeypatch, tables):
    from icl_bench.report import model_plots
    from icl_bench.report.plots import PlotSkipped
    from icl_bench.solvers.transformer import Transformer, TransformerConfig

    torch.manual_seed(0)
    model = Transformer(TransformerConfig()).double()
    for p in model.parameters():
        torch.nn.init.normal_(p)
    maps = model_plots.reduced_maps(model.weight_matrices())
    a = model.blocks[1].attn
    np.testing.assert_allclose(maps["L2H1 QK"], (a.W_Q[0].T @ a.W_K[0]).detach().numpy())
    np.testing.assert_allclose(maps["L2H2 OV"], (a.W_O[1] @ a.W_V[1]).detach().numpy())
    assert model_plots._layout(list(maps)) == [["embed", "readout"], ["L1H1 QK", "L1H1 OV", "L1H2 QK", "L1H2 OV", "L1 LN γ/β"],
                                                ["L2H1 QK", "L2H1 OV", "L2H2 QK", "L2H2 OV", "L2 LN γ/β"]]
    small = Transformer(TransformerConfig(n_layers=1, n_heads=1))  # 5 maps: embed, readout | QK, OV, LN
    fig = model_plots.weight_heatmaps({"a": {"weights": small.weight_matrices()}, "b": {"weights": small.weight_matrices()}})
    titles = [ax.get_title().split("  (")[0] for ax in fig.axes if ax.get_visible() and ax.axison]
    assert titles == ["embed", "readout", "L1H1 QK", "L1H1 OV", "L1 LN γ/β"] * 2  # a grid of panels per model
    assert [sf._suptitle.get_text() for sf in fig.subfigs[1:]] == ["a", "b"]
    # QK = W_Q^T W_K: rows are the query token's slots, columns the key token's; OV maps input to output
    labels = {ax.get_title().split("  (")[0]: (ax.get_ylabel(), ax.get_xlabel()) for ax in fig.axes if ax.axison}
    assert labels["L1H1 QK"] == ("query slot", "key slot") and labels["L1H1 OV"] == ("", "input slot")
    assert labels["embed"] == ("output slot", "input slot")
    # without models, the plots skip
    with pytest.raises(PlotSkipped):
        model_plots.weight_heatmaps({})
    with pytest.raises(PlotSkipped):
        model_plots.probe_scatter({})


def test_weight_heatmaps_name_non_finite_entries_and_warn_nothing(tables):
    """The construction at R = 1e-300 has W_Q entries of 1e300, so a QK map overflows: it used to
    be drawn on an inf colour scale ("|max| inf", zeros dark blue) with numpy's overflow warnings
    on stderr; now the entry is grey, named in the title, and the scale is the finite entries'."""
    import warnings

    from icl_bench.report import model_plots

    table, _, setting = tables
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no RuntimeWarning from the matrix products
        models, _ = model_plots.collect_models(table, {**setting, "R": 1e-300}, n_prompts=16)
        fig = model_plots.weight_heatmaps(models)
    titles = [ax.get_title() for ax in fig.axes if ax.axison]
    assert "L1H1 QK  (|max| 0; 1 not finite, grey)" in titles and not any("inf" in t for t in titles), titles
    assert "L1H2 QK  (|max| 0)" in titles  # an all-zero map says 0, not the colour scale's 1


def test_model_plots_draw_the_construction_and_its_probes_without_running_solvers(tables, monkeypatch):
    from icl_bench.bench import cells
    from icl_bench.report import model_plots

    def refuse(*a, **k):
        raise AssertionError("the report must not run solvers or draw the benchmark's cell prompts")

    monkeypatch.setattr(cells, "cell_prompts", refuse)
    monkeypatch.setattr(MeanWithWeights, "predict", refuse)
    table, _, setting = tables
    models, notes = model_plots.collect_models(table, setting, n_prompts=128)
    assert list(models) == ["construction (R=10)"], notes  # the run's only weighted solver is no checkpoint
    # no transformer solver in the run: the construction is a reference, and says so (changed: the
    # note was empty; test_the_construction_alone_is_marked_as_a_reference)
    assert notes == [REFERENCE_NOTE] and models["construction (R=10)"]["reference"]
    fig = model_plots.weight_heatmaps(models)
    assert [ax.get_title().split("  (")[0] for ax in fig.axes if ax.axison][:4] == ["embed", "readout", "L1H1 QK", "L1H1 OV"]
    (ln,) = [ax for ax in fig.axes if ax.get_title().startswith("L1 LN γ/β")]
    assert [t.get_text() for t in ln.get_yticklabels()] == ["γ", "β"] and ln.get_xlabel() == "slot"
    fig = model_plots.probe_scatter(models)
    assert len(fig.axes) == 3 and all("R² = 1.0000" in ax.get_title() or "R² = 0.99" in ax.get_title() for ax in fig.axes)
    # places and units in docs/design.md §5's words, not the trace's 0-based keys
    assert "\nstream after layer 1, context tokens\nslot " in fig.axes[0].get_title()
    assert "\nlayer-2 LayerNorm output, query token\nslot " in fig.axes[2].get_title()
    assert [ax.get_xlabel().split("(")[-1] for ax in fig.axes] == ["x units)", "y units)", "y units)"]
    assert fig.axes[2].get_xlabel().startswith("closed form b_hat (u - x_bar)")
    assert "passed by any accurate model: not a mechanism test" in fig._suptitle.get_text()  # docs/analysis.md
    # what it probed: a figure used alone named R only, in a panel title (a review)
    N, noise = int(setting["N"]), float(setting["noise"])
    assert f"\nprobed on 128 prompts at N = {N}, noise = {noise:g}, R = 10 (float64, seed 0)" in fig._suptitle.get_text()


def test_a_solver_not_installed_here_is_named_so_in_the_model_plots_note(tables):
    """A run's plugin uninstalled since: the note read "mean-y: not drawn (UnknownSolverError:
    solver: unknown name 'mean-y'; known: <every name>)", naming neither the figure nor the reason
    in words (found by a new-user tryout)."""
    from icl_bench.report import model_plots

    table, _, setting = tables
    gone = table.assign(solver=table["solver"].replace({"ols": "gone-plugin"}),
                        series=table["series"].replace({"ols": "gone-plugin"}))
    _, notes = model_plots.collect_models(gone, setting, n_prompts=16)
    assert "weights.png, probes.png: gone-plugin not drawn (solver 'gone-plugin' is not installed here)" in notes, notes


def test_the_construction_alone_is_marked_as_a_reference(tables):
    """A run without a transformer solver (ols, scipy-lstsq and plugins here) published weights.png
    and probes.png of the construction as if it were one of its models (found by a new-user tryout).
    It is still drawn, as the reference the benchmark's transformers are read against, but its
    titles and a note say so; beside ln-closed-form (whose weights it is) or a checkpoint it is not."""
    from icl_bench.report import model_plots

    table, _, setting = tables
    models, notes = model_plots.collect_models(table, setting, n_prompts=16)
    assert notes == [REFERENCE_NOTE] and models["construction (R=10)"]["reference"]
    fig = model_plots.weight_heatmaps(models)
    assert fig.subfigs[1]._suptitle.get_text() == "construction (R=10)  (reference only: no transformer solver with LayerNorm weights in the runs)"
    fig = model_plots.probe_scatter(models)
    assert fig._suptitle.get_text().endswith("\nconstruction (R=10): reference only: no transformer solver with LayerNorm weights in the runs")
    assert all(ax.get_title().startswith("construction (R=10) (reference only)\n") for ax in fig.axes)
    ok = table[(table.status == "ok") & (table.solver == "ols")]
    with_ln = pd.concat([table, ok.assign(solver="ln-closed-form")])  # the construction is the run's solver
    models, notes = model_plots.collect_models(with_ln, setting, n_prompts=16)
    assert notes == [] and not models["construction (R=10)"]["reference"]
    fig = model_plots.weight_heatmaps(models)
    assert fig.subfigs[1]._suptitle.get_text() == "construction (R=10)"
    assert "reference" not in model_plots.probe_scatter(models)._suptitle.get_text()
    models, notes = model_plots.collect_models(table, setting, ["trained-l1-R100"], n_prompts=16)  # beside a model
    assert not any(m["reference"] for m in models.values()) and not any("reference" in n for n in notes)


def test_probe_scatter_leaves_out_a_model_it_cannot_fit_with_a_note(tables):
    """At R = 1e300 the construction's stream overflows, so no probe row is finite: publish used to
    stop there ("a probe needs at least 3 finite rows"); now that model is left out with a note, and
    a figure with no model left is a skipped plot naming the reason."""
    from icl_bench.report import model_plots

    table, _, setting = tables
    fine, _ = model_plots.collect_models(table, setting, n_prompts=64)
    huge, _ = model_plots.collect_models(table, {**setting, "R": 1e300}, n_prompts=64)
    notes = []
    fig = model_plots.probe_scatter({**fine, **huge}, notes)
    assert len(fig.axes) == 3 and all(ax.get_title().startswith("construction (R=10)") for ax in fig.axes)
    assert notes == ["probes.png leaves out construction (R=1e+300): stream: a probe needs at least 3 finite rows (got 0)"]
    with pytest.raises(model_plots.PlotSkipped, match=r"^probe scatter: construction \(R=1e\+300\): stream: a probe needs"):
        model_plots.probe_scatter(huge)
    # at R = 1.3e154 the stream overflows on some prompts only: drawn, and the note says how many rows it fitted
    part, _ = model_plots.collect_models(table, {**setting, "R": 1.3e154}, n_prompts=64)
    notes = []
    model_plots.probe_scatter(part, notes)
    assert len(notes) == 1 and notes[0].startswith("probes.png fits only the finite rows: construction (R=1.3e+154) "), notes
    assert " of 64 rows finite" in notes[0] and "of 640 rows" not in notes[0]  # the query rows (division) only
    fig = model_plots.probe_scatter(part)
    assert " of 64 rows finite)" in fig.axes[2].get_title()  # the panel says it too
    assert model_plots.probe_scatter(fine, notes) and len(notes) == 1  # all rows finite: no note
    # at R = 1e-300 the query's LayerNorm input underflows: every slot constant, R² nan, said in a note
    tiny, _ = model_plots.collect_models(table, {**setting, "R": 1e-300}, n_prompts=16)
    notes = []
    fig = model_plots.probe_scatter(tiny, notes)
    assert "R² = nan" in fig.axes[2].get_title()
    assert notes == ["probes.png has no R² (nan: the statistic or every stream slot is constant over the rows, e.g. a "
                     "LayerNorm whose input has underflowed): construction (R=1e-300) division"]


def test_scaling_exponents_ln_closed_form_r_minus_4_and_ols_flat(tmp_path, tables):
    from icl_bench.report import aggregate as report
    from icl_bench.report import scaling

    # R a decade apart, 2048 prompts: every R reads the same prompts, and seeds 0-3 give -3.9988,
    # -3.9985, -3.9982, -3.9988 here (-3.9993 to -3.9987 with 512 prompts; docs/report.md, "What the
    # interval measures"); while each R drew its own prompts they gave -4.18, -3.87, -4.23, -4.00
    raw = {"seed": 0, "n_prompts": 2048, "batch_size": 2048, "timing": {"repeats": 1},
           "grid": {"N": [20], "noise": [0.0], "R": [100.0, 1000.0, 10000.0], "dtype": ["float64"], "device": ["cpu"]},
           "solvers": {"ols": {}, "ln-closed-form": {}}}
    run_matrix(parse_config(raw), tmp_path / "run", progress=False)
    table, _ = report.load_runs([tmp_path / "run"])
    summary = report.aggregate(table)
    fits = scaling.scaling_table(summary).set_index(["series", "dtype", "vs"])
    ln = fits.loc[("ln-closed-form", "float64", "R")]
    assert ln.n_points == 3 and ln.exponent == pytest.approx(-4, abs=0.01), ln.to_dict()
    assert ln.ci_low < ln.exponent < ln.ci_high
    # ols, here and in the module's run (float32 and float64, R = 10, 100): every point at the
    # float floor, and no growth with R
    _, small, _ = tables
    for s, fit in ((summary, fits), (small, scaling.scaling_table(small).set_index(["series", "dtype", "vs"]))):
        for dtype in sorted(set(s.dtype)):
            o = fit.loc[[k for k in fit.index if k[0] == "ols" and k[1] == dtype and k[2] == "R"]]
            assert len(o) and (o.n_points == 0).all() and o.exponent.isna().all()
            assert (o.max_mse <= scaling.float_floor(dtype)).all()
            for _, g in s[(s.solver == "ols") & (s.dtype == dtype)].groupby(["N", "noise"]):
                mse = g.sort_values("R").mse_vs_ols.to_numpy()
                assert mse[-1] <= max(10 * mse[0], 1e-30)
    table_at = scaling.scaling_at(scaling.scaling_table(summary), report.representative(table), ["ln-closed-form", "ols"])
    assert table_at.set_index(["series", "dtype"]).loc[("ols", "float64"), "exponent vs R"] == "at float floor"
    # a known slope is recovered with its interval; points at the floor are left out
    got = scaling.fit_exponent([10, 100, 1000, 1e4], [1e-2, 1e-4 * 1.1, 1e-6, 1e-40], "float64")
    assert got["n_points"] == 3 and got["n_floor"] == 1 and got["exponent"] == pytest.approx(-2, abs=0.05)
    # three means that happen to lie on a line (a solver that never reads R, prompts redrawn per R):
    # the interval includes each mean's sampling error, so it covers 0 (the fit alone: [0.028, 0.036])
    flat = scaling.fit_exponent([10, 100, 1000], [0.673, 0.725, 0.779], "float64", [0.06, 0.06, 0.06])
    assert flat["ci_low"] < 0 < flat["ci_high"] and flat["exponent"] == pytest.approx(0.0318, abs=1e-3)
    # ... and its half-width is the sampling term's: 1.96 sqrt(sum dx^2 s^2) / sum dx^2, s = se / MSE
    # on the log scale (a mutation review: a 90 % quantile or a misplaced square root passed)
    dx = np.log([10, 100, 1000]) - np.log([10, 100, 1000]).mean()
    s_log = 0.06 / np.array([0.673, 0.725, 0.779])
    half = scipy.stats.norm.ppf(0.975) * math.sqrt((dx**2 * s_log**2).sum()) / (dx**2).sum()
    assert flat["ci_high"] - flat["exponent"] == pytest.approx(half, rel=1e-12) == flat["exponent"] - flat["ci_low"]
    bent = scaling.fit_exponent([10, 100, 1000], [1e-2, 1e-5, 1e-6], "float64", [1e-4, 1e-7, 1e-8])
    assert bent["ci_high"] - bent["ci_low"] == pytest.approx(  # tiny errors: the lack-of-fit interval stays
        2 * float(scipy.stats.t.ppf(0.975, 1)) * scipy.stats.linregress(np.log([10, 100, 1000]), np.log([1e-2, 1e-5, 1e-6])).stderr)
    # a NaN MSE (no prompt answered) is neither a fitted point nor "at float floor"
    got = scaling.fit_exponent([10, 100, 1000, 1e4], [1e-2, 1e-4, math.nan, 1e-40], "float64")
    assert (got["n_points"], got["n_floor"], got["n_nan"]) == (2, 1, 1)
    fits = pd.DataFrame([{"series": s, "dtype": "float64", "vs": "R", "N": 10, "R": math.nan, "noise": 0.1, "device": "cpu", "d": 1,
                          "ood": "none", **scaling.fit_exponent([10, 100, 1000], m, "float64")}
                         for s, m in (("never", [math.nan] * 3), ("exact", [1e-40, 1e-40, math.nan]),
                                      ("mixed", [1e-2, 1e-4, math.nan]))])
    shown = scaling.scaling_at(fits, {"N": 10, "noise": 0.1, "R": 10, "device": "cpu", "d": 1, "ood": "none"},
                               ["never", "exact", "mixed"]).set_index("series")["exponent vs R"]
    assert shown.to_dict() == {"never": "no finite MSE", "exact": "at float floor (1 NaN)", "mixed": "-2.00 (2 pts, 1 NaN)"}


def test_failed_points_are_counted_in_the_scaling_fits_and_a_missing_fit_says_why():
    """A fit through the ok points left by a failed one read like a full fit ("0.00 (2 pts)"), and
    a series with no fit at the setting had a blank cell (a review). Failed points (every cell
    errored or was skipped: report.with_failed_points' rows) are counted; the blank says why."""
    from icl_bench.report import scaling

    row = {"solver_params": "{}", "prompts": "", "N": 30, "noise": 0.1, "dtype": "float64", "device": "cpu", "d": 1,
           "ood": "none"}
    ok = [{**row, "series": s, "solver": s, "R": R, "mse_vs_ols": m, "mse_vs_ols_se": 0.01 * m, "failed": False}
          for s, pts in (("part", ((10.0, 1e-2), (100.0, 1e-4))), ("full", ((10.0, 1e-2), (100.0, 1e-4), (1000.0, 1e-6))),
                         ("lone", ((10.0, 1e-3),)))
          for R, m in pts]
    bad = [{**row, "series": s, "solver": s, "R": R, "mse_vs_ols": math.nan, "failed": True}
           for s, R in (("part", 1000.0), ("lone", 100.0), ("gone", 10.0), ("gone", 100.0))]
    summary = pd.DataFrame(ok + bad)
    fits = scaling.scaling_table(summary).set_index(["series", "vs"])
    assert fits.loc[("part", "R"), ["n_points", "n_failed", "n_nan"]].tolist() == [2, 1, 0]
    assert fits.loc[("full", "R"), "n_failed"] == 0 and fits.loc[("full", "R"), "n_points"] == 3
    setting = {"N": 30, "noise": 0.1, "R": 100.0, "device": "cpu", "d": 1, "ood": "none"}
    shown = scaling.scaling_at(fits.reset_index(), setting, ["full", "part", "lone", "gone"]).set_index("series")
    assert "gone" not in set(fits.reset_index()["series"])  # no ok point: no fit row (cuda cells without a GPU)
    assert shown["exponent vs R"].to_dict() == {"full": "-2.00 [-2.01, -1.99] (3 pts)", "part": "-2.00 (2 pts, 1 failed)",
                                                "lone": "(1 point above floor, 1 failed)"}  # gone: no row
    assert shown["exponent vs N"].tolist() == ["no fit: fewer than 2 N values with ok cells here"] * 3
    nan = pd.DataFrame(ok[:1] + [{**ok[1], "mse_vs_ols": math.nan}] + bad[:1])  # 1 ok, 1 NaN, 1 failed point
    (text,) = scaling.scaling_at(scaling.scaling_table(nan.assign(mse_vs_ols=math.nan)), setting, ["part"])["exponent vs R"]
    assert text == "no finite MSE (2 NaN, 1 failed)"  # the failed count was hidden
    # without failed rows (a summary as before): the same fits of the ok points, nothing counted
    plain = scaling.scaling_table(pd.DataFrame(ok).drop(columns="failed")).set_index(["series", "vs"])
    assert plain.loc[("part", "R"), "exponent"] == fits.loc[("part", "R"), "exponent"] and plain["n_failed"].eq(0).all()


def test_rounding_dominated_float32_points_leave_the_fit():
    """float32 ln-closed-form's rounding grows with R (a U-curve), far above the one-number float
    floor: at R = 1000 2.3e-9 against 7.2e-11 in float64, and the fit through it read "-3.06" for
    a curve that turns up there (found by a review). A float32 mean over 3x its float64 twin's is
    left out (n_rounding); a float32 point near its twin (control) stays."""
    from icl_bench.report import scaling

    cells = [("ln", "float32", [3.8e-3, 5.8e-7, 2.3e-9]), ("ln", "float64", [3.8e-3, 7.1e-7, 7.2e-11]),
             ("gd", "float32", [0.70, 0.72, 0.75]), ("gd", "float64", [0.70, 0.72, 0.75])]
    summary = pd.DataFrame([{"series": s, "solver": s, "solver_params": "{}", "prompts": "", "N": 30, "noise": 0.1, "R": R,
                             "dtype": dt, "device": "cpu", "d": 1, "ood": "none", "mse_vs_ols": m, "mse_vs_ols_se": 0.05 * m}
                            for s, dt, ms in cells for R, m in zip((10.0, 100.0, 1000.0), ms)])
    assert scaling.rounding_dominated(summary).tolist() == [False, False, True] + [False] * 9
    near = summary.assign(mse_vs_ols=summary.mse_vs_ols.where(summary.index != 2, 5 * 7.2e-11))  # 5x its twin: out
    assert scaling.rounding_dominated(near).tolist()[2] and not scaling.rounding_dominated(
        summary.assign(mse_vs_ols=summary.mse_vs_ols.where(summary.index != 2, 2.5 * 7.2e-11))).tolist()[2]  # 2.5x: in
    fits = scaling.scaling_table(summary).set_index(["series", "dtype", "vs"])
    ln32, ln64 = fits.loc[("ln", "float32", "R")], fits.loc[("ln", "float64", "R")]
    assert (ln32.n_points, ln32.n_rounding) == (2, 1) and ln32.exponent == pytest.approx(-3.82, abs=0.01)
    assert (ln64.n_points, ln64.n_rounding) == (3, 0) and ln64.exponent == pytest.approx(-3.86, abs=0.01)
    assert (fits.loc[("gd", "float32", "R")].n_rounding, fits.loc[("gd", "float32", "R")].n_points) == (0, 3)
    shown = scaling.scaling_at(fits.reset_index(), {"N": 30, "noise": 0.1, "R": 100.0, "device": "cpu", "d": 1, "ood": "none"},
                               ["ln"]).set_index("dtype")["exponent vs R"]
    assert shown["float32"] == "-3.82 (2 pts, 1 rounding)"
    assert scaling.fit_exponent([10, 100], [1e-3, 1e-5], "float32", rounding=[True, True])["n_rounding"] == 2
    one = scaling.scaling_at(fits.reset_index().assign(exponent=np.nan, n_points=1), {"N": 30, "noise": 0.1, "R": 100.0,
                             "device": "cpu", "d": 1, "ood": "none"}, ["ln"]).set_index("dtype")["exponent vs R"]
    assert one["float32"] == "(1 point above floor, 1 rounding)"  # the dropped point was not named (a review)
    flat = scaling.fit_exponent([10, 100, 1000], [1e60] * 3, "float64", se=[0.0] * 3)  # stderr NaN from scipy (a review)
    assert (flat["exponent"], flat["ci_low"], flat["ci_high"]) == (0.0, 0.0, 0.0)
    # without the float64 run the check cannot run: the fit keeps the U-curve's point and says so (a review)
    only32 = summary[summary.dtype == "float32"]
    assert not scaling.rounding_dominated(only32).any() and scaling.rounding_unchecked(only32).all()
    fits32 = scaling.scaling_table(only32)
    assert fits32.n_unchecked.tolist() == [3, 3] and fits.n_unchecked.max() == 0
    shown = scaling.scaling_at(fits32, {"N": 30, "noise": 0.1, "R": 100.0, "device": "cpu", "d": 1, "ood": "none"},
                               ["ln"]).set_index("dtype")["exponent vs R"]
    assert shown["float32"].endswith("(3 pts, rounding unchecked: no float64 run)")


def test_series_measured_on_different_prompt_sets_get_a_note():
    """Runs of other seeds published together: gd (seeds 0, 1) beside gd-lsa (seed 0) read 0.876 and
    0.795 for one algorithm, with nothing said (a review). The note names each prompt set."""
    from icl_bench.report import coverage

    setting = {"N": 10, "noise": 0.1, "R": 100.0, "dtype": "float32", "device": "cpu", "d": 1, "ood": "none"}
    row = {k: v for k, v in setting.items() if k != "N"}
    rows = [{**row, "series": s, "N": n, "seed": seed, "n_prompts": 256, "status": "ok", "run": "a"}
            for s, seeds in (("gd", (0, 1)), ("ols", (0, 1)), ("gd-lsa", (0,))) for seed in seeds for n in (10, 30)]
    table = pd.DataFrame(rows)
    (note,) = coverage.prompt_sets_note(table, setting)
    assert "prompt seeds 0, 1 × 256 prompts: gd, ols; prompt seed 0 × 256 prompts: gd-lsa;" in note, note
    same = table[table["seed"] == 0]
    assert coverage.prompt_sets_note(same, setting) == []  # one prompt set: nothing to say
    other_size = pd.concat([same, same[same.series == "gd"].assign(series="big", n_prompts=512)])
    assert "prompt seed 0 × 512 prompts: big" in coverage.prompt_sets_note(other_size, setting)[0]
    elsewhere = pd.concat([same, table[table.series == "gd"].assign(series="far", R=10.0)])
    assert coverage.prompt_sets_note(elsewhere, setting) == []  # another setting's rows are not the headline's


def test_publishing_runs_with_different_grids_names_what_it_left_out(run_dir, tmp_path, monkeypatch, solvers):
    import icl_bench.report.publish

    raw = {**RAW, "grid": {**RAW["grid"], "R": [1000.0], "N": [5], "dtype": ["float64"]}, "solvers": {"ols": {}}}
    run_matrix(parse_config(raw), tmp_path / "other", progress=False)
    monkeypatch.setattr(icl_bench.report.publish, "_figures", lambda *a: ({}, []))
    out = tmp_path / "pub"
    assert main(["publish", str(run_dir), str(tmp_path / "other"), "--out", str(out)]) == 0
    head, page = (out / "headline.md").read_text(), (out / "index.html").read_text()
    info = json.loads((out / "publish.json").read_text())
    other = str(tmp_path / "other")
    for text in (head, page, json.dumps(info["left_out"])):
        assert f"run {other}: left out of the headline" in text
        assert "its ok cells have R = 1000; dtype = float64" in text and "the runs have different R grids" in text


def test_publish_readme_updates_the_block_and_the_command_says_so(run_dir, tmp_path, monkeypatch):
    """`--readme` replaces only the headline block, and the "Made by" command it writes there names
    `--readme` (it was left out, so rerunning the printed command did not update the README)."""
    import icl_bench.report.publish

    monkeypatch.setattr(icl_bench.report.publish, "_figures", lambda *a: ({}, []))
    doc = tmp_path / "README.md"
    doc.write_text("intro\n<!-- headline:begin -->\nold\n<!-- headline:end -->\noutro\n")
    out = tmp_path / "pub"
    assert main(["publish", str(run_dir), "--out", str(out), "--readme", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("intro\n<!-- headline:begin -->\n### Mean MSE vs OLS") and text.endswith("<!-- headline:end -->\noutro\n")
    assert f"--readme {doc}`" in text and "\nold\n" not in text


def test_publish_force_refuses_a_readme_inside_out(run_dir, tmp_path, monkeypatch, capsys):
    """`--force --readme OUT/README.md` replaced OUT (deleting the README) and then failed to find
    it (found by an adversarial review); it is refused before anything is written."""
    import icl_bench.report.publish

    monkeypatch.setattr(icl_bench.report.publish, "_figures", lambda *a: ({}, []))
    out = tmp_path / "pub"
    assert main(["publish", str(run_dir), "--out", str(out)]) == 0
    (out / "README.md").write_text("<!-- headline:begin -->\nold\n<!-- headline:end -->\n")
    before = sorted(p.name for p in out.rglob("*"))
    capsys.readouterr()
    assert main(["publish", str(run_dir), "--out", str(out), "--force", "--readme", str(out / "README.md")]) == 2
    assert capsys.readouterr().err == (f"icl-bench: error: --readme: {out / 'README.md'} is inside --out {out}, which "
                                       "publish replaces; keep it outside\n")
    assert sorted(p.name for p in out.rglob("*")) == before
    (tmp_path / "README.md").write_text("<!-- headline:begin -->\nold\n<!-- headline:end -->\n")
    (out / "RL.md").symlink_to(tmp_path / "README.md")  # a link inside --out is inside it too
    assert main(["publish", str(run_dir), "--out", str(out), "--force", "--readme", str(out / "RL.md")]) == 2
    assert "is inside --out" in capsys.readouterr().err and (out / "RL.md").is_symlink()


def test_publish_names_d_when_the_runs_hold_several_and_says_what_it_left_out(tmp_path, monkeypatch):
    from icl_bench.report import model_plots
    from icl_bench.report import publish as pub
    from icl_bench.report import scaling

    raw = {"seed": 0, "n_prompts": 16, "batch_size": 16, "timing": {"repeats": 1},
           "grid": {"N": [6, 10], "noise": [0.1], "R": [10.0, 100.0], "dtype": ["float64"], "device": ["cpu"], "d": [1, 2]},
           "solvers": {"ols": {}, "ln-closed-form": {}}}
    run_matrix(parse_config(raw), tmp_path / "run", progress=False)
    monkeypatch.setattr(model_plots, "collect_models", lambda *a, **k: ({}, []))
    kept = {}
    monkeypatch.setattr(pub, "_close", kept.update)
    assert main(["publish", str(tmp_path / "run"), "--out", str(tmp_path / "pub")]) == 0
    head = (tmp_path / "pub" / "headline.md").read_text()
    assert head.startswith("### Mean MSE vs OLS [95 % CI] by solver and N (noise = 0.1, R = 10, dtype = float64, "
                           "device = cpu, d = 1)")
    note = "d = 2: left out of the headline and of the plots, which show d = 1"
    assert note in head and note in (tmp_path / "pub" / "index.html").read_text()
    assert any(n.startswith(note) for n in json.loads((tmp_path / "pub" / "publish.json").read_text())["left_out"])
    for name in ("mse_vs_n", "mse_vs_r"):
        assert kept[name]._suptitle.get_text().endswith("device = cpu, d = 1)"), name
    from icl_bench.report.run_summary import console_summary

    assert "device = cpu, d = 1:" in console_summary(pd.read_parquet(tmp_path / "run" / "results.parquet"))
    fits = scaling.scaling_table(pd.read_csv(tmp_path / "pub" / "summary.csv"))  # one fit per d, never both pooled
    assert sorted(fits[(fits.series == "ln-closed-form") & (fits.vs == "R")].d) == [1, 1, 2, 2]
    assert (fits.n_points + fits.n_floor <= 2).all()


def test_report_md_has_no_empty_notes_heading(run_dir, tmp_path, monkeypatch):
    import icl_bench.report.publish

    monkeypatch.setattr(icl_bench.report.publish, "_figures", lambda *a: ({}, []))
    monkeypatch.setattr(icl_bench.report.publish, "shared_timing_notes", lambda t: [])  # (other tests' cells ran beside)
    assert main(["publish", str(run_dir), "--out", str(tmp_path / "quiet")]) == 0
    assert "## Notes" not in (tmp_path / "quiet" / "report.md").read_text()  # no notes: no heading
    monkeypatch.setattr(icl_bench.report.publish, "_figures", lambda *a: ({}, ["x.png not drawn: why"]))
    assert main(["publish", str(run_dir), "--out", str(tmp_path / "noted")]) == 0
    assert "## Notes\n\n- x.png not drawn: why\n" in (tmp_path / "noted" / "report.md").read_text()


def test_failure_rows_sort_numeric_parameters_numerically(run_dir):
    from icl_bench.report import aggregate as report

    table, _ = report.load_runs([run_dir])
    steps = table[table.solver == "test-steps"].assign(status="error", message="x")
    shuffled = steps.sample(frac=1, random_state=0)
    got = report.failures(shuffled).drop_duplicates("solver_params").solver_params.tolist()
    assert got == ['{"steps": 1}', '{"steps": 2}', '{"steps": 4}']
    got = report.failure_summary(shuffled.assign(solver_params=shuffled.solver_params.str.replace("4", "16")))
    assert got.solver_params.tolist() == ['{"steps": 1}', '{"steps": 2}', '{"steps": 16}']


def test_mechanism_section_reads_ood_rows_or_says_they_are_missing(run_dir):
    from icl_bench.report import aggregate as report
    from icl_bench.report import mechanism

    table, _ = report.load_runs([run_dir])
    status = mechanism.section(table)["status"]  # a run of in-distribution cells only
    assert "every row is in-distribution (ood = none)" in status and "icl-bench run --config ood" in status, status
    assert mechanism.parse_ood("x-shift:5") == ("x_shift", 5.0) and mechanism.parse_ood("x-scale:0.1") == ("x_scale", 0.1)
    # stored OOD rows (as the matrix writes them): relative error = MSE vs OLS / E[(a + b u)^2] = 2
    rows = []
    for solver, params, errs in [("ols", "{}", (0.0, 1e-14, 2e-14)), ("gd", '{"steps": 4}', (0.1, 4.0, 2.0)),
                                 ("gd-lsa", '{"steps": 4}', (0.1, 3.0, 2.5)), ("trained-l1", "{}", (1e-3, 0.8, 1e-3))]:
        for ood, e in zip(("none", "x_shift=5", "x_scale=10"), errs):
            rows.append({**table.iloc[0].to_dict(), "solver": solver, "solver_params": params, "ood": ood,
                         "mse_vs_ols": e, "status": "ok"})
    sec = mechanism.section(report.add_series(pd.DataFrame(rows)))
    got = sec["table"].set_index("series")
    assert got.loc["ols", "verdict"] == "closed-form-like" and got.loc["gd steps=4", "verdict"] == "GD-like"
    assert got.loc["gd-lsa steps=4", "verdict"] == "GD-like" and got.loc["trained-l1", "verdict"] == "neither"
    assert got.loc["trained-l1", "x_shift=5"] == pytest.approx(0.4)
    assert list(got.columns[:3]) == ["none", "x_shift=5", "x_scale=10"]
    # a solver that never answered (every cell errored, or NaN on well-posed prompts) read "neither",
    # a finding about a solver that measured nothing (found by a new-user tryout)
    dead = [{**r, "solver": "bad", "solver_params": "{}", "status": s, "mse_vs_ols": math.nan,
             "n_nonfinite_well_posed": w} for r in rows[:3] for s, w in (("error", 0), ("ok", 5))]
    got = mechanism.section(report.add_series(pd.DataFrame(rows + dead)))["table"].set_index("series")
    assert got.loc["bad", "verdict"] == "no verdict" and "none of its 2 x-shift / x-scale cells" in got.loc["bad", "why"]
    assert got.loc["trained-l1", "verdict"] == "neither"
    huge = [{**r, "solver": "huge", "solver_params": "{}", "mse_vs_ols": math.inf} for r in rows[:3]]  # answered, and
    got = mechanism.section(report.add_series(pd.DataFrame(rows + huge)))["table"].set_index("series")  # overflowed:
    assert got.loc["huge", "verdict"] == "neither"  # a failed cell, not "no verdict"


def test_mechanism_table_sorts_steps_numerically(run_dir):
    from icl_bench.report import aggregate as report
    from icl_bench.report import mechanism

    table, _ = report.load_runs([run_dir])
    rows = [{**table.iloc[0].to_dict(), "solver": "gd", "solver_params": json.dumps({"steps": k}), "ood": ood,
             "mse_vs_ols": 0.1, "status": "ok"} for k in (16, 1, 4) for ood in ("none", "x_shift=5")]
    got = mechanism.section(report.add_series(pd.DataFrame(rows)))["table"]
    assert got.series.tolist() == ["gd steps=1", "gd steps=4", "gd steps=16"]  # as in the headline, not text order


def test_console_summary_is_at_one_setting_with_skip_reasons_grouped(run_dir):
    from icl_bench.report.run_summary import console_summary

    table = pd.read_parquet(run_dir / "results.parquet")
    text = console_summary(table)
    assert "at N = 5, noise = 0, R = 10, dtype = float32, device = cpu:" in text
    ok = table[(table.status == "ok") & (table.N == 5) & (table.noise == 0) & (table.R == 10) & (table.dtype == "float32")]
    line = next(ln for ln in text.splitlines() if ln.startswith("test-steps steps=4 "))
    mse = ok[ok.solver_params == json.dumps({"steps": 4})].mse_vs_ols.mean()
    assert line.split()[2:5] == ["16", "0", "0"] and f"{mse:.3g}" in line
    assert "8 cells not ok, by reason:" in text and "  error x8 [test-fails]: RuntimeError: boom at N=12" in text
    assert "NaN/inf predictions" not in text  # every prediction finite: no such column
    alone = table.assign(concurrency=1)  # (the fixture's run may have been timed beside other test processes' cells)
    assert "timed while other icl-bench cells ran" not in console_summary(alone)  # each cell timed alone
    busy = alone.assign(concurrency=alone.concurrency.where(table.solver != "ols", 2))  # a Dask run's rows
    n_ols = len(ok[ok.solver == "ols"])
    assert (f"prompts/s: {n_ols} of the {len(ok)} cells above were timed while other icl-bench cells ran on the same "
            "machine (concurrency > 1)") in console_summary(busy)
    first = (table.status == "ok") & (table.N == 5) & (table.noise == 0) & (table.R == 10) & (table.dtype == "float32")
    first &= table.solver == "ols"
    table.loc[first[first].index[:1], ["n_nonfinite", "n_nonfinite_well_posed"]] = 3  # the mean was over the
    text = console_summary(table)  # others: said beside it, under a header that names inf too (a solver's
    assert "NaN/inf predictions" in text  # inf was counted under 'NaN predictions'; found by an adversarial tester)
    line = next(ln for ln in text.splitlines() if ln.startswith("ols "))
    n = int(table[first].n_prompts.sum())
    assert line.rstrip().endswith(f"3 of {n}"), line
    table.loc[first[first].index[:1], "n_ill_posed"] = 2  # well-posed prompts only: 3 failed of n - 2
    line = next(ln for ln in console_summary(table).splitlines() if ln.startswith("ols "))
    assert line.rstrip().endswith(f"3 of {n - 2}"), line
    table.loc[first[first].index[:1], ["n_ill_posed", "n_nonfinite_well_posed"]] = [3, 0]  # NaN where ill-posed
    assert "NaN/inf predictions" not in console_summary(table)  # is the right answer, not a failure
    old = table.drop(columns=["n_ill_posed", "n_nonfinite_well_posed"])  # a run from before the columns:
    line = next(ln for ln in console_summary(old).splitlines() if ln.startswith("ols "))  # every NaN counts
    assert line.rstrip().endswith(f"3 of {n}"), line


def test_a_run_folder_without_metadata_json_is_published_with_a_note(run_dir, published, tmp_path, capsys, monkeypatch):
    """metadata.json is written last and marks a finished run; a folder without it was published
    silently (found by a new-user tryout). It still publishes, and the notes (console, page,
    publish.json) say it is unfinished and how to complete it."""
    from icl_bench.report import model_plots

    monkeypatch.setattr(model_plots, "collect_models", lambda *a, **k: ({}, []))
    copy = tmp_path / "x"
    shutil.copytree(run_dir, copy)
    (copy / "metadata.json").unlink()
    assert main(["publish", str(copy), "--out", str(tmp_path / "p")]) == 0
    note = (f"run {copy}: no metadata.json, which `icl-bench run` writes last, so nothing marks it a finished run "
            f"(it stopped before writing it, or was copied without it) and its tables may lack cells; complete it "
            f"with `icl-bench run --resume --out {copy}`, which reads the config it recorded")
    assert f"note: {note}\n" in capsys.readouterr().out
    assert json.loads((tmp_path / "p" / "publish.json").read_text())["notes"][0] == note
    assert "no metadata.json, which <code>icl-bench run</code> writes last" in (tmp_path / "p" / "index.html").read_text()
    assert not any("no metadata.json" in n for n in json.loads((published / "publish.json").read_text())["notes"])


def test_only_a_missing_metadata_json_makes_an_unfinished_note():
    # guards unfinished_notes' `meta is None`: an empty metadata object is still the finished mark
    from icl_bench.report.load import unfinished_notes

    (note,) = unfinished_notes({"a": {}, "b": None})
    assert note.startswith("run b: no metadata.json")


def test_names_in_notes_are_escaped_for_markdown(run_dir, tmp_path, monkeypatch):
    """A plugin named `<!-- headline:end -->` read "Warning: : no finite prediction" on GitHub (its name
    hidden as an HTML comment) and `<b>` rendered bold: the notes' text is escaped in headline.md and
    report.md as table cells are; index.html escapes it already."""
    from icl_bench.report import aggregate, model_plots

    name = "<!-- x --> a|b & <b>c</b>"
    monkeypatch.setattr(model_plots, "collect_models", lambda *a, **k: ({}, [f"{name}: a `code` note"]))
    monkeypatch.setattr(aggregate, "no_answer_notes", lambda table: [f"{name}: no finite prediction"])
    assert main(["publish", str(run_dir), "--out", str(tmp_path / "p")]) == 0
    escaped = "&lt;!-- x --> a\\|b &amp; &lt;b>c&lt;/b>"
    assert f"Warning: {escaped}: no finite prediction." in (tmp_path / "p" / "headline.md").read_text()
    text = (tmp_path / "p" / "report.md").read_text()
    assert f"- {escaped}: a `code` note" in text and f"- {escaped}: no finite prediction" in text
    assert name not in text
    assert "&lt;!-- x --&gt; a|b &amp; &lt;b&gt;c&lt;/b&gt;: a <code>code</code> note" in (tmp_path / "p" / "index.html").read_text()


def test_an_out_that_is_a_link_keeps_the_link_and_replaces_its_target(run_dir, tmp_path, monkeypatch):
    """publish --force over a symbolic link to an earlier report replaced the link by a folder and
    left the target stale (a carried-over item): now the target is replaced and the link kept."""
    from icl_bench.report import model_plots

    monkeypatch.setattr(model_plots, "collect_models", lambda *a, **k: ({}, []))
    assert main(["publish", str(run_dir), "--out", str(tmp_path / "target")]) == 0
    first = os.stat(tmp_path / "target").st_ino
    (tmp_path / "link").symlink_to("target")
    assert main(["publish", str(run_dir), "--out", str(tmp_path / "link"), "--force"]) == 0
    assert (tmp_path / "link").is_symlink() and os.readlink(tmp_path / "link") == "target"
    assert os.stat(tmp_path / "target").st_ino != first  # a new report folder, moved in through the link
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "target"]  # no stray temp folder


def _cli(capsys, *args):
    code = main(["publish", *map(str, args)])
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize("case", ["missing", "no-parquet", "corrupt", "bad-at", "bad-at-form"])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, tmp_path, run_dir, capsys):
    out = tmp_path / "out"
    bad = tmp_path / "bad"
    extra = []
    if case == "no-parquet":
        bad.mkdir()
        (bad / "metadata.json").write_text("{}")
    elif case == "corrupt":
        bad.mkdir()
        (bad / "results.parquet").write_bytes((run_dir / "results.parquet").read_bytes()[:300])
    elif case.startswith("bad-at"):
        bad, extra = run_dir, ["--at", "R=7" if case == "bad-at" else "R"]
    code, err = _cli(capsys, bad, "--out", out, *extra)
    assert code == 2 and err.count("\n") == 1 and err.startswith("icl-bench: error: ")
    assert "Traceback" not in err and not out.exists()
    expect = {"missing": "is not a folder", "no-parquet": "has no results.parquet", "corrupt": "cannot be read",
              "bad-at": "R=7 has no ok cells; accepted: 10.0, 100.0", "bad-at-form": "expected AXIS=VALUE"}[case]
    assert expect in err


@pytest.mark.parametrize("how", ["no-column", "no-rows"])
def test_a_table_without_a_required_column_or_rows_is_refused_by_name(run_dir, tmp_path, how):
    # guards load_run's column and row checks: one line naming what is missing, not a failure further on
    from icl_bench.report.load import load_run

    bad = tmp_path / "bad"
    bad.mkdir()
    t = pd.read_parquet(run_dir / "results.parquet")
    (t.drop(columns=["weight_l1", "message"]) if how == "no-column" else t.iloc[:0]).to_parquet(bad / "results.parquet")
    expect = "lacks the columns weight_l1, message" if how == "no-column" else "has no rows"
    with pytest.raises(ConfigError, match=rf"^RUN_DIR: {bad / 'results.parquet'} {expect}$"):
        load_run(bad)


def test_at_values_are_read_in_the_type_of_their_axis():
    """--at N=12.0 is N = 12 (an integer axis) as --at R=1e1 is R = 10.0; noise=nan picks the NaN of
    CSV data; text that is not a number, or not an integer for N, says so (not "no ok cells")."""
    from icl_bench.report import aggregate as report

    t = pd.DataFrame([dict(status="ok", N=n, noise=math.nan, R=10.0, dtype="float64", device="cpu", d=1, ood="none")
                      for n in (5, 12)])
    s = report.representative(t, {"N": "12.0", "R": "1e1", "noise": "nan", "d": "1"})
    assert s["N"] == 12 and type(s["N"]) is int and s["R"] == 10.0 and math.isnan(s["noise"]) and s["d"] == 1
    for axis, text, problem in (("N", "abc", "is not a number (N takes integers); accepted: 5, 12"),
                                ("N", "4.5", "is not an integer (N takes integers)"), ("N", "7", "has no ok cells"),
                                ("R", "ten", "is not a number (R takes numbers); accepted: 10.0"),
                                ("noise", "0.1", "has no ok cells; accepted: nan")):
        with pytest.raises(ConfigError, match=f"^--at: {axis}={text} " + problem.replace("(", r"\(").replace(")", r"\)")):
            report.representative(t, {axis: text})
    zero = t.assign(noise=0.0)
    assert math.copysign(1.0, report.representative(zero, {"noise": "-0"})["noise"]) == 1.0  # titled "noise = -0"


def test_at_values_that_no_ok_cell_has_together_are_refused():
    """--at N=3 --at noise=0.5 was accepted when each value alone had ok cells but no cell had both:
    the plots were "not drawn" and the headline showed another N (a review)."""
    from icl_bench.report import aggregate as report

    t = pd.DataFrame([dict(status="ok", N=n, noise=z, R=10.0, dtype="float64", device="cpu", d=1, ood="none")
                      for n, z in ((3, 0.1), (30, 0.1), (30, 0.5))])
    with pytest.raises(ConfigError, match=r"^--at: no ok cell has N=3 and noise=0.5 together; the ok cells at N=3 "
                                          r"have noise = 0.1$"):
        report.representative(t, {"N": "3", "noise": "0.5"})
    assert report.representative(t, {"N": "30", "noise": "0.5"})["N"] == 30


def test_the_other_axes_default_among_the_cells_at_the_at_values():
    """--at d=3 took N = 3, the lower median of N over every d, where every d = 3 cell is ill-posed
    (N <= d): the plots and scaling fits at d = 3 came out empty (found by a review)."""
    from icl_bench.report import aggregate as report

    base = dict(status="ok", noise=0.1, R=10.0, dtype="float64", device="cpu", ood="none")
    t = pd.DataFrame([dict(base, N=n, d=1) for n in (2, 3, 4, 100)] + [dict(base, N=n, d=3) for n in (4, 100)]
                     + [dict(base, N=n, d=3, status="skipped") for n in (2, 3)])
    assert report.representative(t)["N"] == 3 and report.representative(t, {"d": "3"})["N"] == 4
    # two runs of other grids: N from one run and noise, R from the other was a setting no run had (a review)
    a = [dict(base, N=n, noise=z, R=r, d=1) for n in (5, 20, 80) for z in (0.0, 0.5) for r in (10.0, 1000.0)]
    b = [dict(base, N=n, noise=0.1, R=r, d=1) for n in (10, 30, 100) for r in (10.0, 100.0)]
    s = report.representative(pd.DataFrame(a + b))
    assert (s["N"], s["noise"], s["R"]) == (20, 0.0, 10.0)  # was (20, 0.1, 100.0)
    assert list(s) == list(report.AXES)
    # an OOD-only run beside an in-distribution one: ood = none (and d) are chosen before N (a review)
    c = [dict(base, N=n, d=1, ood="none") for n in (10, 30)] + \
        [dict(base, N=n, d=3, ood=o) for n in (100, 300, 1000) for o in ("x*10", "shift:5")]
    s = report.representative(pd.DataFrame(c))
    assert (s["ood"], s["d"], s["N"]) == ("none", 1, 10)


def test_out_not_empty_needs_force_and_never_overlaps_a_run(published, run_dir, capsys):
    before = (published / "index.html").read_text()
    code, err = _cli(capsys, run_dir, "--out", published)
    assert code == 2 and f"--out: {published} holds an earlier report; pass --force to replace it" in err, err
    assert (published / "index.html").read_text() == before
    notes = published.parent / "notes"  # a folder publish did not write: --force is not offered (a review)
    notes.mkdir()
    (notes / "mine.txt").write_text("mine")
    code, err = _cli(capsys, run_dir, "--out", notes)
    assert code == 2 and "icl-bench publish did not write it" in err and "pass --force" not in err, err
    assert [p.name for p in notes.iterdir()] == ["mine.txt"]
    (published / "mine.txt").write_text("mine")  # an earlier report with a file put there since: named, no --force
    code, err = _cli(capsys, run_dir, "--out", published)
    assert code == 2 and "holds mine.txt, which icl-bench publish did not write there" in err and "pass --force" not in err, err
    (published / "mine.txt").unlink()
    code, err = _cli(capsys, run_dir, "--out", run_dir / "report", "--force")
    assert code == 2 and "overlaps the run folder" in err and not (run_dir / "report").exists()
    code, err = _cli(capsys, run_dir, "--out", run_dir.parent, "--force")
    assert code == 2 and "overlaps" in err and (run_dir / "results.parquet").is_file()


def test_force_replaces_a_previous_report(tmp_path, run_dir, monkeypatch):
    import icl_bench.report.publish

    monkeypatch.setattr(icl_bench.report.publish, "_figures", lambda *a: ({}, ["plots left out (fast test)"]))
    out = tmp_path / "pub"
    out.mkdir()
    (out / "thesis.tex").write_text("mine")  # a folder publish did not write: --force refuses it
    assert main(["report", str(run_dir), "--out", str(out), "--force"]) == 2
    assert [p.name for p in out.iterdir()] == ["thesis.tex"]
    (out / "thesis.tex").unlink()
    assert main(["report", str(run_dir), "--out", str(out)]) == 0
    (out / "stale.txt").write_text("old")  # put there after the publish: --force would delete it, so it refuses
    assert main(["report", str(run_dir), "--out", str(out), "--force", "--at", "dtype=float64"]) == 2
    assert (out / "stale.txt").read_text() == "old"
    (out / "stale.txt").unlink()
    assert main(["report", str(run_dir), "--out", str(out), "--force", "--at", "dtype=float64"]) == 0
    assert (out / "index.html").is_file()
    assert json.loads((out / "publish.json").read_text())["setting"]["dtype"] == "float64"
    assert "dtype = float64" in (out / "headline.md").read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["pub"]


BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
IMAGE_CHECK = """<script>window.addEventListener('load', () => {
  const imgs = [...document.images];
  const ok = imgs.filter(i => i.complete && i.naturalWidth > 0).map(i => i.getAttribute('src'));
  const fit = imgs.every(i => i.getBoundingClientRect().right <= document.documentElement.clientWidth);
  const wide = document.documentElement.scrollWidth > document.documentElement.clientWidth;
  document.body.insertAdjacentHTML('beforeend',
    `<p id="imgcheck">${ok.length}/${imgs.length} ${ok.join(' ')}</p><p id="fit">${fit} ${wide}</p>`);
});</script></body>"""


@pytest.mark.skipif(BROWSER is None, reason="no headless Chromium (chromium / chromium-browser / google-chrome) on PATH")
def test_index_html_shows_every_plot_in_headless_chromium(published, tmp_path):
    import re
    import subprocess

    site = shutil.copytree(published, tmp_path / "site")
    page = (site / "index.html").read_text()
    (site / "check.html").write_text(page.replace("</body>", IMAGE_CHECK))
    cmd = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--allow-file-access-from-files", "--window-size=1000,800", "--virtual-time-budget=5000", "--dump-dom",
           (site / "check.html").as_uri()]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    found = re.search(r'<p id="imgcheck">(\d+)/(\d+) ([^<]*)</p>', dom)
    assert found, dom[-500:]
    pngs = sorted(f"plots/{p.name}" for p in (site / "plots").glob("*.png"))
    assert int(found[2]) == len(pngs) and sorted(found[3].split()) == pngs  # every <img> decoded
    # every figure fits the window and nothing makes the page scroll sideways (wide tables scroll
    # inside their own box)
    assert re.search(r'<p id="fit">true false</p>', dom), re.search(r'<p id="fit">[^<]*</p>', dom)


def test_checkpoints_are_written_readable_by_others(tmp_path):
    from icl_bench.solvers.checkpoint import save_checkpoint
    from icl_bench.solvers.transformer import Transformer, TransformerConfig

    stem = save_checkpoint(Transformer(TransformerConfig(n_layers=1, n_heads=1)), tmp_path / "m")
    for suffix in (".safetensors", ".json"):  # safetensors alone would write 0o600
        assert oct(Path(str(stem) + suffix).stat().st_mode & 0o777) == "0o644"


def test_seed_means_pool_by_their_finite_predictions():
    """A seed's mse is the mean over its finite predictions, so pooling weighs it by those
    (n_prompts - n_nonfinite), a seed with none adds nothing, and the headline says how many
    predictions were NaN."""
    from icl_bench.report import aggregate as report

    cell = dict(solver="s", solver_params="{}", N=10, noise=0.1, R=100.0, dtype="float32", device="cpu",
                d=1, ood="none", prompts="synthetic", series="s", series_rank=0, status="ok", prompts_per_s=1.0)
    rows = [dict(cell, seed=0, n_prompts=100, n_nonfinite=90, mse_vs_ols=1.0, mse_vs_ols_se=0.1,
                 mse_vs_truth=1.0, mse_vs_truth_se=0.1),
            dict(cell, seed=1, n_prompts=100, n_nonfinite=0, mse_vs_ols=3.0, mse_vs_ols_se=0.1,
                 mse_vs_truth=3.0, mse_vs_truth_se=0.1),
            dict(cell, seed=2, n_prompts=100, n_nonfinite=100, mse_vs_ols=math.nan, mse_vs_ols_se=math.nan,
                 mse_vs_truth=math.nan, mse_vs_truth_se=math.nan)]
    got = report.aggregate(pd.DataFrame(rows)).iloc[0]
    assert got.mse_vs_ols == pytest.approx((10 * 1.0 + 100 * 3.0) / 110, rel=1e-12)
    assert got.mse_vs_truth == pytest.approx((10 * 1.0 + 100 * 3.0) / 110, rel=1e-12)
    assert got.n_prompts == 300 and got.n_nonfinite == 190
    head = report.headline(report.aggregate(pd.DataFrame(rows)),
                           {"noise": 0.1, "R": 100.0, "dtype": "float32", "device": "cpu", "d": 1, "ood": "none"})
    assert head.loc[0, "N=10"].endswith("(190 of 300 NaN/inf)"), head
    with warnings.catch_warnings():  # every seed non-finite: NaN mean and interval, no 0 / 0
        warnings.simplefilter("error")
        none = report.aggregate(pd.DataFrame(rows[2:])).iloc[0]
    assert math.isnan(none.mse_vs_ols) and math.isnan(none.mse_vs_ols_ci_low) and none.n_nonfinite == 100


def test_headline_names_a_missing_cell_instead_of_printing_nan():
    """A series with no ok cell at one N (skipped there, or a run without that N) used to show a
    bare `nan`, which reads as a NaN answer (found by a new-user tryout)."""
    from icl_bench.report import aggregate as report

    cell = dict(solver_params="{}", noise=0.1, R=100.0, dtype="float32", device="cpu", d=1, ood="none",
                prompts="synthetic", status="ok", prompts_per_s=1.0, seed=0, n_prompts=10, n_nonfinite=0,
                mse_vs_ols=1.0, mse_vs_ols_se=0.1, mse_vs_truth=1.0, mse_vs_truth_se=0.1)
    rows = [dict(cell, solver="a", series="a", series_rank=0, N=10), dict(cell, solver="a", series="a", series_rank=0, N=20),
            dict(cell, solver="b", series="b", series_rank=1, N=20)]
    head = report.headline(report.aggregate(pd.DataFrame(rows)),
                           {"noise": 0.1, "R": 100.0, "dtype": "float32", "device": "cpu", "d": 1, "ood": "none"})
    assert head.set_index("series").loc["b", "N=10"] == "(no ok cell)"
    assert "nan" not in report.to_markdown(head)
    # with the run's table, a series that errored at every N (and an N where nothing was ok) are
    # rows and columns of their own; it used to vanish from the headline without a note
    table = pd.DataFrame(rows + [dict(cell, solver="c", series="c", series_rank=2, N=n, status="error") for n in (10, 30)])
    head = report.headline(report.aggregate(table[table.status == "ok"]), {"noise": 0.1, "R": 100.0, "dtype": "float32",
                           "device": "cpu", "d": 1, "ood": "none"}, table).set_index("series")
    assert list(head.index) == ["a", "b", "c"] and list(head.columns) == ["N=10", "N=20", "N=30"]
    assert (head.loc["c"] == "(no ok cell)").all() and (head["N=30"] == "(no ok cell)").all()
    # a run with no ok cell at the setting is left out of the headline (a note says so): it adds no row or N
    table = pd.concat([table.assign(run="A"), pd.DataFrame([dict(cell, solver="d", series="d", series_rank=3, N=300,
                                                                 status="error", run="B")])])
    head = report.headline(report.aggregate(table[table.status == "ok"]), {"noise": 0.1, "R": 100.0, "dtype": "float32",
                           "device": "cpu", "d": 1, "ood": "none"}, table).set_index("series")
    assert list(head.index) == ["a", "b", "c"] and list(head.columns) == ["N=10", "N=20", "N=30"]


def test_seeds_above_2_to_the_53_publish_exactly(run_dir, tmp_path):
    """Seeds are int64 up to 2^63 - 1 (the config's limit); the schema check keeps them exact, so
    seeds 2^53 and 2^53 + 1 stay two seeds (a float round trip merged them, and refused 2^63 - 1)."""
    from icl_bench.report import aggregate as report

    t = pd.read_parquet(run_dir / "results.parquet")
    runs = []
    for seed in (2**53, 2**53 + 1, 2**63 - 1):
        (tmp_path / str(seed)).mkdir()
        t.assign(seed=pd.Series(seed, index=t.index, dtype="int64")).to_parquet(tmp_path / str(seed) / "results.parquet")
        runs.append(tmp_path / str(seed))
    table, _ = report.load_runs(runs)
    assert sorted(set(table.seed.tolist())) == [2**53, 2**53 + 1, 2**63 - 1]


def test_a_checkpoint_named_twice_is_drawn_once(tables, monkeypatch, tmp_path):
    """`--checkpoint trained-l1-R100 --checkpoint trained-l1-R100.json` (and the shipped folder's
    path) name one file pair: it used to be drawn three times, as three models."""
    from icl_bench.report import model_plots
    from icl_bench.resources import models_dir

    monkeypatch.chdir(tmp_path)
    table, _, setting = tables
    names = ["trained-l1-R100", "trained-l1-R100.json", str(models_dir() / "trained-l1-R100.safetensors")]
    models, notes = model_plots.collect_models(table, setting, names, n_prompts=16)
    assert list(models) == ["construction (R=10)", "checkpoint trained-l1-R100"]
    assert notes == ["--checkpoint trained-l1-R100: trained at R = 100, probed at the report's R = 10 (--at R=100 "
                     "probes it at its own)"] + [f"--checkpoint {n}: drawn once, as 'checkpoint trained-l1-R100'" for n in names[1:]]
    _, notes = model_plots.collect_models(table, {**setting, "R": 100.0}, names[:1], n_prompts=16)
    assert notes == []  # at its own R: nothing to say
    (tmp_path / "lk").mkdir()  # links to the shipped pair reach the same file: drawn once too
    for half in ("json", "safetensors"):
        (tmp_path / "lk" / f"m.{half}").symlink_to(models_dir() / f"trained-l1-R100.{half}")
    models, notes = model_plots.collect_models(table, setting, ["trained-l1-R100", "lk/m"], n_prompts=16)
    assert len(models) == 2 and notes[-1] == "--checkpoint lk/m: drawn once, as 'checkpoint trained-l1-R100'"
    _, notes = model_plots.collect_models(table, setting, ["trained-l1-R1000"], n_prompts=16)
    assert notes == ["--checkpoint trained-l1-R1000: trained at R = 1000, probed at the report's R = 10"]  # no R = 1000 run


def test_a_checkpoint_without_layernorm_is_not_probed_as_one(tables, monkeypatch, tmp_path):
    """`--checkpoint trained-lsa-R10` (no LayerNorm) was probed and its attention output titled
    "layer-2 LayerNorm output"; a run's trained-lsa solver was already left out with a note."""
    from icl_bench.report import model_plots

    monkeypatch.chdir(tmp_path)
    table, _, setting = tables
    models, notes = model_plots.collect_models(table, setting, ["trained-lsa-R10"], n_prompts=16)
    assert list(models) == ["construction (R=10)"]
    assert notes[0] == "--checkpoint trained-lsa-R10: no LayerNorm weights, not drawn beside the LayerNorm construction"


def test_a_flatten_checkpoint_at_another_N_is_drawn_without_probes_and_gd_lsa_is_named(tables, tmp_path):
    """A flatten-readout checkpoint trained at N = 40, given to a report at another N, was left out
    of weights.png too (its probe failed), though its weights need no prompts; a run's gd-lsa was
    left out of both figures without a note (a review)."""
    from icl_bench.report import model_plots
    from icl_bench.solvers.checkpoint import save_checkpoint

    table, _, setting = tables
    flat = Transformer(TransformerConfig(readout="flatten", N=40)).to(torch.float64)
    stem = save_checkpoint(flat, tmp_path / "flat40", {"R": 100.0, "N": 40, "seed": 0})  # (at the report's R = 10 it
    # also read "trained at R = 100, probed at the report's R = 10", of a model not probed: a review)
    models, notes = model_plots.collect_models(table, setting, [str(stem)], n_prompts=16)
    label = f"checkpoint {stem}"
    assert models[label]["trace"] is None and set(models[label]["weights"]) == set(flat.weight_matrices())
    assert f"{label}: its flatten readout fixes N = 40, so probes.png leaves it out (the report's N = {setting['N']}); " \
           "weights.png draws it" in notes and not any("probed at" in n for n in notes), notes
    assert label in [f.get_text() for f in (sf._suptitle for sf in model_plots.weight_heatmaps(models).subfigs) if f]
    assert len(model_plots.probe_scatter(models).axes) == 3  # the construction's row only
    ok = table[(table.status == "ok") & (table.solver == "ols")]
    _, notes = model_plots.collect_models(pd.concat([table, ok.assign(solver="gd-lsa", series="gd-lsa")]), setting,
                                          n_prompts=16)
    assert "gd-lsa: no LayerNorm weights, not drawn beside the LayerNorm construction" in notes, notes


def test_grid_differences_name_a_csv_runs_noise_as_n_a():
    """A CSV run's noise is all NaN: the note read "rcsv: , n/a" (found by a review)."""
    from icl_bench.report.coverage import grid_differences

    t = pd.DataFrame({"run": ["rcsv", "gen", "gen"], "noise": [math.nan, 0.0, 0.1]})
    t = t.assign(**{a: 1 for a in ("N", "R", "dtype", "device", "d", "ood")})
    assert grid_differences(t) == ["the runs have different noise grids: rcsv: n/a; gen: 0, 0.1"]


def test_probe_prompts_shrink_at_large_N(tables):
    """A run at N = 100 000 publishes: the probe traces hold every stream of every token, and 512
    prompts there asked for 3.3 GB in one tensor (a traceback). The prompts shrink to at most
    PROBE_TOKENS tokens, with a note; the construction's probes still fit."""
    from icl_bench.report import model_plots

    table, _, setting = tables
    models, notes = model_plots.collect_models(table, {**setting, "N": 100_000})
    (trace,) = [m["trace"] for m in models.values()]
    assert trace["tokens"].shape == (2, 100_001, 3)
    assert notes == [f"probes at N=100000 drawn from 2 prompts (at most {model_plots.PROBE_TOKENS} tokens)",
                     REFERENCE_NOTE]
    small, notes = model_plots.collect_models(table, setting)  # the default matrix's N: all 512 prompts
    assert next(iter(small.values()))["trace"]["tokens"].shape[0] == 512 and notes == [REFERENCE_NOTE]


def test_left_out_note_when_each_value_has_ok_cells_but_not_together():
    """R = [1e-300, 10] x dtype = [float32, float64] where float32 at R = 1e-300 errors: the
    representative setting (per-axis medians) has no ok cell, yet every value has some, so the note
    read "its ok cells have  (publish it alone, ...)" with nothing listed, also for a run published
    alone. It now says so and names an --at that has ok cells."""
    from icl_bench.report.coverage import left_out

    def rows(run, series, statuses):
        return [{"run": run, "series": series, "status": st, "N": 10, "noise": 0.1, "R": R, "dtype": dt,
                 "device": "cpu", "d": 1, "ood": "none"} for (R, dt), st in statuses.items()]

    grid = {(1e-300, "float32"): "error", (1e-300, "float64"): "ok", (10.0, "float32"): "ok", (10.0, "float64"): "ok"}
    setting = {"N": 10, "noise": 0.1, "R": 1e-300, "dtype": "float32", "device": "cpu", "d": 1, "ood": "none"}
    alone = pd.DataFrame(rows("r5", "gd-lsa", grid))
    (note,) = left_out(alone, setting)
    assert note == ("run r5: left out of the headline and of the plots at noise = 0.1, R = 1e-300, dtype = float32, "
                    "device = cpu: it has ok cells at each of these values but none at all of them together "
                    "(choose the setting with --at, e.g. --at dtype=float64)")
    two = pd.DataFrame(rows("r5", "gd-lsa", grid) + rows("other", "ols", {(1e-300, "float32"): "ok"}))
    assert left_out(two, setting)[-1].endswith("(publish it alone, or choose the setting with --at, e.g. --at dtype=float64)")
    series = pd.DataFrame(rows("r5", "gd-lsa", grid) + rows("r5", "ols", {(1e-300, "float32"): "ok"}))
    assert left_out(series, setting) == ["series gd-lsa: a row of (no ok cell) in the headline at noise = 0.1, "
                                         "R = 1e-300, dtype = float32, device = cpu, where none of its cells is ok (the "
                                         "failed and skipped cells say why): it has ok cells at each of these values "
                                         "but none at all of them together (e.g. --at dtype=float64)"]
    series = pd.DataFrame(rows("r5", "gd-lsa", {k: v for k, v in grid.items() if k != (1e-300, "float32")})
                          + rows("r5", "ols", {(1e-300, "float32"): "ok"}))  # no cell at the setting: no row
    assert left_out(series, setting)[0].startswith("series gd-lsa: not in the headline at noise = 0.1, R = 1e-300, ")


def test_a_series_that_ran_at_the_setting_without_an_ok_cell_is_no_note_of_absence(tmp_path, plugin_path, capsys):
    """`publish --at d=2` of a run with d = 1, 2, where a plugin has no ok cell at d = 2 (skipped:
    one regressor only): the headline has its "(no ok cell)" row, and the note said "series
    plugin-mean-y: not in the headline" beside it (found by a new-user tryout)."""
    raw = {"seed": 0, "n_prompts": 16, "batch_size": 16, "timing": {"repeats": 1}, "all_solvers": False,
           "grid": {"N": [6], "d": [1, 2], "dtype": ["float64"]}, "solvers": {"ols": {}, "plugin-mean-y": {}}}
    run_matrix(parse_config(raw), tmp_path / "mv", progress=False)
    assert main(["publish", str(tmp_path / "mv"), "--out", str(tmp_path / "pub"), "--at", "d=2"]) == 0
    out = capsys.readouterr().out
    head = (tmp_path / "pub" / "headline.md").read_text()
    assert "| plugin-mean-y | (no ok cell) |" in " ".join(head.split()), head
    assert "not in the headline" not in out + head, out + head
    assert "series plugin-mean-y: a row of (no ok cell) in the headline at" in " ".join(head.split()), head
    assert "its ok cells have d = 1" in head


def test_a_killed_publish_leaves_no_temp_folder_for_good(tmp_path, run_dir, monkeypatch):
    """A publish killed while writing left its private `.OUT.*.tmp` folder beside OUT, and no later
    publish removed it (found by an adversarial review). The next publish into OUT removes those of
    a process that is gone, or older than an hour, and nothing else."""
    import os
    import subprocess
    import sys

    import icl_bench.report.publish

    monkeypatch.setattr(icl_bench.report.publish, "_figures", lambda *a: ({}, ["plots left out (fast test)"]))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live, hour_ago = os.getppid(), os.stat(tmp_path).st_mtime - 7200

    def temp(name, files=("index.html", "plots/mse_vs_n.png"), old=False):
        folder = tmp_path / name
        for f in files:
            (folder / f).parent.mkdir(parents=True, exist_ok=True)
            (folder / f).write_text("half written")
        if old:
            os.utime(folder, (hour_ago, hour_ago))
        return name

    gone = [temp(f".pub.{dead.pid}-abcd_123.tmp"), temp(f".pub.{live}-zzzzzzzz.tmp", old=True),
            temp(".pub.k2x9q1ab.tmp", old=True)]  # (a publish from before the pid was in the name)
    kept = [temp(f".pub.{live}-abcd_123.tmp"),  # a publish running now
            temp(".pub.k2x9q1ab.tmp".replace("k2", "k3")),  # no pid and recent: may be running
            temp(f".pub.{dead.pid}-qqqqqqqq.tmp", files=("index.html", "mine.txt")),  # holds what publish never writes
            temp(f".pub.{dead.pid}-rrrrrrrr.old", files=("previous/index.html",)),  # maybe the only copy of a report
            temp(f".pubs.{dead.pid}-abcd_123.tmp"), temp(f".pub.{dead.pid}-abcd_1234.tmp"),  # other names
            temp(f".pub.{dead.pid}-abcd_123.tmp.txt")]
    (tmp_path / ".pub.notes.tmp").write_text("a file, not a folder")
    kept.append(".pub.notes.tmp")
    assert main(["publish", str(run_dir), "--out", str(tmp_path / "pub")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept + ["pub"])
    assert not any((tmp_path / g).exists() for g in gone)  # (implied above: said, so a rename cannot hide it)


def test_probe_titles_use_the_series_label_and_wrap(tables, tmp_path):
    """A trained solver with its own models_dir was titled with its raw JSON parameters in
    probes.png, one line per panel, so long that it ran past the figure's edge (and read
    "trained-nol1-R10" for the R100 model) or into the next panel (found by a new-user tryout). The
    model plots now use the error plots' series label, and a probe title wraps to its panel."""
    import json
    import shutil

    from icl_bench.report import model_plots
    from icl_bench.resources import models_dir

    table, _, setting = tables
    mine = tmp_path / ("my-checkpoints-" + "x" * 60)
    mine.mkdir()
    for half in ("json", "safetensors"):
        shutil.copy(models_dir() / f"trained-nol1-R10.{half}", mine / f"trained-nol1-R10.{half}")
    ok = table[(table.status == "ok") & (table.solver == "ols")]
    label = f"trained-nol1 models_dir={mine}"
    rows = ok.assign(solver="trained-nol1", solver_params=json.dumps({"models_dir": str(mine)}),
                     series=label + " · x=uniform[-1, 1]")  # its prompt source: not the probes' prompts, left out
    models, _ = model_plots.collect_models(pd.concat([table, rows]), setting, n_prompts=16)
    assert f"{label} (trained-nol1-R10)" in models, list(models)
    fig = model_plots.probe_scatter({k: v for k, v in models.items() if k.startswith("trained-nol1")})
    titles = [ax.get_title() for ax in fig.axes]
    assert all(max(len(line) for line in t.split("\n")) <= 45 for t in titles), titles  # a panel's width
    assert all("".join(t.split("\n")[:-2]).replace(" ", "").startswith(label.replace(" ", "")) for t in titles)


def test_error_bands_say_over_how_many_prompts_and_seeds_and_that_they_under_cover(twins_summary):
    """The bands were captioned "95 % CI over prompts and seeds" with one prompt seed per cell, and
    the interval covers about 0.6-0.8 for heavy-tailed errors (results/ci_coverage.md; found by a
    review): the note now gives the counts and says so."""
    from icl_bench.report import plots

    _, summary, setting = twins_summary
    per = int(summary.n_prompts.iloc[0])
    for fig in (plots.mse_vs_n(summary, setting), plots.gd_steps(summary, setting)):
        note = " ".join(fig.texts[-1].get_text().split())
        assert f"band: nominal 95 % CI of the mean over the prompts of a point ({per} prompts, 1 prompt seed;" in note
        assert "under-covers heavy-tailed errors, docs/report.md" in note, note
    # seeds of 256 and 512 prompts: the counts per point (an average per seed, 384, was no seed's)
    two = pd.concat([summary, summary.assign(n_seeds=2, n_prompts=summary.n_prompts * 3, solver="x", series="x")])
    note = " ".join(plots.mse_vs_n(two, setting).texts[-1].get_text().split())
    assert f"({per}–{3 * per} prompts, 1–2 prompt seeds;" in note, note


def test_a_local_checkpoint_taking_a_shipped_name_is_noted(tables, tmp_path, monkeypatch):
    """`publish --checkpoint trained-l1-R100` beside a pair of one's own of that name draws one's
    own (as analyze does), which a note now says; from the package's own folder it is the shipped
    model, and nothing is said (analyze said it falsely there; found by a review)."""
    import shutil

    from icl_bench.report import model_plots
    from icl_bench.resources import models_dir

    table, _, setting = tables
    for half in ("json", "safetensors"):
        shutil.copy(models_dir() / f"trained-nol1-R10.{half}", tmp_path / f"trained-l1-R100.{half}")
    monkeypatch.chdir(tmp_path)
    _, notes = model_plots.collect_models(table, setting, ["trained-l1-R100"], n_prompts=16)
    assert f"--checkpoint trained-l1-R100: the pair in this folder ({tmp_path.resolve()}), not the shipped model of that name" in notes
    monkeypatch.chdir(models_dir())
    _, notes = model_plots.collect_models(table, setting, ["trained-l1-R100"], n_prompts=16)
    assert not any("the pair in this folder" in n for n in notes), notes


def test_a_plugin_family_keeps_its_colour_whatever_other_plugins_are_present():
    """Plugin families took the free colours in order of appearance, so adding a plugin (or a run
    folder) recoloured another one between publishes; each now takes its name's colour."""
    from icl_bench.report import series

    def colours(solvers):
        rows = pd.DataFrame({"series": solvers, "solver": solvers, "series_rank": range(len(solvers))})
        return {s: st["color"] for s, st in series.series_styles(rows).items()}

    alone = colours(["ols", "ridge"])
    for others in (["ols", "aaa", "ridge"], ["ols", "zzz", "kalman", "ridge"], ["ridge", "ols", "mine"]):
        got = colours(others)
        assert got["ridge"] == alone["ridge"] and got["ols"] == alone["ols"]
        assert len(set(got.values())) == len(others)  # still one colour per family
    many = colours(["ols"] + [f"p{i}" for i in range(8)])  # past the 5 free colours: distinct husl ones
    assert len(set(many.values())) == 9


def test_a_dollar_in_a_series_label_is_text_not_mathtext():
    """A parameter value with "$" (tag = "x$\\frac{a$") crashed publish with a mathtext traceback, and
    a paired one ("cost $5 or $6") was drawn as math italics (found by a review): labels, titles and
    notes are now literal text; the float-floor marker and power-of-ten ticks stay mathtext."""
    import io

    from matplotlib.figure import Figure

    from icl_bench.report.figure import finish

    labels = ['mean-y tag="cost $5 or $6"', r"mean-y tag=x$\frac{a$"]
    fig = Figure(figsize=(4, 3))
    ax = fig.subplots()
    for i, label in enumerate(labels):
        ax.plot([1, 2], [i, i + 1], label=label)
    ax.set_yscale("log")
    finish(fig, [(ax, None)], "N", "MSE", r"title x$\frac{a$", r"note $\frac{b$")
    fig.savefig(io.BytesIO(), format="png")  # the layout and the draw: raised ParseSyntaxException
    texts = [t for t in fig.legends[0].get_texts()]
    assert [t.get_text() for t in texts] == labels and not any(t.get_parse_math() for t in texts)
    assert not fig._suptitle.get_parse_math() and not fig.texts[-1].get_parse_math()


def test_tables_keep_grid_values_whole_and_escape_text_cells():
    """Markdown and HTML tables printed noise 0.1001 and R 1004 as 0.1 and 1e+03 (3 significant
    digits), so four cells read as one key; a label "tag=a|b" split its markdown row and moved every
    value one column right; "<b>" in a label rendered as HTML (found by a review)."""
    from icl_bench.report.aggregate import to_markdown
    from icl_bench.report.publish import _html_table

    df = pd.DataFrame({"series": ["tag=a|b", "<b>x</b> & y"], "noise": [0.1, 0.1001], "R": [1000.0, 1004.0],
                       "mse_vs_ols": [1.23456, 2e-9], "N": [10, 30]})
    md = to_markdown(df).splitlines()
    assert [line.count("|") - line.count("\\|") for line in md] == [6] * 4  # every row has its 5 cells
    assert "0.1001" in md[3] and "1004" in md[3] and "1.23 " in md[2] and "2e-09" in md[3]
    assert "tag=a\\|b" in md[2] and "&lt;b>x&lt;/b> &amp; y" in md[3]
    page = _html_table(df)
    assert "<td>0.1001</td>" in page and "<td>1004</td>" in page and "<td>1.23</td>" in page


def test_model_plots_say_what_they_draw_at_d_above_1_and_on_csv_runs():
    """At d = 2 weights.png and probes.png drew the d = 1 construction as if it had run; on a CSV run
    probes.png probed generated prompts without saying so (found by a review)."""
    from icl_bench.report import model_plots

    row = dict(status="ok", solver="ols", solver_params="{}", series="ols", N=12, noise=0.1, R=10.0,
               dtype="float64", device="cpu", ood="none")
    setting = {k: row[k] for k in ("N", "noise", "R", "dtype", "device", "ood")}
    models, notes = model_plots.collect_models(pd.DataFrame([dict(row, d=2), dict(row, d=1)]), dict(setting, d=2))
    assert models == {} and notes == ["weights.png and probes.png leave out the construction and the runs' trained "
                                      "solvers at d = 2: they are d = 1 networks, probed on d = 1 prompts (publish "
                                      "with --at d=1 to draw them)"]
    # no d = 1 cells: no advice to pick them; a --checkpoint is still drawn (its weights are the same at any d)
    models, notes = model_plots.collect_models(pd.DataFrame([dict(row, d=2)]), dict(setting, d=2),
                                               checkpoints=["trained-l1-R100"], n_prompts=8)
    assert list(models) == ["checkpoint trained-l1-R100"] and "--at d=1" not in notes[0]
    assert notes[0].endswith("; the --checkpoint models are drawn, probed on d = 1 prompts")
    csv = dict(row, d=1, noise=math.nan, prompts='{"csv": {"path": "d.csv", "x": "x", "y": "y"}}')
    models, notes = model_plots.collect_models(pd.DataFrame([csv]), dict(setting, d=1, noise=math.nan), n_prompts=8)
    assert list(models) == ["construction (R=10)"]
    assert "probes.png probes on 8 generated prompts (standard-normal x and slope, at N = 12, R = 10), not on the " \
           "CSV rows of the runs" in notes


def test_series_styles_and_summary_keep_their_documented_rules(tables):
    """Four rules no test held (found by a mutation review): two solvers of one family on two prompt
    sources take four line styles; a plugin's colour does not depend on row order; the summary's
    throughput is the median of its rows; the ill-posed note gives the largest k of n."""
    from icl_bench.report import aggregate as report
    from icl_bench.report import series

    rows = pd.DataFrame({"solver": ["gd", "gd", "gd-lsa", "gd-lsa"], "solver_params": ["{}"] * 4,
                         "prompts": ["A", "B", "A", "B"]})
    st = series.series_styles(report.add_series(rows))
    assert len({s["linestyle"] for s in st.values()}) == 4
    colours = [{s: v["color"] for s, v in series.series_styles(pd.DataFrame(
        {"series": names, "solver": names, "series_rank": range(2)})).items()} for names in (["plug0", "plug3"],
                                                                                            ["plug3", "plug0"])]
    assert colours[0] == colours[1]  # (plug0 and plug3 hash to one free colour: the first by name keeps it)
    table = tables[0]
    one = table[table.status == "ok"].iloc[[0]]
    three = pd.concat([one.assign(seed=s, prompts_per_s=v) for s, v in ((0, 100.0), (1, 110.0), (2, 1000.0))])
    assert report.aggregate(three)["prompts_per_s"].tolist() == [110.0]
    at = {"noise": 0.0, "R": 100.0, "dtype": "float64", "device": "cpu", "d": 1, "ood": "none"}
    summary = pd.DataFrame([{**at, "N": 10, "prompts": "", "n_prompts": n, "n_ill_posed": k} for k, n in ((2, 64), (5, 128))])
    (note,) = report.ill_posed_note(summary, {**at, "N": 10})
    assert "N=10: 5 of 128" in note and "2 of 64" not in note, note


def test_check_table_takes_all_zero_weights_and_refuses_more_nonfinite_well_posed_than_nonfinite():
    """weight_sparsity 1.0 (every weight zero, as sparsity.py writes it) is a valid fraction, and an
    ok row whose n_nonfinite_well_posed exceeds n_nonfinite (a hand-edited table: the headline's
    "(k of n NaN/inf)" then wrong) is refused (found by a mutation review)."""
    from icl_bench.report.validate import check_table

    assert check_table(pd.DataFrame({"status": ["ok"], "weight_sparsity": [1.0]}), Path("r.parquet")).shape == (1, 2)
    bad = pd.DataFrame({"status": ["ok"], "n_prompts": [100], "n_ill_posed": [0], "n_nonfinite_well_posed": [5],
                        "n_nonfinite": [2]})
    with pytest.raises(ConfigError, match="n_nonfinite_well_posed <= n_nonfinite"):
        check_table(bad, Path("r.parquet"))


def test_rounding_twins_and_shown_fits_stay_within_their_ood_value():
    """A float32 OOD row was compared with the float64 row of another OOD value (ood dropped from the
    twin's cell: flagged rounding-dominated wrongly), and --at ood=... showed the ood=none fit in the
    'exponent vs N' / 'vs R' columns (found by a mutation review)."""
    from icl_bench.report import scaling

    cells = [("none", "float64", 1e-12), ("none", "float32", 1e-12), ("x-scale:10", "float64", 1e-6),
             ("x-scale:10", "float32", 1.1e-6)]
    summary = pd.DataFrame([{"series": "ols", "solver": "ols", "solver_params": "{}", "prompts": "", "N": 30, "noise": 0.1,
                             "R": 10.0, "dtype": dt, "device": "cpu", "d": 1, "ood": ood, "mse_vs_ols": m}
                            for ood, dt, m in cells])
    assert not scaling.rounding_dominated(summary).any()
    at = {"N": 10, "noise": 0.1, "R": 10.0, "device": "cpu", "d": 1}
    fits = pd.DataFrame([{"series": "ols", "dtype": "float64", "vs": vs, **at, ("R" if vs == "R" else "N"): math.nan,
                          "ood": ood, **scaling.fit_exponent([10, 100, 1000], m, "float64")}
                         for vs in ("R", "N") for ood, m in (("none", [1, 0.1, 0.01]), ("x-scale:10", [1, 1, 1]))])
    shown = scaling.scaling_at(fits, {**at, "ood": "x-scale:10"}, ["ols"]).iloc[0]
    assert shown["exponent vs N"].startswith("0.00") and shown["exponent vs R"].startswith("0.00"), shown.to_dict()


def _agg_cell(**kw):
    base = {"solver": "s", "solver_params": "{}", "N": 10, "noise": 0.1, "R": 10.0, "dtype": "float64", "device": "cpu",
            "d": 1, "ood": "none", "prompts": "", "series": "s", "series_rank": 0, "status": "ok", "seed": 0,
            "n_prompts": 8, "mse_vs_ols": 1.0, "mse_vs_ols_se": 0.1, "mse_vs_truth": 1.0, "mse_vs_truth_se": 0.1,
            "prompts_per_s": 1.0, "message": "", "run": "r"}
    return {**base, **kw}


def test_sparsity_min_and_max_are_over_the_cells_of_a_solver_and_r():
    """sparsity(): weight_sparsity is the mean over a solver's cells at one R, with its min and max
    beside it (not swapped), and rows that are not ok or have no finite sparsity are left out."""
    from icl_bench.report import aggregate as report

    table = pd.DataFrame([_agg_cell(N=n, weight_sparsity=v, weight_l1=l1, status=st) for n, v, l1, st in
                          ((5, 0.2, 1.0, "ok"), (10, 0.6, 3.0, "ok"), (20, np.nan, 9.0, "ok"), (40, 0.9, 9.0, "error"))])
    (row,) = report.sparsity(table).to_dict("records")
    assert row["n_cells"] == 2 and row["weight_sparsity"] == pytest.approx(0.4) and row["weight_l1"] == 2.0
    assert (row["weight_sparsity_min"], row["weight_sparsity_max"]) == (0.2, 0.6)


def test_a_point_with_an_ok_seed_beside_a_failed_one_is_no_failed_point():
    """with_failed_points adds a failed (NaN) row only where a series has no ok cell at a point: a
    point where one seed errored and another is ok is measured, and a second, failed row there
    would break its line (and double the point)."""
    from icl_bench.report import aggregate as report

    table = pd.DataFrame([_agg_cell(N=5), _agg_cell(N=10), _agg_cell(N=10, seed=1, status="error", message="boom"),
                          _agg_cell(N=20, status="error", message="boom")])
    out = report.with_failed_points(report.aggregate(table), table)
    assert sorted(zip(out["N"], out["failed"])) == [(5, False), (10, False), (20, True)]


def test_failures_list_skipped_cells_beside_errored_ones():
    """failures() keeps every cell whose status is not "ok": "skipped" cells as well as "error" ones."""
    from icl_bench.report import aggregate as report

    table = pd.DataFrame([_agg_cell(N=5), _agg_cell(N=10, status="skipped", message="too big"),
                          _agg_cell(N=20, status="error", message="boom")])
    got = report.failures(table)
    assert list(zip(got["N"], got["status"], got["message"])) == [(10, "skipped", "too big"), (20, "error", "boom")]


def test_mse_vs_target_pools_seeds_by_their_scored_prompts():
    """mse_vs_target (no standard error) is pooled like mse_vs_ols: each seed's mean weighted by the
    prompts it scored (100 and 50 here), not the plain mean of the seeds' means."""
    from icl_bench.report import aggregate as report

    table = pd.DataFrame([_agg_cell(seed=0, n_prompts=100, mse_vs_target=1.0),
                          _agg_cell(seed=1, n_prompts=100, n_ill_posed=50, n_nonfinite_well_posed=0, n_nonfinite=50,
                                mse_vs_target=4.0)])
    table.loc[0, ["n_ill_posed", "n_nonfinite_well_posed", "n_nonfinite"]] = 0
    (row,) = report.aggregate(table).to_dict("records")
    assert row["mse_vs_target"] == pytest.approx((100 * 1.0 + 50 * 4.0) / 150, rel=1e-14)


def test_throughput_lists_the_first_series_at_the_top_on_a_log_axis_from_one_decade():
    """throughput: the y axis runs down (first series at the top), and the x axis is logarithmic as
    soon as the values span a decade (docs/report.md), here 10 to 1000 prompts/s."""
    from icl_bench.report import plots

    rows = [{"solver": name, "solver_params": "{}", "N": 10, "noise": 0.1, "R": 10.0, "dtype": "float64", "device": "cpu",
             "d": 1, "ood": "none", "prompts": "", "series": name, "series_rank": k, "status": "ok", "seed": 0,
             "n_prompts": 8, "prompts_per_s": v} for k, (name, v) in enumerate([("gd", 10.0), ("ols", 1000.0)])]
    (ax,) = plots.throughput(pd.DataFrame(rows)).axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["gd", "ols"] and ax.yaxis_inverted()
    assert ax.get_xscale() == "log"


def test_solvers_of_one_family_get_distinct_shades_of_its_colour():
    """series_styles: gd and gd-lsa (one family) get two different shades, one darker and one lighter
    than the family's tab10 blue; a lone solver of a family keeps the family colour."""
    import seaborn as sns

    from icl_bench.report import series

    rows = pd.DataFrame({"series": ["gd", "gd-lsa", "ols"], "solver": ["gd", "gd-lsa", "ols"], "series_rank": range(3)})
    st = series.series_styles(rows)
    blue, green = sns.color_palette("tab10", 10)[0], sns.color_palette("tab10", 10)[2]
    assert np.allclose(st["ols"]["color"], green)
    assert sum(st["gd"]["color"]) < sum(blue) < sum(st["gd-lsa"]["color"])


def test_each_heatmap_panel_is_on_its_own_colour_scale_centred_at_0():
    """weight_heatmaps: every panel's colour limits are ±(its largest |entry|), the |max| its title
    gives, so each map is on its own scale and 0 sits at the middle of the colour map."""
    from icl_bench.report import model_plots
    from icl_bench.solvers.transformer import Transformer, TransformerConfig

    torch.manual_seed(0)
    model = Transformer(TransformerConfig(n_layers=1, n_heads=1)).double()
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.randn_like(p) * 10.0 ** (i % 3 - 1))
    maps = model_plots.reduced_maps(model.weight_matrices())
    fig = model_plots.weight_heatmaps({"m": {"weights": model.weight_matrices()}})
    panels = {ax.get_title().split("  (")[0]: ax for ax in fig.axes if ax.axison and ax.images}
    assert set(panels) == set(maps)
    tops = set()
    for name, ax in panels.items():
        top = float(np.abs(maps[name]).max())
        lo, hi = ax.images[0].get_clim()
        assert (lo, hi) == (-top, top), name
        tops.add(round(top, 12))
    assert len(tops) > 1  # (the maps do differ in scale)


def test_probe_scatter_plots_each_statistic_against_its_own_closed_form():
    """probe_scatter: the first panel's x values are x - x_bar, the second's y - y_bar (per prompt,
    at the context tokens): each statistic against its own closed form, not one for both."""
    from icl_bench.prompts.generator import PromptSpec, sample_prompts
    from icl_bench.report import model_plots
    from icl_bench.solvers.ln_closed_form import build_construction

    tokens = sample_prompts(PromptSpec(N=8, noise=0.1, R=10.0), 16, seed=0, dtype="float64").tokens
    model = build_construction(10.0).to(torch.float64).eval()
    with torch.no_grad():
        models = {"c": {"weights": model.weight_matrices(), "trace": {"tokens": tokens, **model.probe(tokens)}}}
    fig = model_plots.probe_scatter(models)
    x, y = tokens[:, :-1, 0].double(), tokens[:, :-1, 1].double()
    for ax, v in zip(fig.axes[:2], (x, y)):
        want = (v - v.mean(1, keepdim=True)).reshape(-1).numpy()
        got = ax.collections[0].get_offsets()[:, 0]
        assert len(got) == want.size and np.allclose(np.sort(got), np.sort(want), rtol=0, atol=1e-12)


def test_a_flatten_readout_is_drawn_one_row_per_token():
    """weight_heatmaps: a flatten readout (one weight per token slot) is drawn as a (tokens x d_model)
    map, one row per token, not as a single long row."""
    from icl_bench.report import model_plots
    from icl_bench.solvers.transformer import Transformer, TransformerConfig

    model = Transformer(TransformerConfig(n_layers=1, n_heads=1, readout="flatten", N=4))
    d_model = model.weight_matrices()["embed.weight"].shape[0]
    fig = model_plots.weight_heatmaps({"m": {"weights": model.weight_matrices()}})
    (ax,) = [ax for ax in fig.axes if ax.axison and ax.get_title().startswith("readout  (")]
    assert ax.images[0].get_array().shape == (5, d_model)
