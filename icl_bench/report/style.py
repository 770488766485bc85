"""Styling shared by the report's plots: how series look, how axes are ticked, how notes fit.

Series styles (colour by family, marker, line style) are in icl_bench/report/series.py. Series whose
plotted numbers coincide on the plot (gd and gd-lsa run the same iterations; they agree to
VISUAL_RTOL, 1 %) are drawn on top of each other: the later one with larger open markers and a
dotted line, its legend label says "= <the other>", and the figure note names the pair with their
largest relative difference.

Axes: a logarithmic axis gets ticks at powers of ten, plus 2 and 5 times them when it spans
less than two decades (so a narrow log axis never shows a single tick); an axis of grid values
(N, R, steps) gets ticks at exactly those values, fewer when they would collide, and an axis
with one value is centred on it instead of matplotlib's [v - 1, v + 1] default. An error axis with
points at the float floor of their dtype gets a floor line at its bottom (floor_layout, below).
"""
from __future__ import annotations

import math
import sys
import textwrap

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib import ticker, transforms
from matplotlib.font_manager import FontProperties
from matplotlib.textpath import TextToPath
from matplotlib.collections import LineCollection
from matplotlib.lines import Line2D

from icl_bench.report.scaling import FLOOR_ULPS, float_floor

# series whose values agree this closely coincide on the plot and are drawn as one: 1 % relative is
# 0.0043 decades on a log axis, under a marker's width. A tolerance of float rounding would not do:
# gd and gd-lsa (the same iterations, rounded differently) differ by up to 1.1e-4 relative in
# float32 (MSE vs OLS at steps = 16 on the default matrix; 1e-13 in float64), and the note gives
# the measured difference, so nothing is hidden by the tolerance
VISUAL_RTOL = 1e-2
_TEXT = TextToPath()  # measures a line of a figure note in points (wrap_note)


def identical_series(data: pd.DataFrame, keys: list[str], value: str) -> dict[str, tuple[str, float]]:
    """Series whose `value` coincides with an earlier series' wherever both were drawn:
    {twin: (the series it coincides with, largest relative difference, partial)}; partial: the two
    do not share every point (nor a finite value at each), so the note says "where both have a value".

    Args:
        data: rows with "series", "series_rank", the `keys` (x and panel columns) and `value`.
    Two series coincide when one's keys include all of the other's (one grid within the other:
    gd-lsa at steps 1 and 16 beside gd at 1, 2, 4, 8, 16) and the values agree to VISUAL_RTOL
    relative at every shared key where both are finite, with at least one such key: drawn, those
    points would hide each other (where either is NaN nothing is drawn over the other, and two
    series with nothing drawn hide nothing). A key
    set that only overlaps another's is not a twin: each has points the other lacks. The twin (drawn
    with open markers on top) is the series with fewer finite points, else the later one (higher series_rank):
    a complete series had been drawn as the twin of one that failed at some points (a review).
    """
    order = data.sort_values("series_rank")["series"].drop_duplicates().tolist()
    points = {}
    for s in order:
        d = data[data["series"] == s]
        # (str per value: pandas 3 keeps NaN as NaN in astype(str), so a NaN noise (CSV prompts) beside 0.1 in two
        # nested series made sorted() below compare a float with a str: a TypeError; found calling it directly)
        keyed = [tuple(str(v) for v in row) for row in d[keys].to_numpy(dtype=object)]
        points[s] = dict(zip(keyed, d[value].to_numpy(dtype=float)))
    finite = {s: int(np.isfinite(list(p.values())).sum()) for s, p in points.items()}  # points with a value
    same = {}
    for i, s in enumerate(order):
        for t in order[:i]:
            a, b = points[s], points[t]
            if not (a.keys() <= b.keys() or b.keys() <= a.keys()):
                continue
            twin, ref = (t, s) if finite[t] < finite[s] else (s, t)  # the series with fewer points is drawn open
            if twin in same or ref in same:  # one level: "a (= b)", never "a (= b (= c))"
                continue
            shared = sorted(a.keys() & b.keys())
            v, v2 = np.array([a[k] for k in shared]), np.array([b[k] for k in shared])
            both = np.isfinite(v) & np.isfinite(v2)  # where one is NaN (or a failed cell), nothing is hidden
            if both.any() and np.allclose(v[both], v2[both], rtol=VISUAL_RTOL, atol=0):
                partial = a.keys() != b.keys() or not both.all()
                same[twin] = (ref, _max_rel_diff(v, v2), partial)
                if twin == s:
                    break
    return same


def _max_rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max(|a|, |b|) over the points where both are finite and not both 0."""
    scale = np.maximum(np.abs(a), np.abs(b))
    good = np.isfinite(a) & np.isfinite(b) & (scale > 0)
    return float((np.abs(a - b)[good] / scale[good]).max()) if good.any() else 0.0


def twins_note(twins: dict[str, tuple[str, float, bool]]) -> str:
    """The figure note on coinciding series: "gd-lsa steps=4 coincides with gd steps=4 (largest
    relative difference 1.6e-07; open markers on top)", "(equal; ...)" when they are, "coincides
    with gd where both have a value" when one lacks points the other has."""
    parts = []
    for a, (b, rel, partial) in twins.items():
        where = " where both have a value" if partial else ""
        parts.append(f"{a} coincides with {b}{where} ("
                     + (f"largest relative difference {rel:.2g}" if rel else "equal") + "; open markers on top)")
    return "; ".join(parts)


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
    """`text` wrapped to a figure `width_in` inches wide; returns (text, number of lines). The
    characters per line start from an average glyph width and shrink until every line, measured in
    the font (matplotlib's TextToPath), fits in the width less 0.2 in: lines of wide glyphs ("mode=b
    (= NoDoc k=1 mode=a)") ran past the figure's edge and were cut off (a plugin author's review)."""
    chars = max(int(width_in * 72 / (0.55 * fontsize)) - 4, 20)
    text = text.replace(" = ", "\0=\0")  # "noise = 0.1" stays on one line
    font = FontProperties(size=fontsize)
    while True:
        lines = [ln.replace("\0", " ") for para in text.split("\n")
                 for ln in (textwrap.wrap(para, chars, break_on_hyphens=False) or [""])]
        widest = max(_TEXT.get_text_width_height_descent(ln, font, ismath=False)[0] for ln in lines)
        if widest <= (width_in - 0.2) * 72 or chars <= 20:
            return "\n".join(lines), len(lines)
        chars = max(20, int(chars * 0.95))


# Float floor (report/scaling.py float_floor): on a logarithmic error axis a mean MSE at or below
# the floor of its dtype is rounding, not method error. mse_vs_n, mse_vs_r and gd_steps draw such points on a
# dashed floor line at the bottom of the panel, as FLOOR_MARKER in the series' colour, the series
# side by side (FLOOR_DODGE points apart) in series order; the axis above it spans only the values
# above the floor. Where the floor lies more than FLOOR_GAP decades below them (float64's 4.9e-28
# under values of 1e-11 and up), the axis is broken: the line sits just below the data in a grey
# strip, under // marks, and its tick reads "≤ <floor>" (the floor, not the line's height).
FLOOR_MARKER = r"$\downarrow$"
FLOOR_LABEL = "≤ float floor (rounding; ↓ in the series' colour)"
FLOOR_GAP = 0.2  # decades between the lowest value above the floor and the floor line, at least
FLOOR_DODGE = 7.0  # points between the floor markers of two series at one x


def floor_layout(values, floor: float | None) -> dict:
    """Where a log error axis puts its floor line: {"bottom", "top" (y limits), "line" (the floor
    line's y, None without one), "cut" (the lowest y of the true scale when the axis is broken
    below it, else None)}, all in y units.

    Args:
        values: the values drawn above the floor (means, CI bounds; non-finite and ≤ 0 ignored).
        floor: the float floor when a point of the panels is at or below it, else None.
    Margins are fractions of the values' span in decades (at least one decade), so a panel of 3
    decades and one of 30 look alike; a floor within FLOOR_GAP (or 15 % of the span) of the lowest
    value is drawn at its own height, without a break.
    """
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v) & (v > 0)]
    if not v.size:  # every point at the floor: the line alone, at its height
        f = floor if floor is not None else 1.0
        return {"bottom": f / 10**0.5, "top": f * 10**0.5, "line": floor, "cut": None}
    lo, hi = float(v.min()), float(v.max())
    span = max(math.log10(hi / lo), 1.0)
    top = min(hi * 10 ** (0.05 * span), sys.float_info.max)  # a diverging mean near 1e303 overflowed the
    # margin to inf, and matplotlib refused the limits: publish crashed (a review)
    if floor is None:
        return {"bottom": lo / 10 ** (0.05 * span), "top": top, "line": None, "cut": None}
    gap = max(0.15 * span, FLOOR_GAP)
    if lo / floor <= 10**gap:  # the floor is near: at its own height
        return {"bottom": min(floor, lo) / 10 ** (0.06 * span), "top": top, "line": floor, "cut": None}
    cut = lo / 10 ** (0.03 * span)
    line = cut / 10**gap
    return {"bottom": line / 10 ** (0.06 * span), "top": top, "line": line, "cut": cut}


def floor_axis(ax, layout: dict, floor_text: str) -> None:
    """A log y axis laid out by floor_layout: its limits, the dashed floor line (a LineCollection,
    gid "float-floor", so it is no series' line), and on a broken axis the grey strip and // marks
    on both spines; ticks at powers of ten (1, 2, 5 × them below two decades) on the true scale
    only, plus one at the line reading `floor_text` ("≤1.4e-10")."""
    bottom, top, line, cut = layout["bottom"], layout["top"], layout["line"], layout["cut"]
    ax.set_autoscaley_on(False)  # (before the limits: autoscaling data near 1e300 overflowed its margins to inf)
    ax.set_yscale("log")
    ax.set_ylim(bottom, top)
    lo = cut if cut is not None else bottom
    if line is not None:
        ax.hlines(line, 0, 1, transform=ax.get_yaxis_transform(), colors="0.35", linestyles="--", linewidth=0.9,
                  zorder=2.5, gid="float-floor")
    if cut is not None:
        brk = math.sqrt(line * cut)  # the break: halfway (in decades) between the line and the true scale
        ax.axhspan(bottom, brk, color="0.92", zorder=0, linewidth=0, gid="float-floor-strip")
        f = math.log10(brk / bottom) / math.log10(top / bottom)  # its height in axes fractions
        marks = [[(x - 0.012, f + dy - 0.012), (x + 0.012, f + dy + 0.012)] for x in (0, 1) for dy in (-0.008, 0.008)]
        ax.add_collection(LineCollection(marks, transform=ax.transAxes, colors="0.2", linewidths=0.9, clip_on=False,
                                         zorder=5, gid="float-floor-break"))
    k0, k1 = math.ceil(math.log10(lo) - 1e-9), math.floor(math.log10(top) + 1e-9)
    narrow = k1 - k0 < 2
    if narrow:
        ticks = [m * 10.0**k for k in range(k0 - 1, k1 + 1) for m in (1, 2, 5) if lo <= m * 10.0**k <= top]
    else:
        step = math.ceil((k1 - k0 + 1) / 8)
        ticks = [10.0**k for k in range(k1, k0 - 1, -step)]  # from the top: the top decade always shown
    if line is not None:  # no tick label crowding the floor's
        room = 0.06 * math.log10(top / bottom)
        ticks = [t for t in ticks if abs(math.log10(t / line)) > room] + [line]
    ax.yaxis.set_major_locator(ticker.FixedLocator(sorted(ticks)))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(
        lambda t, _: floor_text if line is not None and t == line else _short(t) if narrow else _decade(t)))
    ax.yaxis.set_minor_locator(ticker.NullLocator())


def _decade(t: float) -> str:
    """A power of ten as a tick label, 10^k in mathtext (as LogFormatterSciNotation writes it)."""
    return f"$\\mathdefault{{10^{{{round(math.log10(t))}}}}}$"


def floor_points(ax, x, y: float, colour, shift: float, label: str) -> None:
    """The points of one series at or below the float floor: FLOOR_MARKER on the floor line at y,
    in the series' colour, `shift` points to the side (so series at one x stay apart; unclipped, so
    one beside the last x is not cut at the spine); a scatter (gid "float-floor:<series>"), not a
    line, so the series' own line keeps its label alone."""
    off = transforms.ScaledTranslation(shift / 72, 0, ax.figure.dpi_scale_trans)
    ax.update_datalim(np.column_stack([np.asarray(x, dtype=float), np.full(len(x), y)]))  # autoscale skips the
    ax.autoscale_view()  # shifted transform: a series only on the floor line still sets the x range
    ax.scatter(x, np.full(len(x), y), marker=FLOOR_MARKER, s=70, color=[colour], linewidths=0.3, zorder=6,
               transform=ax.transData + off, gid=f"float-floor:{label}", clip_on=False)


def onto_floor(d: pd.DataFrame, line: float) -> None:
    """In place, for rows of one panel (against_floor) drawn on an axis with a floor line at
    `line`: a band reaching the floor ends on the line, and a mean at the floor leaves its series'
    line (NaN: drawn as floor_markers instead)."""
    d["_lo"] = d["_lo"].where(d["_lo"] > d["_floor"], line)
    d.loc[d["_at"], ["_y", "_lo", "_hi"]] = np.nan


def draw_means(ax, d: pd.DataFrame, x: str, metric: str, styles: dict, twins: dict, counts: dict) -> None:
    """One line per series of `d` (against_floor rows of one panel) in legend (styles) order, its
    band unless it is a twin (identical_series); counts[series] += [points on the floor line,
    points with a mean] (for floor_note)."""
    for s in [s for s in styles if s in set(d["series"])]:
        ds = d[d["series"] == s]
        draw_series(ax, ds[x], ds["_y"], styles[s], s, twins.get(s, (None,))[0])
        if s not in twins:
            ax.fill_between(ds[x], ds["_lo"], ds["_hi"], color=styles[s]["color"], alpha=0.12, linewidth=0)
        n = counts.setdefault(s, [0, 0])
        n[0], n[1] = n[0] + int(ds["_at"].sum()), n[1] + int(ds[metric].notna().sum())


def error_axis(ax, layout: dict, floor_text: str, values) -> None:
    """A log error axis laid out by floor_layout: with its floor line (floor_axis), or without one
    its limits and log_ticks over `values` (those drawn above the floor)."""
    if layout["line"] is not None:
        floor_axis(ax, layout, floor_text)
        return
    ax.set_autoscaley_on(False)  # (as in floor_axis)
    ax.set_yscale("log")
    ax.set_ylim(layout["bottom"], layout["top"])
    log_ticks(ax, "y", values)


def floor_legend() -> list:
    """The legend entry of the floor line: [(handle, FLOOR_LABEL)], for figure.finish's `extra`."""
    return [(Line2D([], [], color="0.35", ls="--", lw=0.9, marker=FLOOR_MARKER, ms=9, mfc="0.2", mec="0.2"), FLOOR_LABEL)]


def floor_markers(ax, d: pd.DataFrame, x: str, styles: dict, line: float) -> None:
    """floor_points for every series of `d` (against_floor rows of one panel) with means at or
    below the floor, side by side in legend (styles) order, FLOOR_DODGE points apart at most."""
    at = [s for s in styles if s in set(d.loc[d["_at"], "series"])]
    step = min(FLOOR_DODGE, 42 / max(len(at), 1))
    for j, s in enumerate(at):
        floor_points(ax, d.loc[d["_at"] & (d["series"] == s), x], line, styles[s]["color"], (j - (len(at) - 1) / 2) * step, s)


def against_floor(d: pd.DataFrame, x: str, metric: str) -> pd.DataFrame:
    """Rows of one panel, sorted by series and x, with the float floor of their dtype (_floor,
    float_floor), the mean and CI bounds as floats (_y, _lo, _hi), and _at: the mean is
    at or below the floor (rounding; 0 included), so it is drawn on the floor line, not at its value."""
    d = d.sort_values(["series", x])
    dtypes = d["dtype"] if "dtype" in d else pd.Series("float64", index=d.index)
    d = d.assign(_floor=[float_floor(t) for t in dtypes], _y=d[metric].astype(float),
                 _lo=d[f"{metric}_ci_low"].astype(float), _hi=d[f"{metric}_ci_high"].astype(float))
    return d.assign(_at=d["_y"] <= d["_floor"])


def above_floor(d: pd.DataFrame) -> np.ndarray:
    """The values of `d` (against_floor) drawn on the true scale: means above the floor and
    their CI bounds that are above it too."""
    v = d.loc[~d["_at"], ["_y", "_lo", "_hi"]].to_numpy(float)
    return v[v > d.loc[~d["_at"], ["_floor"]].to_numpy(float)]


def floor_note(d: pd.DataFrame, metric: str, at: dict[str, list], broken: bool) -> str:
    """The figure note on the floor line: what it means (the floors of the figure's dtypes), that
    its points are not at their value, and per series how many of its points it holds.

    Args:
        d: the drawn rows (against_floor). at: series -> [points on the floor line, points drawn].
        broken: whether some panel's axis is broken below its true scale.
    """
    dtypes = sorted(set(d["dtype"] if "dtype" in d else ["float64"]))
    zeros = int((d[metric] == 0).sum())
    on = ", ".join(f"{s} {k} of {n} points" for s, (k, n) in at.items()) or "none (only bands reach it)"
    return (f"↓ on the dashed line: a mean MSE at or below the float floor ({FLOOR_ULPS} eps)² of its dtype ("
            + ", ".join(f"{t} {float_floor(t):.2g}" for t in dtypes) + "), i.e. rounding, not method error (left out "
            "of the scaling fits too), drawn on the line" + (" (below a break in the axis, //, where the floor lies far "
            "below the data)" if broken else "")
            + f", not at its value, series side by side in legend order: {on}"
            + (f" ({zeros} exactly 0)" if zeros else "") + "; bands reaching the floor end on it")


DTYPE_ORDER = ("float32", "float64", "float16", "bfloat16")  # a dtype's colour: its place here, whatever the run holds


def dtype_colours(dtypes) -> dict:
    """dtype -> colour, the same in every figure: by place in DTYPE_ORDER (other names after, in
    sorted order). By place among the dtypes present, float64 was blue in a float64-only run and
    orange beside float32 (a review)."""
    known = list(DTYPE_ORDER) + sorted(set(dtypes) - set(DTYPE_ORDER))
    palette = sns.color_palette("deep", len(known))
    return {t: palette[known.index(t)] for t in dtypes}
