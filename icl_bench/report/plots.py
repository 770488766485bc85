"""Result plots (seaborn on matplotlib): error vs N, error vs R, GD steps, throughput.

Every function takes the tables of `icl_bench.report.aggregate` and returns a matplotlib Figure (the caller
saves and closes it), or raises `PlotSkipped` with the reason when the runs hold no data for it.
One line (or one bar per hue level) per series, where a series is a solver plus the parameters
that vary between its rows (report.add_series). Error plots draw the mean with its 95 % CI as a
band. An axis is logarithmic when its positive values span more than two decades (one decade for
N and R); on a logarithmic error axis an MSE of exactly 0 (e.g. float64 OLS against itself) is
drawn at the axis floor as an open marker, and a note under the figure says so.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from icl_bench.report.aggregate import select, series_order

MSE_OLS_LABEL = "MSE vs OLS prediction (y units²)"
MSE_TRUTH_LABEL = "MSE vs truth a + b·u (y units²)"
LABELS = {
    "N": "context length N (examples)",
    "R": "embedding constant R (token units)",
    "steps": "GD steps K (= LSA layers)",
    "prompts_per_s": "throughput (prompts / s)",
}


class PlotSkipped(Exception):
    """The runs hold no data for this plot; the message says what is missing."""


def _fmt(v) -> str:
    return "n/a" if isinstance(v, float) and math.isnan(v) else f"{v:g}" if isinstance(v, float) else str(v)


def _spans(values, decades: float) -> bool:
    """True when the positive finite values span at least `decades` powers of ten."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v) & (v > 0)]
    return v.size > 1 and v.max() / v.min() >= 10 ** decades


def _palette(names: list[str]) -> dict:
    """series name -> colour, in the given order."""
    return dict(zip(names, sns.color_palette("tab10" if len(names) <= 10 else "husl", len(names))))


def _panels(data: pd.DataFrame, col: str, col_title: str, width: float = 3.6) -> tuple[Figure, list]:
    """A figure with one panel per value of `col` (NaN last): [(ax, rows of that value), ...]."""
    sns.set_theme(style="whitegrid", context="paper")
    values = sorted(data[col].dropna().unique().tolist()) + ([math.nan] if data[col].isna().any() else [])
    fig = Figure(figsize=(width * len(values) + 1.2, 3.6))
    axes = fig.subplots(1, len(values), sharey=True, squeeze=False)[0]
    out = []
    for ax, v in zip(axes, values):
        rows = data[data[col].isna()] if isinstance(v, float) and math.isnan(v) else data[data[col] == v]
        ax.set_title(f"{col_title} = {_fmt(v)}")
        out.append((ax, rows))
    return fig, out


def _finish(fig: Figure, panels: list, xlabel: str, ylabel: str, title: str, note: str) -> Figure:
    for i, (ax, _) in enumerate(panels):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel if i == 0 else "")
    handles, labels = panels[-1][0].get_legend_handles_labels()
    if handles:
        panels[-1][0].legend(handles, labels, fontsize=7, title="solver", loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.suptitle(title, fontsize=10)
    fig.text(0.01, 0.01, note, fontsize=7, color="0.35")
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    return fig


def _mean_ci_lines(data: pd.DataFrame, x: str, col: str, col_title: str, metric: str, ylabel: str,
                   title: str) -> Figure:
    """Panels by `col`, one line per series of metric (mean) vs x with its 95 % CI band."""
    fig, panels = _panels(data, col, col_title)
    colors = _palette(series_order(data))
    y_all = data[[metric, f"{metric}_ci_low", f"{metric}_ci_high"]].to_numpy(dtype=float).ravel()
    log_y = _spans(y_all, 2)
    pos = y_all[np.isfinite(y_all) & (y_all > 0)]
    floor = pos.min() / 10 if log_y else 0.0
    zeros = 0
    for i, (ax, d) in enumerate(panels):
        d = d.sort_values(["series", x]).assign(_y=d[metric].astype(float), _lo=d[f"{metric}_ci_low"].astype(float),
                                                _hi=d[f"{metric}_ci_high"].astype(float))
        if log_y:
            zero = d["_y"] <= 0
            zeros += int(zero.sum())
            d["_y"] = d["_y"].where(~zero, floor)
            d["_lo"], d["_hi"] = d["_lo"].where(d["_lo"] > 0, floor), d["_hi"].where(d["_hi"] > 0, floor)
            for s, dz in d[zero].groupby("series"):
                ax.scatter(dz[x], dz["_y"], s=40, facecolors="none", edgecolors=[colors[s]], zorder=3)
        for s in [s for s in colors if s in set(d["series"])]:
            ds = d[d["series"] == s]
            ax.plot(ds[x], ds["_y"], marker="o", ms=4, color=colors[s], label=s)
            ax.fill_between(ds[x], ds["_lo"], ds["_hi"], color=colors[s], alpha=0.12, linewidth=0)
        if log_y:
            ax.set_yscale("log")
        if _spans(data[x], 1):
            ax.set_xscale("log")
    note = "band: 95 % CI over prompts and seeds"
    if zeros:
        note += f"; open markers: MSE exactly 0 ({zeros} points), drawn at the axis floor"
    return _finish(fig, panels, LABELS.get(x, x), ylabel, title, note)


def _setting_text(setting: dict, axes) -> str:
    return ", ".join(f"{a} = {_fmt(setting[a])}" for a in axes)


def mse_vs_n(summary: pd.DataFrame, setting: dict) -> Figure:
    """MSE vs OLS against N, one line per series, one panel per noise; R, dtype and device fixed
    at `setting` (report.representative). Raises PlotSkipped without ok cells there."""
    d = select(summary, setting, ("R", "dtype", "device"))
    if d.empty:
        raise PlotSkipped(f"mse_vs_n: no ok cells at {_setting_text(setting, ('R', 'dtype', 'device'))}")
    return _mean_ci_lines(d, "N", "noise", "noise σ", "mse_vs_ols", MSE_OLS_LABEL,
                          f"Error vs context length ({_setting_text(setting, ('R', 'dtype', 'device'))})")


def mse_vs_r(summary: pd.DataFrame, setting: dict) -> Figure:
    """MSE vs OLS against R, one line per series, one panel per dtype (the float32 U-curve of
    ln-closed-form shows here); N, noise, device fixed at `setting`. Raises PlotSkipped."""
    d = select(summary, setting, ("N", "noise", "device"))
    if d.empty:
        raise PlotSkipped(f"mse_vs_r: no ok cells at {_setting_text(setting, ('N', 'noise', 'device'))}")
    return _mean_ci_lines(d, "R", "dtype", "dtype", "mse_vs_ols", MSE_OLS_LABEL,
                          f"Error vs embedding constant R ({_setting_text(setting, ('N', 'noise', 'device'))})")


def _steps(params: str):
    d = json.loads(params) if params else {}
    return d.get("steps") if isinstance(d, dict) else None


def gd_steps(summary: pd.DataFrame, setting: dict) -> Figure:
    """MSE vs OLS against the `steps` parameter (gd-lsa, gd, or any solver that has one), one
    line per such solver (and its other parameters), beside every solver without `steps` as a
    dashed horizontal line (the closed forms); one panel per N; noise, R, dtype, device fixed.
    Raises PlotSkipped when no solver in the runs has a `steps` parameter."""
    axes = ("noise", "R", "dtype", "device")
    d = select(summary, setting, axes).copy()
    d["steps"] = [_steps(p) for p in d["solver_params"]]
    stepped = d[d["steps"].notna()].copy()
    if stepped.empty:
        raise PlotSkipped(f"gd_steps: no solver with a `steps` parameter has ok cells at {_setting_text(setting, axes)}")
    stepped["steps"] = stepped["steps"].astype(float)
    # one line per solver and its parameters other than steps
    stepped["series"] = [" ".join(w for w in s.split() if not w.startswith("steps=")) for s in stepped["series"]]
    refs = d[d["steps"].isna()]
    fig, panels = _panels(stepped, "N", "N")
    colors = _palette(list(dict.fromkeys(series_order(stepped) + series_order(refs))))
    y_all = pd.concat([stepped["mse_vs_ols"], refs["mse_vs_ols"]]).to_numpy(float)
    log_y = _spans(y_all, 2)
    pos = y_all[np.isfinite(y_all) & (y_all > 0)]
    floor = pos.min() / 10 if pos.size else 1.0
    for ax, ds in panels:
        ds = ds.sort_values(["series", "steps"])
        y = ds["mse_vs_ols"].astype(float)
        lo = ds["mse_vs_ols_ci_low"].astype(float)
        hi = ds["mse_vs_ols_ci_high"].astype(float)
        if log_y:
            ds = ds.assign(mse_vs_ols=y.where(y > 0, floor), mse_vs_ols_ci_low=lo.where(lo > 0, floor),
                           mse_vs_ols_ci_high=hi.where(hi > 0, floor))
        for s in [s for s in colors if s in set(ds["series"])]:
            dss = ds[ds["series"] == s]
            ax.plot(dss["steps"], dss["mse_vs_ols"], marker="o", ms=4, color=colors[s], label=s)
            ax.fill_between(dss["steps"], dss["mse_vs_ols_ci_low"], dss["mse_vs_ols_ci_high"], color=colors[s],
                            alpha=0.12, linewidth=0)
        n = ds["N"].iloc[0]
        for _, r in refs[refs["N"] == n].sort_values("series_rank").iterrows():
            y = r["mse_vs_ols"] if not log_y or r["mse_vs_ols"] > 0 else floor
            ax.axhline(y, ls="--", lw=1, color=colors[r["series"]], label=f"{r['series']} (no steps)")
        if log_y:
            ax.set_yscale("log")
        if _spans(stepped["steps"], 1):
            ax.set_xscale("log", base=2)
    return _finish(fig, panels, LABELS["steps"], MSE_OLS_LABEL,
                   f"GD steps vs error, solvers without steps dashed ({_setting_text(setting, axes)})",
                   "band: 95 % CI over prompts and seeds; an MSE of exactly 0 is drawn at the axis floor")


def throughput(table: pd.DataFrame) -> Figure:
    """Median prompts/s per series (bars) and dtype (hue), one panel per device, over every ok
    cell (all N, noise, R); the whisker spans the 25th-75th percentile over those cells.
    Raises PlotSkipped when no ok cell has a finite throughput."""
    d = table[(table["status"] == "ok") & np.isfinite(table["prompts_per_s"].astype(float))]
    if d.empty:
        raise PlotSkipped("throughput: no ok cell has a finite prompts_per_s")
    order = series_order(d)
    fig, panels = _panels(d, "device", "device", width=max(3.6, 0.9 * len(order)))
    dtypes = sorted(d["dtype"].unique())
    for ax, dd in panels:
        sns.barplot(dd, x="series", y="prompts_per_s", hue="dtype", order=order, hue_order=dtypes,
                    estimator="median", errorbar=("pi", 50), ax=ax)
        if ax.get_legend() is not None:
            ax.get_legend().remove()
        if _spans(d["prompts_per_s"], 2):
            ax.set_yscale("log")
        ax.tick_params(axis="x", rotation=30)
    fig = _finish(fig, panels, "solver", LABELS["prompts_per_s"],
                  "Throughput (median over the N, noise, R cells)", "whiskers: 25th-75th percentile over cells")
    handles, labels = panels[-1][0].get_legend_handles_labels()
    panels[-1][0].legend(handles, labels, fontsize=7, title="dtype", loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    return fig
