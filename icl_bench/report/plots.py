"""Result plots (seaborn on matplotlib): error vs N, error vs R, GD steps, throughput.

Every function takes the tables of `icl_bench.report.aggregate` and returns a matplotlib Figure (the caller
saves and closes it), or raises `PlotSkipped` with the reason when the runs hold no data for it.
One line (or, for throughput, one dot per dtype) per series, where a series is a solver plus the parameters
that tell it apart (report.add_series), styled by icl_bench/report/style.py (colour = family, marker =
parameter set, series that coincide overlaid and named). Error plots draw the mean with its 95 % CI
as a band. An axis is logarithmic when its positive values span more than two decades (one decade for
N and R). In mse_vs_n and mse_vs_r a mean at or below the float floor of its dtype (rounding, 0
included: ols at 1e-31 in float64) is drawn on a marked floor line at the bottom of its panel,
not at its value, the axis above spanning the values above the floor, each dtype's panels on their
own y range (style.floor_layout); gd_steps does the same for its lines and its level lines (one
dtype per figure). A note under the figure says so.
"""
from __future__ import annotations

import json
import numbers

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from icl_bench.report import style
from icl_bench.report.figure import (INF_NOTE, LABELS, MSE_OLS_LABEL, NAN_NOTE, PlotSkipped, band_note, finish, flag_nan,
                                     make_panels)
from icl_bench.report.aggregate import select
from icl_bench.report.plot_gaps import GAP_NOTE, check_varied, gaps, joined, level_outside, varied_elsewhere
from icl_bench.report.series import series_order, series_styles
from icl_bench.report.coverage import setting_words, varied_axes
from icl_bench.report.load import shared_timing
from icl_bench.solvers.registry import get_solver_class

def _mean_ci_lines(data: pd.DataFrame, x: str, col: str, col_title: str, metric: str, ylabel: str,
                   title: str) -> Figure:
    """Panels by `col`, one line per series of metric (mean) vs x with its 95 % CI band; a series
    that answered NaN on well-posed prompts says so in its label (_flag_nan).

    On a log axis a mean at or below the float floor of its dtype (rounding, not method error:
    0 included) is drawn on a dashed floor line at the bottom of its panel as style.FLOOR_MARKER
    (style.floor_layout), a band reaching the floor ends on that line, and the panels of one
    floor (dtype) share a y range of their own: float64 ols at 1e-31 squeezed every other series of
    both dtypes into the top tenth of the panels (found by a new-user tryout). The note names
    the series on the floor line and how many of their points are there. Failed points inside a
    line (plots._drawn) break it."""
    data, outside = gaps(data, x, col)
    data, nan_note = flag_nan(data, metric)
    fig, panels = make_panels(data, col, col_title, sharey=False)
    styles = series_styles(data)
    twins = style.identical_series(data, [col, x], metric)
    panels = [(ax, style.against_floor(d, x, metric)) for ax, d in panels]
    key = {id(ax): tuple(sorted(set(d["_floor"]))) for ax, d in panels}  # panels of one floor share a range
    low = {id(ax): bool(d["_at"].any() or (d["_lo"] <= d["_floor"]).any()) for ax, d in panels}
    log_y = any(low.values()) or style.spans(np.concatenate([style.above_floor(d) for _, d in panels]), 2)
    layouts = {}
    for k in dict.fromkeys(key.values()):
        mine = [d for ax, d in panels if key[id(ax)] == k]
        strip = any(low[id(ax)] for ax, _ in panels if key[id(ax)] == k)
        layouts[k] = style.floor_layout(np.concatenate([style.above_floor(d) for d in mine]), min(k) if strip else None)
    counts, floored, broken = {}, False, False  # counts: series -> [points on the floor line, points drawn]
    for ax, d in panels:
        lay = layouts[key[id(ax)]] if log_y else None
        if any(low.values()):
            ax.margins(x=0.09)  # room for floor markers set beside the first and last x (in every panel: aligned)
        line = lay["line"] if lay else None
        if line is not None:
            style.onto_floor(d, line)
        style.draw_means(ax, d, x, metric, styles, twins, counts)
        if line is not None:
            style.floor_markers(ax, d, x, styles, line)
            floored, broken = True, broken or lay["cut"] is not None
        if log_y:
            floors = sorted(set(d["_floor"]))
            style.error_axis(ax, lay, f"≤{floors[0]:.2g}" if len(floors) == 1 else "≤ float floor", style.above_floor(d))
        style.grid_axis(ax, data[x], style.spans(data[x], 1))
    if not log_y:  # a linear axis: the panels of one dtype share one range, as the log ones do
        for k in set(key.values()):
            axes = [ax for ax, _ in panels if key[id(ax)] == k]
            lims = [ax.get_ylim() for ax in axes]
            for ax in axes:
                ax.set_ylim(min(lo for lo, _ in lims), max(hi for _, hi in lims))
    note = band_note(data)
    if floored:
        at = {s: n for s, n in counts.items() if n[0]}
        note += "; " + style.floor_note(pd.concat([d for _, d in panels]), metric, at, broken)
    if len(set(key.values())) > 1:
        note += "; y range per dtype"
    if twins:
        note += "; " + style.twins_note(twins)
    if nan_note:
        note += "; " + nan_note
    note += GAP_NOTE if "failed" in data and data["failed"].any() else ""
    note += f"; {outside}" if outside else ""
    extra = style.floor_legend() if floored else []
    return finish(fig, panels, LABELS.get(x, x), ylabel, title, note, extra=extra, order=list(styles))


def _drawn(summary: pd.DataFrame, setting: dict, axes) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(rows at `setting`, those of ok cells): `summary` may carry aggregate.with_failed_points'
    rows (failed = True), which break a series' line where its cells failed but are not data."""
    d = select(summary, setting, axes)
    return d, (d[~d["failed"].astype(bool)] if "failed" in d else d)


def _finite(ok: pd.DataFrame, metric: str = "mse_vs_ols") -> bool:
    """Whether any ok row has a finite mean of `metric`: without one a plot is an empty frame (a
    solver that answered NaN everywhere, or whose error overflowed)."""
    return bool(np.isfinite(ok[metric].astype(float)).any()) if metric in ok else False


def mse_vs_n(summary: pd.DataFrame, setting: dict) -> Figure:
    """MSE vs OLS against N, one line per series, one panel per noise; R, dtype, device, d and ood
    fixed at `setting` (report.representative; d and ood named in the title when the summary has
    other values of them). Raises PlotSkipped without ok cells there, or when N took one value."""
    axes = ("R", "dtype", "device", "d", "ood")
    d, ok = _drawn(summary, setting, axes)
    if not _finite(ok):
        raise PlotSkipped(f"mse_vs_n: no ok cell with a finite mean MSE at {setting_words(setting, axes, summary)}")
    check_varied(ok, "N", "mse_vs_n", d, varied_elsewhere(summary, setting, axes, "N"))
    return _mean_ci_lines(d, "N", "noise", "noise σ", "mse_vs_ols", MSE_OLS_LABEL,
                          f"Error vs context length ({setting_words(setting, axes, summary)})")


def mse_vs_r(summary: pd.DataFrame, setting: dict) -> Figure:
    """MSE vs OLS against R, one line per series, one panel per dtype (ln-closed-form's O(1/R^4)
    fall, and in float32 the rounding floor of its U-curve where the R grid reaches past ~1e3; the
    default grid R = 10, 100, 1000 stops at the minimum); N, noise, device, d, ood fixed at
    `setting`. Raises PlotSkipped without ok cells there, or when R took one value."""
    axes = ("N", "noise", "device", "d", "ood")
    d, ok = _drawn(summary, setting, axes)
    if not _finite(ok):
        raise PlotSkipped(f"mse_vs_r: no ok cell with a finite mean MSE at {setting_words(setting, axes, summary)}")
    check_varied(ok, "R", "mse_vs_r", d, varied_elsewhere(summary, setting, axes, "R"))
    return _mean_ci_lines(d, "R", "dtype", "dtype", "mse_vs_ols", MSE_OLS_LABEL,
                          f"Error vs embedding constant R ({setting_words(setting, axes, summary)})")


def _steps(solver: str, params: str):
    """The `steps` a series ran: its parameter, else the default of a solver that declares one
    (a solver left at its default records no parameters); None for a solver without steps or one
    this process cannot load."""
    d = json.loads(params) if params else {}
    if isinstance(d, dict) and "steps" in d:
        k = d["steps"]
    else:
        try:
            declared = get_solver_class(solver).params.get("steps")
        except Exception:  # a plugin not installed where the report is made: drawn as a level line
            return None
        k = declared.default if declared is not None else None
    return k if isinstance(k, numbers.Real) and not isinstance(k, bool) else None  # "auto", True: no point on K


def gd_steps(summary: pd.DataFrame, setting: dict) -> Figure:
    """MSE vs OLS against the `steps` parameter (gd-lsa, gd, or any solver that has one), one
    line per such solver (and its other parameters), beside every solver without `steps` as a
    horizontal line (the closed forms); one panel per N; noise, R, dtype, device fixed. A mean at
    or below the float floor is drawn on a floor line (style.floor_layout), as in mse_vs_n: float32
    ols at 1e-14 squeezed every other line into the top half of the panels.
    Raises PlotSkipped when no solver in the runs has a `steps` parameter, or when steps took a
    single value per solver (the message says which)."""
    axes = ("noise", "R", "dtype", "device", "d", "ood")
    d = _drawn(summary, setting, axes)[0].copy()
    d["steps"] = [_steps(s, p) for s, p in zip(d["solver"], d["solver_params"])]
    stepped = d[d["steps"].notna()].copy()
    ok = _drawn(stepped, {}, ())[1]  # (its failed rows break lines but are not data)
    if ok.empty:
        raise PlotSkipped(f"gd_steps: no solver in the runs set a `steps` parameter (e.g. [solvers.gd-lsa] steps = "
                          f"[1, 4, 16]) with ok cells at {setting_words(setting, axes, summary)}")
    if not _finite(ok):  # (it said no solver set `steps` of a gd that did, every mean overflowed: a review)
        raise PlotSkipped(f"gd_steps: no ok cell of a solver with `steps` ({', '.join(sorted(set(ok['solver'])))}) has a "
                          f"finite mean MSE at {setting_words(setting, axes, summary)}")
    stepped["steps"] = stepped["steps"].astype(float)
    ok = ok.astype({"steps": float})
    varied = ok.groupby("solver")["steps"].nunique()
    if varied.max() < 2:
        ran = ", ".join(f"{s} steps={int(v):d}" for s, v in ok.groupby("solver")["steps"].first().items())
        raise PlotSkipped(f"gd_steps: steps did not vary ({ran}); add a list of steps to the config to draw it")
    # one line per solver and its parameters other than steps
    stepped["series"] = [" ".join(w for w in s.split() if not w.startswith("steps=")) for s in stepped["series"]]
    stepped["series_rank"] = stepped.groupby("series")["series_rank"].transform("min")
    stepped, outside = gaps(stepped, "steps", "N")  # per line drawn: a solver over its steps
    stepped, nan_note = flag_nan(stepped, "mse_vs_ols")
    refs, ref_note = flag_nan(_drawn(d[d["steps"].isna()], {}, ())[1], "mse_vs_ols")  # a level line has no point to break
    outside = joined(outside, level_outside(d[d["steps"].isna()]))  # but a panel without it is named (a review)
    nan_note = "; ".join(n for n in (NAN_NOTE, INF_NOTE) if n in nan_note or n in ref_note)  # once each
    fig, panels = make_panels(stepped, "N", "N")
    styles = series_styles(pd.concat([stepped, refs]))
    twins = style.identical_series(stepped, ["N", "steps"], "mse_vs_ols")
    level_twins = style.identical_series(refs, ["N"], "mse_vs_ols") if len(refs) else {}  # level lines too (a tryout)
    xs = np.sort(stepped["steps"].unique())  # a level line with its series' marker at every steps value
    sd, rd = (style.against_floor(t, "steps", "mse_vs_ols") for t in (stepped, refs.assign(steps=np.nan)))
    both = pd.concat([sd, rd])
    low = bool(both["_at"].any() or (both["_lo"] <= both["_floor"]).any())  # a mean or band at the float floor
    log_y = low or style.spans(style.above_floor(both), 2)
    lay = style.floor_layout(style.above_floor(both), both["_floor"].min() if low else None) if log_y else None
    line = lay["line"] if lay else None
    counts = {}  # series -> [points on the floor line, points drawn]
    for ax, ds in panels:
        n = ds["N"].iloc[0]
        ds, rs = sd[sd["N"] == n].copy(), rd[rd["N"] == n].sort_values("series_rank")
        if line is not None:
            style.onto_floor(ds, line)
            ax.margins(x=0.09)  # room for floor markers beside the first and last steps value
        style.draw_means(ax, ds, "steps", "mse_vs_ols", styles, twins, counts)
        for _, r in rs.iterrows():
            st = styles[r["series"]]
            y = np.nan if line is not None and r["_at"] else r["_y"]  # on the floor: its markers, below
            twin = level_twins.get(r["series"], (None,))[0]
            ax.plot(xs, np.full(xs.shape, y), ls=st["linestyle"] if st["linestyle"] != "-" else (0, (6, 2)), lw=1.1,
                    color=st["color"], marker=st["marker"], ms=8 if twin else 4, mfc="none", zorder=4 if twin else None,
                    label=f"{r['series']} (no steps" + (f"; = {twin})" if twin else ")"))
            c = counts.setdefault(r["series"], [0, 0])
            c[0], c[1] = c[0] + int(r["_at"]), c[1] + int(pd.notna(r["mse_vs_ols"]))
        if line is not None:  # a level line on the floor: its marker at every steps value
            on = rs[rs["_at"]]
            on = on.iloc[np.repeat(np.arange(len(on)), len(xs))].assign(steps=np.tile(xs, len(on)))
            style.floor_markers(ax, pd.concat([ds, on]), "steps", styles, line)
        if log_y:
            style.error_axis(ax, lay, f"≤{both['_floor'].min():.2g}", style.above_floor(both))
        style.grid_axis(ax, stepped["steps"], style.spans(stepped["steps"], 1))
    note = band_note(pd.concat([stepped, refs]))
    if line is not None:
        note += "; " + style.floor_note(both, "mse_vs_ols", {s: c for s, c in counts.items() if c[0]},
                                        lay["cut"] is not None)
    if twins or level_twins:
        note += "; " + style.twins_note({**twins, **level_twins})
    if nan_note:
        note += "; " + nan_note
    note += GAP_NOTE if "failed" in stepped and stepped["failed"].any() else ""
    note += f"; {outside}" if outside else ""
    extra = style.floor_legend() if line is not None else []
    return finish(fig, panels, LABELS["steps"], MSE_OLS_LABEL,
                   f"GD steps vs error{'; horizontal lines: solvers without steps' if len(refs) else ''} "
                   f"({setting_words(setting, axes, summary)})", note, extra=extra, order=list(styles))


def throughput(table: pd.DataFrame, setting: dict | None = None) -> Figure:
    """Median prompts/s per series and dtype as a dot plot, one panel per device, over every ok
    cell (all N, noise, R); the whisker spans the 25th-75th percentile over those cells and each
    dot is labelled with its value. Dots, not bars: on a logarithmic axis a bar's length is
    measured from an arbitrary floor, so bar lengths misstate ratios (a solver 1000x slower looked
    50x slower); a dot's position reads in decades. A series that answered NaN / inf on well-posed
    prompts says so in its label, as in the error plots. With `setting`, the cells at its d and ood
    only, where the runs hold several (as the other plots): pooled, d = 2 cells of some solvers
    against d = 1 cells of others reversed their order (a review). Raises PlotSkipped when no ok
    cell has a finite throughput."""
    d = table[(table["status"] == "ok") & np.isfinite(table["prompts_per_s"].astype(float))]
    fixed = [a for a in ("d", "ood") if setting is not None and a in d and d[a].nunique() > 1]
    d = select(d, setting, fixed) if fixed else d
    if d.empty:
        raise PlotSkipped("throughput: no ok cell has a finite prompts_per_s")
    shared = int(shared_timing(d).sum())  # timed beside other cells: the title says so (load.shared_timing_notes)
    d, nan_note = flag_nan(d)  # a solver answering NaN is fast at it: unflagged it read as the fastest
    order = series_order(d)
    dtypes = sorted(d["dtype"].unique())
    colours = style.dtype_colours(dtypes)
    height = 0.9 + 0.16 * len(order) * max(len(dtypes), 1) + 0.5
    fig, panels = make_panels(d, "device", "device", width=4.6, height=max(2.6, height), sharey=True)
    log_x = style.spans(d["prompts_per_s"], 1)
    v = d["prompts_per_s"].astype(float)
    for ax, dd in panels:
        for j, dtype in enumerate(dtypes):
            stats_ = dd[dd["dtype"] == dtype].groupby("series")["prompts_per_s"].quantile([0.25, 0.5, 0.75]).unstack()
            stats_ = stats_.reindex([s for s in order if s in stats_.index])
            if stats_.empty:
                continue
            y = [order.index(s) + (j - (len(dtypes) - 1) / 2) * 0.8 / max(len(dtypes), 1) for s in stats_.index]
            med, lo, hi = stats_[0.5].to_numpy(), stats_[0.25].to_numpy(), stats_[0.75].to_numpy()
            ax.errorbar(med, y, xerr=[med - lo, hi - med], fmt="o", ms=4.5, color=colours[dtype], elinewidth=1,
                        capsize=2, label=dtype, zorder=3)
            for x, yy, top in zip(med, y, hi):
                ax.annotate(_rate(x), (max(top, x), yy), xytext=(4, 0), textcoords="offset points", va="center",
                            fontsize=6, color=colours[dtype])
        ax.set_yticks(range(len(order)), order, parse_math=False)  # series labels: text, never mathtext
        ax.set_ylim(len(order) - 0.5, -0.5)  # first series at the top
        ax.grid(axis="y", visible=False)
        if log_x:
            ax.set_xscale("log")
            ax.set_xlim(v.min() / 2, v.max() * 6)  # room for the value labels right of the whiskers
            style.log_ticks(ax, "x", v)
        else:
            ax.set_xlim(0, v.max() * 1.35)
        ax.tick_params(axis="y", labelsize=7)
    pooled = ", ".join(["N", "noise", "R", *sorted(varied_axes(d) & {"d", "ood"})])
    scale = "log axis: equal distances are equal ratios" if log_x else "linear axis from 0"
    at = "".join(f", {a} = {setting[a]}" for a in fixed)
    fig = finish(fig, panels, LABELS["prompts_per_s"], "", f"Throughput (median over the {pooled} cells{at})",
                  f"dot and label: median prompts/s; whiskers: 25th-75th percentile over cells; {scale}"
                  + (f"; {shared} of {len(d)} cells timed while other cells ran on their machine" if shared else "")
                  + ("; NaN/inf on k of n well-posed: the solver answered NaN or inf on k of the n prompts with a "
                     "least-squares answer; its prompts/s counts them too" if nan_note else ""),
                  legend_title="dtype")
    return fig


def _rate(x: float) -> str:
    """A throughput label: 3 significant digits, thousands as k / M (2.19e5 -> "219k")."""
    for div, unit in ((1e6, "M"), (1e3, "k")):
        if x >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"
