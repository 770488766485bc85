"""Styling shared by the report's plots: how series look, how axes are ticked, how notes fit.

Series style (docs/report.md, "Plots"): the colour names the solver *family* (the name before its
first "-": gd and gd-lsa are one family, trained-l1 / -nol1 / -lsa another), each solver of a
family gets its own shade of that colour, and the parameter set of a solver (steps = 1, 4, 16)
gets its own marker (a solver with a single parameter set takes its family's k-th marker instead,
so one-setting solvers of a family, e.g. trained-*, differ in marker too); solvers of one family
also differ in line style, and so do the prompt sources of one solver when the runs hold several
(report.add_series: "gd steps=4 · d2.csv x→y"). Series whose plotted numbers
coincide on the plot (gd and gd-lsa run the same iterations; they agree to VISUAL_RTOL, 1 %) are
drawn on top of each other: the later one with larger open markers and a dotted line, its legend
label says "= <the other>", and the figure note names the pair with their largest relative
difference.

Axes: a logarithmic axis gets ticks at powers of ten, plus 2 and 5 times them when it spans
less than two decades (so a narrow log axis never shows a single tick); an axis of grid values
(N, R, steps) gets ticks at exactly those values, fewer when they would collide, and an axis
with one value is centred on it instead of matplotlib's [v - 1, v + 1] default.
"""
from __future__ import annotations

import math
import textwrap

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib import ticker

MARKERS = ["o", "s", "^", "D", "v", "P", "X", "<", ">", "h"]
DASHES = ["-", "--", "-.", ":", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 1))]
FAMILY_PALETTE = "tab10"
# the built-in families keep their tab10 colour in every figure and run; plugins take the rest
KNOWN_FAMILIES = {"gd": 0, "ln": 1, "ols": 2, "scipy": 3, "trained": 4}
# series whose values agree this closely coincide on the plot and are drawn as one: 1 % relative is
# 0.0043 decades on a log axis, under a marker's width. A tolerance of float rounding would not do:
# gd and gd-lsa (the same iterations, rounded differently) differ by up to 1.1e-4 relative in
# float32 (MSE vs OLS at steps = 16 on the default matrix; 1e-13 in float64), and the note gives
# the measured difference, so nothing is hidden by the tolerance
VISUAL_RTOL = 1e-2


def family(solver: str) -> str:
    """The solver family: the name up to its first "-" ("gd-lsa" -> "gd", "trained-l1" -> "trained")."""
    return solver.split("-", 1)[0]


def series_styles(series: pd.DataFrame) -> dict[str, dict]:
    """series label -> matplotlib style {color, marker, linestyle, family}.

    Args:
        series: one row per series with columns "series", "solver", "series_rank" (report.add_series).
    Colours: one tab10 hue per family (fixed for the built-in families, KNOWN_FAMILIES; the
    others in order of appearance), shades of it per solver;
    line style: by solver within its family (and by prompt source within the solver when the rows
    hold several `prompts`); marker: by the rank of the parameter set (solver_params) within its
    solver (so gd steps=4 and gd-lsa steps=4 share one, whatever their source), or, for a solver
    run with one parameter set, by the solver within its family (the four trained-* solvers: four
    markers, not four circles).
    """
    rows = series.drop_duplicates("series").sort_values("series_rank")
    params = rows["solver_params"] if "solver_params" in rows else rows["series"]  # (a table of labels only)
    source = rows["prompts"].fillna("") if "prompts" in rows else pd.Series("", index=rows.index)
    sources = list(dict.fromkeys(source))  # several: each its line style within a solver
    families = list(dict.fromkeys(family(s) for s in rows["solver"]))
    tab = sns.color_palette(FAMILY_PALETTE, 10)
    free = [c for i, c in enumerate(tab) if i not in KNOWN_FAMILIES.values()]
    others = [f for f in families if f not in KNOWN_FAMILIES]
    extra = free + sns.color_palette("husl", max(len(others) - len(free), 0))
    colours = {f: tab[KNOWN_FAMILIES[f]] if f in KNOWN_FAMILIES else extra[others.index(f)] for f in families}
    out = {}
    for fam in families:
        colour = colours[fam]
        solvers = list(dict.fromkeys(s for s in rows["solver"] if family(s) == fam))
        shades = _shades(colour, len(solvers))  # darkest first; one solver keeps the family colour
        for k, (solver, shade) in enumerate(zip(solvers, shades)):
            mine = rows[rows["solver"] == solver]
            sets = list(dict.fromkeys(params[mine.index]))  # its parameter sets, in series order
            for s, p, src in zip(mine["series"], params[mine.index], source[mine.index]):
                m = sets.index(p) if len(sets) > 1 else k  # one parameter set: the solver's own marker (k) in its family
                dash = DASHES[(k * len(sources) + sources.index(src)) % len(DASHES)]
                out[s] = {"color": shade, "marker": MARKERS[m % len(MARKERS)], "linestyle": dash, "family": fam}
    return out


def _shades(colour, n: int) -> list:
    """n distinguishable shades of one colour: mixed towards black and towards white."""
    if n == 1:
        return [colour]
    c = np.asarray(colour, dtype=float)
    mix = np.linspace(-0.45, 0.5, n)  # < 0: towards black, > 0: towards white
    return [tuple(c * (1 + m) if m < 0 else c + (1 - c) * m) for m in mix]


def identical_series(data: pd.DataFrame, keys: list[str], value: str) -> dict[str, tuple[str, float]]:
    """Series whose `value` coincides with an earlier series' at every key:
    {later series: (earlier series, largest relative difference)}.

    Args:
        data: rows with "series", "series_rank", the `keys` (x and panel columns) and `value`.
    Two series coincide when they have the same keys and the values agree to VISUAL_RTOL relative
    (or are both NaN): drawn, they would hide each other. Earlier = lower series_rank.
    """
    order = data.sort_values("series_rank")["series"].drop_duplicates().tolist()
    vectors = {}
    for s in order:
        d = data[data["series"] == s].sort_values(keys)
        vectors[s] = (tuple(map(tuple, d[keys].astype(str).to_numpy())), d[value].to_numpy(dtype=float))
    same = {}
    for i, s in enumerate(order):
        k, v = vectors[s]
        for t in order[:i]:
            if t in same:
                continue
            k2, v2 = vectors[t]
            if k == k2 and len(v) and np.allclose(v, v2, rtol=VISUAL_RTOL, atol=0, equal_nan=True):
                same[s] = (t, _max_rel_diff(v, v2))
                break
    return same


def _max_rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max(|a|, |b|) over the points where both are finite and not both 0."""
    scale = np.maximum(np.abs(a), np.abs(b))
    good = np.isfinite(a) & np.isfinite(b) & (scale > 0)
    return float((np.abs(a - b)[good] / scale[good]).max()) if good.any() else 0.0


def twins_note(twins: dict[str, tuple[str, float]]) -> str:
    """The figure note on coinciding series: "gd-lsa steps=4 coincides with gd steps=4 (largest
    relative difference 1.6e-07; open markers on top)", "(equal; ...)" when they are."""
    return "; ".join(f"{a} coincides with {b} (" + (f"largest relative difference {rel:.2g}" if rel else "equal")
                     + "; open markers on top)" for a, (b, rel) in twins.items())


def draw_series(ax, x, y, style: dict, label: str, twin_of: str | None = None, **kw):
    """One series as a line with markers; a twin (coinciding with `twin_of`) as open markers on top."""
    if twin_of is None:
        return ax.plot(x, y, color=style["color"], marker=style["marker"], ms=4.5, lw=1.4,
                       linestyle=style["linestyle"], label=label, **kw)
    return ax.plot(x, y, color=style["color"], marker=style["marker"], ms=9, mfc="none", mew=1.3, lw=1.0,
                   linestyle=":", label=f"{label} (= {twin_of})", zorder=4, **kw)


def spans(values, decades: float) -> bool:
    """True when the positive finite values span at least `decades` powers of ten."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v) & (v > 0)]
    return v.size > 1 and v.max() / v.min() >= 10 ** decades


def log_ticks(ax, axis: str, values) -> None:
    """Ticks of a logarithmic axis: powers of ten, plus 2x and 5x them below two decades of span."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v) & (v > 0)]
    a = ax.xaxis if axis == "x" else ax.yaxis
    if v.size and v.max() / v.min() < 100:
        a.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        a.set_major_formatter(ticker.FuncFormatter(lambda t, _: _short(t)))
    else:
        a.set_major_locator(ticker.LogLocator(base=10, numticks=8))
        a.set_major_formatter(ticker.LogFormatterSciNotation())
    a.set_minor_formatter(ticker.NullFormatter())


def _short(t: float) -> str:
    return f"{t:g}" if 1e-3 <= abs(t) < 1e5 else f"{t:.0e}".replace("e+0", "e").replace("e-0", "e-")


def grid_axis(ax, values, log: bool, axis: str = "x") -> None:
    """Ticks at the grid values (N, R, steps), thinned so labels never collide; one value centred."""
    v = sorted({float(x) for x in values if x == x})
    a = ax.xaxis if axis == "x" else ax.yaxis
    setlim = ax.set_xlim if axis == "x" else ax.set_ylim
    if log:
        (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
    if not v:
        return
    if len(v) == 1:
        lo, hi = (v[0] / 2, v[0] * 2) if log and v[0] > 0 else (v[0] - max(abs(v[0]) * 0.5, 0.5), v[0] + max(abs(v[0]) * 0.5, 0.5))
        setlim(lo, hi)
    shown = _thin(v, log)
    a.set_major_locator(ticker.FixedLocator(shown))
    a.set_major_formatter(ticker.FixedFormatter([f"{t:g}" for t in shown]))
    a.set_minor_locator(ticker.NullLocator())


def _thin(v: list[float], log: bool, max_ticks: int = 8) -> list[float]:
    """At most max_ticks grid values, and none closer than 1/12 of the axis span to the previous."""
    pos = [math.log10(t) if log and t > 0 else t for t in v]
    span = (max(pos) - min(pos)) or 1.0
    out, last = [], None
    step = max(1, math.ceil(len(v) / max_ticks))
    for i, (t, p) in enumerate(zip(v, pos)):
        if i % step and i != len(v) - 1:
            continue
        if last is not None and (p - last) < span / 12:
            continue
        out.append(t)
        last = p
    return out


def wrap_note(text: str, width_in: float, fontsize: float = 7) -> tuple[str, int]:
    """`text` wrapped to a figure `width_in` inches wide; returns (text, number of lines)."""
    chars = max(int(width_in * 72 / (0.55 * fontsize)) - 4, 20)
    text = text.replace(" = ", "\0=\0")  # "noise = 0.1" stays on one line
    lines = [ln.replace("\0", " ") for para in text.split("\n")
             for ln in (textwrap.wrap(para, chars, break_on_hyphens=False) or [""])]
    return "\n".join(lines), len(lines)
