"""The scaffolding every result figure shares: panels, one legend, the note, the axis labels.

    make_panels(data, col, ..) a figure with one panel per value of a column
    finish(fig, panels, ..) axis labels, one legend for the figure, the title and the note, laid
                            out so that none is cut off
    flag_nan(data, metric)  series that answered NaN / inf on well-posed prompts, or whose mean error
                            overflowed to inf, say so in their label
    band_note(data)         what an error band is: the report's interval, over how many prompts
                            and seeds (icl_bench/report/aggregate.py), and that it under-covers
                            heavy-tailed errors (docs/report.md)
Used by plots.py (error and throughput plots); model_plots.py has its own layouts.
"""
from __future__ import annotations

import math

import pandas as pd
import seaborn as sns
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from icl_bench.report import style
from icl_bench.report.aggregate import failed_answers

MSE_OLS_LABEL = "MSE vs OLS prediction (y units²)"
LABELS = {
    "N": "context length N (examples)",
    "R": "embedding constant R (token units)",
    "steps": "GD steps K (= LSA layers)",
    "prompts_per_s": "throughput (prompts / s)",
}
LEGEND_ROOM = 2.2  # inches a figure keeps for its legend; a wider legend widens the figure


class PlotSkipped(Exception):
    """The runs hold no data for this plot; the message says what is missing."""


def fmt(v) -> str:
    """A grid value as a panel title or message shows it: floats by %g, NaN as "n/a"."""
    return "n/a" if isinstance(v, float) and math.isnan(v) else f"{v:g}" if isinstance(v, float) else str(v)


def make_panels(data: pd.DataFrame, col: str, col_title: str, width: float = 3.6, height: float = 3.6,
                sharey: bool = True, max_cols: int = 3) -> tuple[Figure, list]:
    """A figure with one panel per value of `col` (NaN last), at most max_cols per row:
    [(ax, rows of that value), ...]; unused grid cells are hidden."""
    sns.set_theme(style="whitegrid", context="paper")
    values = sorted(data[col].dropna().unique().tolist()) + ([math.nan] if data[col].isna().any() else [])
    nrows = math.ceil(len(values) / max_cols)
    ncols = math.ceil(len(values) / nrows)  # 4 panels: 2 x 2, not 3 + 1
    n_series = data["series"].nunique() if "series" in data else 0
    fig = Figure(figsize=(width * ncols + LEGEND_ROOM, max(height * nrows, 1.3 + 0.16 * n_series)))
    grid = fig.subplots(nrows, ncols, sharey=sharey, squeeze=False)
    for ax in grid.ravel()[len(values):]:
        ax.set_visible(False)
    out = []
    for ax, v in zip(grid.ravel(), values):
        rows = data[data[col].isna()] if isinstance(v, float) and math.isnan(v) else data[data[col] == v]
        ax.set_title(f"{col_title} = {fmt(v)}", parse_math=False)
        out.append((ax, rows))
    return fig, out


def finish(fig: Figure, panels: list, xlabel: str, ylabel: str, title: str, note: str,
            legend_title: str = "solver (colour: family)", extra=(), order=()) -> Figure:
    """Axis labels, one legend for the figure (every series once, in `order` (series names, e.g.
    series_styles' keys: by solver, then parameter values) where given, else in drawing order;
    then the `extra` (handle, label) pairs), the title and the note, laid out so that none is cut off."""
    ncols = fig.axes[0].get_gridspec().ncols
    for i, (ax, _) in enumerate(panels):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel if i % ncols == 0 else "")
    seen = {}
    for ax, _ in panels:  # every series once, in drawing order, from whichever panel has it
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    if order:  # drawing order put a series missing from the first panel after all of its series (a review)
        seen = dict(sorted(seen.items(), key=lambda item: _rank(item[0], order)))
    for h, lab in extra:
        seen.setdefault(lab, h)
    width, height = fig.get_size_inches()
    reserve = 0.1  # inches kept free at the right for the legend
    leg = None
    if seen:
        leg = fig.legend(list(seen.values()), list(seen), fontsize=7, title=legend_title, title_fontsize=7,
                         loc="center right")
        for t in leg.get_texts():  # a series label is text, never mathtext: a "$" in a parameter value
            t.set_parse_math(False)  # ("cost $5") garbled it, and an unpaired one crashed the layout (a review)
        box = leg.get_window_extent(FigureCanvasAgg(fig).get_renderer())
        reserve = box.width / fig.dpi + 0.2
        if reserve > LEGEND_ROOM:  # long labels ("gd steps=4 · d2.csv x→y"): widen, not squeeze the panels
            width += reserve - LEGEND_ROOM
    text, lines = style.wrap_note(note, width)
    foot = 0.14 * lines + 0.06  # inches the note takes at the bottom: added, so a long note never squeezes the panels
    height += foot
    fig.set_size_inches(width, height)
    if leg is not None:  # the legend stands between the title (0.35 in) and the note, the figure as tall as all need
        height = max(height, box.height / fig.dpi + foot + 0.45)
        fig.set_size_inches(width, height)
        leg.set_bbox_to_anchor((1 - 0.05 / width, (foot + (height - 0.35 - foot) / 2) / height), transform=fig.transFigure)
    fig.suptitle(style.wrap_note(title, width, fontsize=10)[0], fontsize=10, y=1 - 0.06 / height, va="top",
                 parse_math=False)
    fig.text(0.01, 0.01, text, fontsize=7, color="0.3", va="bottom", parse_math=False)
    fig.tight_layout(rect=(0, min(0.4, foot / height), 1 - reserve / width, 1), h_pad=0.6)
    return fig


def _rank(label: str, order) -> int:
    """Position in `order` of the series a legend label names: the label itself, or the series with
    a suffix ("gd steps=1 (= ...)", "ols (no steps)"); the longest such name; len(order) if none."""
    hits = [(len(s), i) for i, s in enumerate(order) if label == s or label.startswith(f"{s} (")]
    return max(hits)[1] if hits else len(order)


NAN_NOTE = ("NaN/inf on k of n well-posed: the solver answered NaN or inf on k of the n prompts with a least-squares answer "
            "at the points drawn; its line is the MSE over the other prompts only")
INF_NOTE = ("MSE off the scale at k of n points: a mean squared error of 1e300 or more there (inf where the squares "
            "overflowed float64: a diverging solver), which a log axis cannot hold, so those points are not drawn")
DRAW_MAX = 1e300  # means (and band ends) from here up are not drawn: near 1e303 the axis margins overflowed


def flag_nan(data: pd.DataFrame, metric: str | None = None) -> tuple[pd.DataFrame, str]:
    """`data` (summary rows) with " (NaN/inf on k of n well-posed)" appended to the series label of
    every series that answered NaN on well-posed prompts at its rows, k and n summed over them
    (aggregate.failed_answers, the headline's "(k of n NaN/inf)"): its MSE is over the finite answers
    only, so unflagged it could read as the best series. With `metric` (the error drawn), also
    " (MSE off the scale at k of n points)" for a series whose mean is DRAW_MAX or more (inf: it
    overflowed) at k of its n points (a diverging solver), and those means and band ends set to NaN:
    a log axis cannot draw them (near 1e303 its margins overflowed and publish crashed), and
    unflagged its worst points vanished. Returns (data, the notes that apply joined by "; ", or "");
    data unchanged without the counts (no n_prompts column: not a summary of aggregate.aggregate)."""
    if "n_prompts" not in data:
        return data, ""
    bad, of = failed_answers(data)
    sums = pd.DataFrame({"bad": bad, "of": of}).groupby(data["series"], sort=False).sum()
    labels = {s: [f"NaN/inf on {int(r.bad)} of {int(r.of)} well-posed"] for s, r in sums[sums["bad"] > 0].iterrows()}
    notes = [NAN_NOTE] if labels else []
    if metric is not None and metric in data:
        inf = data[metric].astype(float) >= DRAW_MAX
        per = pd.DataFrame({"inf": inf, "n": data[metric].notna()}).groupby(data["series"], sort=False).sum()
        for s, r in per[per["inf"] > 0].iterrows():
            labels.setdefault(s, []).append(f"MSE off the scale at {int(r.inf)} of {int(r.n)} points")
        notes += [INF_NOTE] if (per["inf"] > 0).any() else []
        ends = [c for c in (metric, f"{metric}_ci_low", f"{metric}_ci_high") if c in data]
        data = data.assign(**{c: data[c].astype(float).where(~(data[c].astype(float) >= DRAW_MAX)) for c in ends})
    if not labels:
        return data, ""
    flagged = {s: f"{s} ({'; '.join(v)})" for s, v in labels.items()}
    return data.assign(series=[flagged.get(s, s) for s in data["series"]]), "; ".join(notes)


def span(v) -> str:
    """'512' or '512–4096' for the values of a count column."""
    v = sorted({int(x) for x in v if x == x})
    return "?" if not v else f"{v[0]}" if len(v) == 1 else f"{v[0]}–{v[-1]}"


def band_note(data: pd.DataFrame) -> str:
    """What the bands are: the report's interval (aggregate.py) over how many prompts and prompt
    seeds per point. It was "95 % CI over prompts and seeds" with one seed per cell, and its
    coverage is measured, not assumed: about 0.6–0.8 for the heavy-tailed errors of the closed
    forms and trained models at 512 prompts (results/ci_coverage.md, found by a review)."""
    if "n_prompts" not in data or "n_seeds" not in data:
        return "band: nominal 95 % CI of the mean"
    if "failed" in data:  # (plots._drawn: a failed point has no prompts and no band)
        data = data[~data["failed"].astype(bool)]
    seeds = span(data["n_seeds"])
    return (f"band: nominal 95 % CI of the mean over the prompts of a point ({span(data['n_prompts'])} prompts, "
            f"{seeds} prompt seed{'' if seeds == '1' else 's'}; normal theory: it under-covers heavy-tailed errors, "
            "docs/report.md)")
