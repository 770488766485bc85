"""Report: runs of one grid with different prompt sources (two CSV files, two [prompts] tables) are
different series. They shared one label: the headline showed one source's numbers for both
(pivot_table's "first") with no note, mse_vs_n drew one line zig-zagging between them and the
scaling table fitted one of them. Tiny real runs (16 prompts per cell) shared by the module."""
import json

import numpy as np
import pandas as pd
import pytest

from icl_bench.bench.config import parse_config
from icl_bench.bench.runner import run_matrix
from icl_bench.report import aggregate as report
from icl_bench.report import coverage, mechanism, plots, scaling, series
from icl_bench.report.sources import source_labels

GRID = {"N": [4, 8], "R": [100.0], "dtype": ["float64"], "device": ["cpu"]}
BASE = {"seed": 0, "n_prompts": 16, "batch_size": 16, "timing": {"repeats": 1}, "solvers": {"gd": {"steps": [4]}}}


def _csv(path, scale: float, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, scale, 200)
    pd.DataFrame({"x": x, "y": 0.5 * x + rng.normal(0.0, 0.1, 200)}).to_csv(path, index=False)
    return path


@pytest.fixture(scope="module")
def csv_runs(tmp_path_factory):
    """gd steps=4 on a.csv (x ~ N(0, 1)) and on b.csv (x ~ N(0, 5): far larger errors), one grid."""
    root = tmp_path_factory.mktemp("sources")
    runs = []
    for name, scale in (("a", 1.0), ("b", 5.0)):
        data = _csv(root / f"{name}.csv", scale, seed=len(runs))
        raw = {**BASE, "grid": GRID, "data": {"path": str(data), "x": "x", "y": "y"}}
        out = root / f"run_{name}"
        run_matrix(parse_config(raw), out, progress=False)
        runs.append(out)
    return runs


def _own(run) -> pd.Series:
    """One run's MSE vs OLS by N, aggregated alone."""
    table, _ = report.load_runs([run])
    return report.aggregate(table).set_index("N")["mse_vs_ols"]


def test_each_csv_source_is_its_own_series_in_headline_plot_and_scaling(csv_runs):
    a, b = csv_runs
    table, _ = report.load_runs(csv_runs)
    summary = report.aggregate(table)
    setting = report.representative(table)
    labels = ["gd steps=4 · a.csv x→y", "gd steps=4 · b.csv x→y"]
    assert report.series_order(summary) == labels  # in the order the runs were given
    head = report.headline(summary, setting, table).set_index("series")
    assert head.index.tolist() == labels
    for label, run in zip(labels, csv_runs):
        own = _own(run)
        for n in GRID["N"]:  # each row holds its own source's numbers, not the first source's
            assert head.loc[label, f"N={n}"].startswith(f"{own[n]:.3g} ["), (label, n, head.loc[label, f"N={n}"])
    assert coverage.left_out(table, setting) == []  # both are shown: nothing to note
    fig = plots.mse_vs_n(summary, setting)
    (ax,) = [x for x in fig.axes if x.get_visible()]
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert sorted(lines) == labels  # two lines, not one "gd steps=4" line through both sources
    for label, run in zip(labels, csv_runs):
        np.testing.assert_allclose(lines[label].get_ydata(), _own(run).reindex(GRID["N"]), rtol=1e-12)
    fits = scaling.scaling_table(summary)
    assert sorted(fits.loc[fits["vs"] == "N", "series"]) == labels
    at = scaling.scaling_at(fits, setting, report.series_order(summary))
    assert at["series"].tolist() == labels


def test_one_source_keeps_the_plain_labels(csv_runs):
    table, _ = report.load_runs(csv_runs[:1])
    assert set(table["series"]) == {"gd steps=4"}  # (steps: off its default, 16)
    t = pd.DataFrame({"solver": ["gd", "gd", "ols"], "solver_params": ['{"steps": 1}', '{"steps": 4}', "{}"],
                      "prompts": ['{"x": 1}'] * 3})
    assert report.add_series(t)["series"].tolist() == ["gd steps=1", "gd steps=4", "ols"]


def test_a_lone_csv_source_is_named_in_the_headline_heading(csv_runs, tmp_path):
    """A --data run's report never said its prompts came from a CSV file: with one source the labels
    name none, and the heading named only "noise = n/a" (found by a review)."""
    from icl_bench.cli import main
    from icl_bench.report.sources import lone_source_label

    assert main(["publish", str(csv_runs[0]), "--out", str(tmp_path / "pub")]) == 0
    heading = (tmp_path / "pub" / "headline.md").read_text().splitlines()[0]
    assert heading.endswith(", prompts = a.csv x→y)"), heading
    assert "prompts = a.csv x→y" in (tmp_path / "pub" / "index.html").read_text()
    # and, as CSV prompts have no truth, the held-out error vs the query's y from the rows (a review)
    md = (tmp_path / "pub" / "headline.md").read_text()
    assert "#### Mean squared error vs the query row's observed y by solver and N" in md
    rows = pd.read_parquet(csv_runs[0] / "results.parquet")
    table, _ = report.load_runs(csv_runs[:1])
    summary = report.aggregate(table)
    target = report.headline(summary, report.representative(table), table, stat="target").set_index("series")
    for n in GRID["N"]:
        ok = rows[(rows.N == n) & (rows.status == "ok") & (rows.dtype == report.representative(table)["dtype"])]
        want = (ok.mse_vs_target * ok.n_prompts).sum() / ok.n_prompts.sum()
        assert target.loc["gd steps=4", f"N={n}"] == f"{want:.3g}" and f"{want:.3g}" in md
    table, _ = report.load_runs(csv_runs[:1])  # the figures name it too: a PNG used alone said "noise σ = n/a" (a tryout)
    fig = plots.mse_vs_n(report.aggregate(table), report.representative(table))
    assert fig._suptitle.get_text().replace("\n", " ").endswith(", prompts = a.csv x→y)"), fig._suptitle.get_text()
    both, _ = report.load_runs(csv_runs)  # two sources: the series labels name them, the title does not
    assert "prompts =" not in plots.mse_vs_n(report.aggregate(both), report.representative(both))._suptitle.get_text()
    assert lone_source_label(['{"x": {"dist": "normal", "loc": 0.0, "scale": 5.0}}']) == "x=normal(0, 5)"
    assert lone_source_label(['{"x": {"dist": "normal", "loc": 0.0, "scale": 1.0}}']) == ""  # the default: unnamed
    assert lone_source_label(["", ""]) == "" and lone_source_label(['{"csv": {}}', '{"x": {}}']) == ""


def test_source_labels_name_what_tells_sources_apart():
    def dists(x_scale=1.0, slope_loc=0.0):
        d = {"dist": "normal", "loc": 0.0, "scale": 1.0}
        return json.dumps({"intercept": d, "slope": {**d, "loc": slope_loc}, "x": {**d, "scale": x_scale}},
                          sort_keys=True)

    def csv(path, x="x", y="y"):
        return json.dumps({"csv": {"path": path, "x": x, "y": y}}, sort_keys=True)

    assert source_labels([dists()]) == {dists(): ""}  # one source: nothing to tell apart
    assert source_labels([dists(), dists(5.0)]) == {dists(): "x=normal(0, 1)", dists(5.0): "x=normal(0, 5)"}
    got = source_labels([dists(), dists(5.0, 2.0)])
    assert got[dists(5.0, 2.0)] == "x=normal(0, 5) slope=normal(2, 1)"
    uniform = json.dumps({**json.loads(dists()), "x": {"dist": "uniform", "loc": -1.0, "scale": 2.0}},
                         sort_keys=True)  # U[loc, loc + scale]
    assert source_labels([dists(), uniform])[uniform] == "x=uniform[-1, 1]"
    # a file name shared by two folders: the paths; other columns of one file: the columns
    got = source_labels([csv("/a/d.csv"), csv("/b/d.csv"), csv("/a/d.csv", y="z"), csv("/c/e.csv")])
    assert list(got.values()) == ["/a/d.csv x→y", "/b/d.csv x→y", "d.csv x→z", "e.csv x→y"]
    # a [prompts] table beside a CSV file; a run from before the prompts column
    got = source_labels([csv("d.csv"), dists(), dists(5.0), ""])
    assert list(got.values()) == ["d.csv x→y", "x=normal(0, 1)", "x=normal(0, 5)", "prompts not recorded"]
    assert source_labels([csv("d.csv"), dists()])[dists()] == "default [prompts]"
    assert source_labels([csv("d.csv"), dists(5.0)])[dists(5.0)] == "x=normal(0, 5)"
    assert len(set(source_labels(["{not json", "[1, 2]", "", dists()]).values())) == 4  # always distinct


def test_series_rank_by_solver_then_parameters_then_source():
    t = pd.DataFrame({"solver": ["ols", "gd", "gd", "gd", "gd", "ols"],
                      "solver_params": ["{}", '{"steps": 16}', '{"steps": 4}', '{"steps": 16}', '{"steps": 4}', "{}"],
                      "prompts": ['{"q": 2}', '{"q": 2}', '{"q": 2}', '{"q": 1}', '{"q": 1}', '{"q": 1}']})
    s = report.add_series(t)
    assert report.series_order(s) == ["gd steps=4 · q=2", "gd steps=4 · q=1", "gd steps=16 · q=2",
                                      "gd steps=16 · q=1", "ols · q=2", "ols · q=1"]
    assert s.groupby("series")["series_rank"].nunique().eq(1).all() and s["series_rank"].nunique() == 6


def test_styles_keep_a_marker_per_parameter_set_and_a_line_style_per_source():
    rows = pd.DataFrame({"solver": ["gd"] * 4, "solver_params": ['{"steps": 1}', '{"steps": 1}', '{"steps": 4}',
                                                                 '{"steps": 4}'],
                         "prompts": ["A", "B", "A", "B"]})
    st = series.series_styles(report.add_series(rows))
    one_a, one_b, four_a, four_b = (st[s] for s in report.series_order(report.add_series(rows)))
    assert one_a["marker"] == one_b["marker"] != four_a["marker"] == four_b["marker"]  # steps=1 circle on both
    assert one_a["linestyle"] == four_a["linestyle"] != one_b["linestyle"] == four_b["linestyle"]


def test_a_long_legend_widens_the_figure_and_stays_off_the_note():
    n = 14
    path = '{{"csv": {{"path": "/data/a-rather-long-file-name-{}.csv", "x": "x", "y": "y"}}}}'
    summary = pd.DataFrame([{"solver": "", "solver_params": "{}", "prompts": path.format(i), "N": N, "noise": 0.1,
                             "R": 100.0, "dtype": "float64", "device": "cpu", "d": 1, "ood": "none",
                             "mse_vs_ols": (i + 1) * N, "mse_vs_ols_ci_low": 0.5, "mse_vs_ols_ci_high": 2e3}
                            for i in range(n) for N in (4, 8)])
    summary["solver"] = [f"solver-with-a-long-name-{i % 2}" for i in range(n) for _ in (4, 8)]
    summary = report.add_series(summary)
    setting = {"N": 4, "noise": 0.1, "R": 100.0, "dtype": "float64", "device": "cpu", "d": 1, "ood": "none"}
    fig = plots.mse_vs_n(summary, setting)
    renderer = fig.canvas.get_renderer()
    (ax,) = [x for x in fig.axes if x.get_visible()]
    assert ax.get_window_extent(renderer).width / fig.dpi > 2.5  # the panel is not squeezed by the legend
    legend = fig.legends[0].get_window_extent(renderer)
    note = fig.texts[-1].get_window_extent(renderer)
    title = fig._suptitle.get_window_extent(renderer)
    assert legend.y0 >= note.y1 and legend.y1 <= title.y0 and legend.x1 <= fig.bbox.x1


def test_mechanism_compares_with_gd_on_the_same_prompt_source():
    rows = []
    for src, gd_errs in (("A", (0.1, 4.0, 2.0)), ("B", (0.1, 400.0, 200.0))):
        for solver, errs in (("gd", gd_errs), ("trained-l1", (0.1, 3.0, 2.5))):
            for ood, e in zip(("none", "x_shift=5", "x_scale=10"), errs):
                rows.append({"solver": solver, "solver_params": '{"steps": 4}' if solver == "gd" else "{}",
                             "prompts": src, "ood": ood, "status": "ok", "mse_vs_ols": e, "rel_mse_vs_ols": e})
    got = mechanism.section(report.add_series(pd.DataFrame(rows)))["table"].set_index("series")
    assert got.loc["trained-l1 · A", "verdict"] == "GD-like"
    assert "gd steps=4 · A" in got.loc["trained-l1 · A", "why"]
    assert got.loc["trained-l1 · B", "verdict"] == "neither"  # 100 times below gd on B: not GD-like


def test_one_csv_path_with_other_bytes_is_two_series(tmp_path):
    """The CSV was edited between two runs of other seeds: the same `prompts` JSON, other data.
    Same-seed repeats were refused, but other seeds were pooled as one sample of one source."""
    runs = []
    for seed, scale in ((0, 1.0), (1, 5.0)):
        data = _csv(tmp_path / "d.csv", scale, seed=seed)  # rewritten in place
        raw = {**BASE, "seed": seed, "grid": GRID, "data": {"path": str(data), "x": "x", "y": "y"}}
        run_matrix(parse_config(raw), tmp_path / f"run{seed}", progress=False)
        runs.append(tmp_path / f"run{seed}")
    table, _ = report.load_runs(runs)
    sha = [pd.read_parquet(r / "results.parquet").data_sha256.iloc[0][:8] for r in runs]
    summary = report.aggregate(table)
    assert report.series_order(summary) == [f"gd steps=4 · data sha256 {h}" for h in sha]
    assert (summary.n_seeds == 1).all()  # each series holds its own run: never the two pooled
    for h, run in zip(sha, runs):  # and its own throughput (the median was over both runs' rows)
        own = pd.read_parquet(run / "results.parquet").groupby("N").prompts_per_s.median()
        mine = summary[summary.series == f"gd steps=4 · data sha256 {h}"].set_index("N").prompts_per_s
        np.testing.assert_allclose(mine.sort_index(), own.sort_index())
    same, _ = report.load_runs([runs[0], runs[0]])  # one file's bytes twice: one series, no label
    assert set(report.aggregate(same).series) == {"gd steps=4"}


def test_the_ill_posed_note_names_each_source():
    """The note gave one count per N, the largest over every series: 12 of 32 for d.csv hid that
    f.csv had 12 of 16 (found by an adversarial review)."""
    d, f = (json.dumps({"csv": {"path": p, "x": "x", "y": "y"}}) for p in ("d.csv", "f.csv"))
    at = {"noise": float("nan"), "R": 100.0, "dtype": "float64", "device": "cpu", "d": 1, "ood": "none"}
    summary = pd.DataFrame([{**at, "N": 3, "prompts": p, "n_prompts": n, "n_ill_posed": 12} for p, n in ((d, 32), (f, 16))])
    (note,) = report.ill_posed_note(summary, {**at, "N": 3})
    assert note.endswith("at N=3: 12 of 32 (d.csv x→y), N=3: 12 of 16 (f.csv x→y)"), note
