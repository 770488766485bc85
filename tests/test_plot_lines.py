"""What the error plots' lines claim (found by a review of publish): a point whose cells failed
is a gap, not a straight line from its neighbours; a series drawn over another on a grid within
the other's is marked as a twin; the legend keeps series order whatever panel a series starts in."""
import numpy as np
import pandas as pd
import pytest
from matplotlib.figure import Figure

from icl_bench import Param, Solver, get_solver, register_solver
from icl_bench.bench.config import parse_config
from icl_bench.bench.runner import run_matrix
from icl_bench.report import aggregate as report
from icl_bench.report import plots
from icl_bench.report.figure import finish
from icl_bench.solvers.registry import REGISTRY


class FailsAtN12(Solver):
    """OLS plus 0.1, except that it raises at N = 12: a failed point inside its line."""

    def predict(self, batch):
        if batch.x.shape[1] == 12:
            raise RuntimeError("boom at N=12")
        return batch.ols_prediction.to(batch.dtype) + 0.1


class FailsAtN5(Solver):
    """OLS plus 0.2, except that it raises at N = 5: a failed point at the start of its line."""

    def predict(self, batch):
        if batch.x.shape[1] == 5:
            raise RuntimeError("boom at N=5")
        return batch.ols_prediction.to(batch.dtype) + 0.2


class FailsAlways(Solver):
    """Raises on every prompt batch: a series with no ok point."""

    def predict(self, batch):
        raise RuntimeError("boom")


class GDFailsAtK2(Solver):
    """gd's answers, except at steps = 2, where every cell raises: a failed steps value inside its line.
    Its name sorts before gd, so it is listed first though it has fewer points."""
    params = {"steps": Param(1, "K")}

    def predict(self, batch):
        if self.values["steps"] == 2:
            raise RuntimeError("boom at K=2")
        return get_solver("gd", steps=self.values["steps"]).predict(batch)


RAW = {"seed": 0, "n_prompts": 32, "batch_size": 32, "timing": {"repeats": 1},
       "grid": {"N": [5, 12, 20], "noise": [0.1], "R": [100.0], "dtype": ["float64"], "device": ["cpu"]},
       "solvers": {"ols": {}, "gd": {"steps": [1, 2, 4, 8]}, "gd-lsa": {"steps": [1, 8]}, "test-mid-fails": {}, "test-first-fails": {}, "test-all-fails": {},
                   "a-gd-k2-fails": {"steps": [1, 2, 4, 8]}}}


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    register_solver("test-mid-fails")(FailsAtN12)
    register_solver("a-gd-k2-fails")(GDFailsAtK2)
    register_solver("test-first-fails")(FailsAtN5)
    register_solver("test-all-fails")(FailsAlways)
    try:
        out = tmp_path_factory.mktemp("run")
        run_matrix(parse_config(RAW), out, progress=False)
        table, _ = report.load_runs([out])
    finally:
        REGISTRY.unregister("test-mid-fails")
        REGISTRY.unregister("a-gd-k2-fails")
        REGISTRY.unregister("test-first-fails")
        REGISTRY.unregister("test-all-fails")
    summary = report.aggregate(table)
    return report.with_failed_points(summary, table), report.representative(table)


def _line(fig, label):
    """The line of series `label`, whatever twin suffix its label carries ("gd steps=8 (= ...)")."""
    return next(ln for ln in fig.axes[0].get_lines() if ln.get_label() == label or ln.get_label().startswith(f"{label} ("))


def test_a_failed_point_breaks_its_line_and_the_note_says_why(drawn):
    summary, setting = drawn
    fig = plots.mse_vs_n(summary, setting)
    x, y = (np.asarray(v, dtype=float) for v in _line(fig, "test-mid-fails").get_data())
    assert list(x) == [5.0, 12.0, 20.0] and np.isfinite(y[[0, 2]]).all() and np.isnan(y[1])  # a gap at N = 12
    note = " ".join(fig.texts[-1].get_text().split())
    assert "a gap in a line: every cell of that point errored or was skipped (failures.md)" in note
    assert "(32 prompts, 1 prompt seed;" in note  # the failed point counts no prompts
    assert not np.isnan(np.asarray(_line(fig, "gd steps=8").get_ydata(), dtype=float)).any()  # (ols: on the floor line)
    with pytest.raises(plots.PlotSkipped, match="no ok cell with a finite mean"):  # failed rows alone are no data
        plots.mse_vs_n(summary[summary["failed"]], setting)


def test_failed_points_no_line_shows_are_named_in_the_note(drawn):
    """A series that failed at its first x, or everywhere, has no gap to draw: it vanished from the
    figure and the legend with nothing said (a review). The note names those points."""
    summary, setting = drawn
    fig = plots.mse_vs_n(summary, setting)
    labels = [ln.get_label() for ln in fig.axes[0].get_lines()]
    x, _ = (np.asarray(v, dtype=float) for v in _line(fig, "test-first-fails").get_data())
    assert list(x) == [12.0, 20.0] and "test-all-fails" not in labels
    note = " ".join(fig.texts[-1].get_text().split())
    assert ("not drawn, every cell errored or was skipped (failures.md): a-gd-k2-fails steps=2 (no ok point in "
            "this figure); test-all-fails (no ok point in this figure); test-first-fails at N = 5") in note, note
    assert "test-mid-fails at" not in note  # its failed point is a gap inside its line, said so already
    clean = summary[~summary["series"].isin(["test-first-fails", "test-all-fails", "a-gd-k2-fails steps=2"])]
    assert "not drawn" not in " ".join(plots.mse_vs_n(clean, setting).texts[-1].get_text().split())


def test_a_series_on_a_grid_within_anothers_is_a_twin(drawn):
    summary, setting = drawn
    fig = plots.gd_steps(summary, setting)
    labels = [ln.get_label() for ln in fig.axes[0].get_lines()]
    assert "gd-lsa (= gd)" in labels, labels  # steps 1, 8 within gd's 1, 2, 4, 8: drawn on top, open markers
    assert "gd-lsa coincides with gd" in " ".join(fig.texts[-1].get_text().split())


def test_the_legend_follows_the_given_order_not_the_first_panel():
    fig = Figure()
    a, b = fig.subplots(1, 2)
    b.plot([1, 2], [1, 2], label="a-first (= x)")
    a.plot([1, 2], [1, 2], label="b-second")
    b.plot([1, 2], [2, 3], label="ab")
    finish(fig, [(a, None), (b, None)], "x", "y", "t", "", order=["a-first", "ab", "b-second"])
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["a-first (= x)", "ab", "b-second"]


def test_a_steps_value_failed_everywhere_breaks_the_gd_steps_line_and_the_partial_series_is_the_twin(drawn):
    """'flaky steps=2' failed in every cell, so no failed row was added for it and gd_steps drew its
    solver's line straight through K = 2; and gd, complete, was drawn as the twin of the series that
    failed there (a review). The series with fewer points is the twin, and the note says 'where both'."""
    summary, setting = drawn
    fig = plots.gd_steps(summary, setting)
    line = _line(fig, "a-gd-k2-fails (= gd)")
    x, y = (np.asarray(v, dtype=float) for v in line.get_data())
    assert list(x) == [1.0, 2.0, 4.0, 8.0] and np.isnan(y[1]) and np.isfinite(y[[0, 2, 3]]).all()
    note = " ".join(fig.texts[-1].get_text().split())
    assert "a-gd-k2-fails coincides with gd where both have a value (equal; open markers on top)" in note
    assert "a gap in a line" in note


def test_a_note_of_wide_glyphs_is_wrapped_within_the_figure():
    """Lines of a coinciding-series note ('mode=b (= NoDoc k=1 mode=a)') ran past the figure's right
    edge and were cut off: the wrap width came from an average glyph width (a plugin author's
    review). Every line is now measured in the font."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextToPath

    from icl_bench.report.style import wrap_note

    note = "NoDoc k=1 mode=b coincides with NoDoc k=1 mode=a (equal; open markers on top); " * 12
    text, n = wrap_note(note, 8.0)
    widths = [TextToPath().get_text_width_height_descent(ln, FontProperties(size=7), ismath=False)[0]
              for ln in text.split("\n")]
    assert n == len(widths) > 1 and max(widths) <= (8.0 - 0.2) * 72
    assert " ".join(text.split()) == " ".join(note.split())  # nothing lost


def test_two_series_of_one_setting_written_two_ways_are_named_in_a_note():
    """`gd` from a config that left steps out and `gd steps=16` (its default) from one that wrote
    it are two series of equal numbers; the report says they are one setting (a review)."""
    from icl_bench.report.series import add_series, same_setting_notes

    table = pd.DataFrame({"solver": ["gd", "gd", "gd", "ols"],
                          "solver_params": ["{}", '{"steps": 16}', '{"steps": 4}', "{}"]})
    labelled = add_series(table)
    assert labelled.series.tolist() == ["gd", "gd steps=16", "gd steps=4", "ols"]
    assert same_setting_notes(labelled) == [
        "gd and gd steps=16 are one setting of gd (parameters left out take their declared defaults): runs that wrote "
        "a default and runs that left it out are shown apart"]
    assert same_setting_notes(add_series(table.iloc[[0, 2, 3]])) == []  # other settings: no note
    plugin = pd.DataFrame({"solver": ["not-installed"] * 2, "solver_params": ["{}", '{"k": 1}']})
    assert same_setting_notes(add_series(plugin)) == []  # defaults unknown here


def test_same_setting_notes_compare_rows_of_the_same_code_and_input_files_only():
    """models_dir = "m" in one folder and an absolute path to another "m" (other checkpoints), or a
    default changed in the code between two runs, were called one setting (a review)."""
    from icl_bench.report.series import add_series, same_setting_notes

    table = pd.DataFrame({"solver": ["gd", "gd"], "solver_params": ["{}", '{"steps": 16}'],
                          "code_sha256": ["a", "b"], "inputs_sha256": ["", ""]})
    assert same_setting_notes(add_series(table)) == []
    table = table.assign(code_sha256="a", inputs_sha256=["x", "y"])
    assert same_setting_notes(add_series(table)) == []
    assert len(same_setting_notes(add_series(table.assign(inputs_sha256="x")))) == 1


def _plot_summary(points):
    """Summary rows (aggregate.aggregate's columns) for (series, solver, rank, N, noise, R, mean)."""
    rows = []
    for series, solver, rank, n, noise, r, m in points:
        rows.append({"solver": solver, "solver_params": "{}", "N": n, "noise": noise, "R": r, "dtype": "float64",
                     "device": "cpu", "d": 1, "ood": "none", "prompts": "", "series": series, "series_rank": rank,
                     "n_seeds": 1, "n_prompts": 64, "mse_vs_ols": m, "mse_vs_ols_ci_low": m / 2,
                     "mse_vs_ols_ci_high": m * 2})
    return pd.DataFrame(rows)


_SETTING = {"N": 10, "noise": 0.1, "R": 10.0, "dtype": "float64", "device": "cpu", "d": 1, "ood": "none"}


def test_error_panels_put_a_nan_noise_last_and_label_only_the_first_columns_y_axis():
    """mse_vs_n: one panel per noise, a NaN noise (CSV prompts) as the last panel "noise σ = n/a" (not
    dropped), the y label on the first column only, the line at its means."""
    from icl_bench.report import plots

    s = _plot_summary([("gd", "gd", 0, n, noise, 10.0, n * 1e-3) for n in (10, 20) for noise in (0.1, float("nan"))])
    fig = plots.mse_vs_n(s, _SETTING)
    assert [ax.get_title() for ax in fig.axes] == ["noise σ = 0.1", "noise σ = n/a"]
    assert fig.axes[0].get_ylabel() != "" and fig.axes[1].get_ylabel() == ""
    (gd,) = fig.axes[1].get_lines()
    np.testing.assert_allclose(gd.get_xdata(), [10, 20])
    np.testing.assert_allclose(gd.get_ydata(), [0.01, 0.02])


def test_error_lines_are_drawn_in_series_order():
    """mse_vs_n draws its lines in series order (series_rank: ols before gd here), not by name, so
    the z-order matches the legend."""
    from icl_bench.report import plots

    s = _plot_summary([(name, name, k, n, 0.1, 10.0, (k + 1) * n * 1e-3) for k, name in enumerate(["ols", "gd"])
                  for n in (10, 20)])
    (ax,) = plots.mse_vs_n(s, _SETTING).axes
    assert [ln.get_label() for ln in ax.get_lines()] == ["ols", "gd"]


def test_twins_are_found_across_a_nan_noise_panel():
    """Two series with panels at noise 0.1 and NaN (generated and CSV prompts in one figure): the twin
    check compares them point by point (it raised a TypeError under pandas 3, whose astype(str) keeps
    NaN, so sorting the keys compared "0.1" with nan) and mse_vs_n draws both."""
    from icl_bench.report import style

    s = _plot_summary([(name, name, k, n, noise, 10.0, n * 1e-3) for k, name in enumerate(["gd", "ols"])
                       for n in (10, 20) for noise in (0.1, float("nan"))])
    assert style.identical_series(s, ["noise", "N"], "mse_vs_ols") == {"ols": ("gd", 0.0, False)}
    fig = plots.mse_vs_n(s, _SETTING)
    assert [ax.get_title() for ax in fig.axes] == ["noise σ = 0.1", "noise σ = n/a"]
