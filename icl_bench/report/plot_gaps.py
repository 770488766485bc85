"""What the error plots cannot draw, said in their notes (docs/report.md, "Failed points"): a point
whose every cell failed (a gap inside a line; named when no line shows it), and an axis that
takes one value at the plot's setting (where the runs vary it elsewhere, the --at flags that
reach it). Used by icl_bench/report/plots.py.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from icl_bench.report.coverage import at_flag
from icl_bench.report.figure import PlotSkipped, fmt


GAP_NOTE = "; a gap in a line: every cell of that point errored or was skipped (failures.md)"


def gaps(data: pd.DataFrame, x: str, col: str) -> tuple[pd.DataFrame, str]:
    """(`data` with only the failed rows (see plots._drawn) that fall inside a line: between the first and
    last ok x of their series in their panel (`col`), a note naming the others). Elsewhere a failed
    cell has no line to break and would only add an empty panel, tick or legend entry; but a series
    that failed at its first or last x, or everywhere in the figure, would vanish from it unremarked
    (a review: a PNG used alone showed no failure), so the note names those points."""
    if "failed" not in data or not data["failed"].any():
        return data, ""
    failed = data["failed"].astype(bool)
    span = data[~failed].groupby(["series", col], dropna=False)[x].agg(["min", "max"])
    lo_hi = data[failed].join(span, on=["series", col])
    inside = (lo_hi[x] > lo_hi["min"]) & (lo_hi[x] < lo_hi["max"])
    return pd.concat([data[~failed], data[failed][inside]]).sort_index(), outside_note(data, lo_hi[~inside], x, col)


def outside_note(data: pd.DataFrame, out: pd.DataFrame, x: str, col: str | None, most: int = 6) -> str:
    """"not drawn, every cell errored or was skipped (failures.md): S at x = a, b (col = c); T (no ok
    point)" for the failed rows `out` that no line shows; the panel (`col`; None: one panel) is
    named where the point failed in some panels only. At most `most` series, then a count."""
    if out.empty:
        return ""
    drawn = set(data.loc[~data["failed"].astype(bool), "series"])
    panels = data[col].nunique(dropna=False) if col else 1
    parts = []
    order = out.sort_values(["series_rank", "series"] if "series_rank" in out else ["series"], kind="stable")
    for series, g in order.groupby("series", sort=False):  # (legend order)
        if series not in drawn:
            parts.append(f"{series} (no ok point in this figure)")
            continue
        where = []
        for v, gv in g.groupby(x, sort=True):
            panel = ""
            if col and gv[col].nunique(dropna=False) < panels:  # (NaN: a CSV run's one noise panel, "n/a")
                panel = f" ({col} = {', '.join(map(fmt, sorted(gv[col].unique().tolist(), key=str)))})"
            where.append(fmt(v) + panel)
        parts.append(f"{series} at {x} = {', '.join(where)}")
    more = f"; and {len(parts) - most} more series" if len(parts) > most else ""
    return "not drawn, every cell errored or was skipped (failures.md): " + "; ".join(parts[:most]) + more


def level_outside(level: pd.DataFrame) -> str:
    """outside_note for gd_steps' level lines (solvers without steps): one per N panel, so a panel
    where every cell of such a solver failed has none, which the note names."""
    if "failed" not in level or not level["failed"].any():
        return ""
    failed = level["failed"].astype(bool)
    ok = set(zip(level.loc[~failed, "series"], level.loc[~failed, "N"]))
    missing = level[failed & ~pd.Series([(s, n) in ok for s, n in zip(level["series"], level["N"])], index=level.index)]
    return outside_note(level, missing, "N", None)


def joined(*notes: str) -> str:
    """outside_note texts as one, the "not drawn ...:" prefix once."""
    notes = [n for n in notes if n]
    return "; ".join([notes[0]] + [n.split(": ", 1)[1] for n in notes[1:]]) if notes else ""


def check_varied(d: pd.DataFrame, x: str, name: str, every: pd.DataFrame | None = None,
                  elsewhere: str = "") -> None:
    """PlotSkipped when the x axis of the ok rows `d` has one value: a plot of one point per series
    shows no trend. `every`: the rows at the setting, failed ones too (plots._drawn), so that an axis that
    varied but has ok cells at one value only is not called unvaried (N = 2, 3 at d = 3: a review).
    `elsewhere`: varied_elsewhere's hint, where x varies at another setting of the runs."""
    values = sorted(d[x].dropna().unique())
    if len(values) < 2:
        shown = ", ".join(fmt(v) for v in values) or "none"
        others = sorted(set(every[x].dropna().unique()) - set(values)) if every is not None else []
        if others:
            raise PlotSkipped(f"{name}: only {x} = {shown} has ok cells at this setting (every cell at {x} = "
                              f"{', '.join(fmt(v) for v in others)} errored or was skipped: failures.md)")
        if elsewhere:
            raise PlotSkipped(f"{name}: {x} took one value at this setting ({x} = {shown}); {elsewhere}")
        raise PlotSkipped(f"{name}: {x} did not vary ({x} = {shown}); add a list of {x} values to the config's [grid] "
                          "to draw it")


def varied_elsewhere(summary: pd.DataFrame, setting: dict, axes, x: str) -> str:
    """Where the ok rows of `summary` hold several values of x at a setting other than `setting`
    (its `axes` fixed): "the runs have R = 10, 100, 1000 at N = 30; publish with --at N=30 to
    draw it", for the such setting that differs from `setting` on the fewest axes (then: has the
    most x values); "" when x varies nowhere. Two runs published together can put the setting
    where only one of them has cells (N = 20 of an OOD run beside a grid of N = 10, 30, 100),
    and "add a list of R values" was then false of the runs (a review)."""
    ok = summary[~summary["failed"].astype(bool)] if "failed" in summary else summary
    ok = ok[np.isfinite(ok["mse_vs_ols"].astype(float))] if "mse_vs_ols" in ok else ok
    axes = [a for a in axes if a in ok]
    if ok.empty or not axes:
        return ""
    best = None
    for key, g in ok.groupby(axes, dropna=False, sort=True):
        values = sorted(g[x].dropna().unique())
        if len(values) < 2:
            continue
        key = dict(zip(axes, key if isinstance(key, tuple) else (key,)))
        differ = [a for a, v in key.items() if not (v == setting.get(a) or (pd.isna(v) and pd.isna(setting.get(a))))]
        rank = (len(differ), -len(values))
        if best is None or rank < best[0]:
            best = (rank, key, differ, values)
    if best is None:
        return ""
    _, key, differ, values = best
    # --at pins every axis that takes several values (report.representative would choose those not
    # given afresh: --at N=10 alone landed on noise = 0 there, where R did not vary again; a review)
    pinned = [a for a in axes if a in differ or ok[a].nunique(dropna=False) > 1]
    at = ", ".join(f"{a} = {fmt(key[a])}" for a in differ)
    flags = " ".join(at_flag(a, key[a]) for a in pinned)
    return f"the runs have {x} = {', '.join(fmt(v) for v in values)} at {at}; publish with {flags} to draw it"
