"""Scaling-law table: how a solver's error scales with R and with N (docs/report.md, "Scaling laws").

For each series and setting, the exponent p of MSE vs OLS ∝ v^p (v = R or N, the other axes
fixed) is the slope of the least-squares line through (log v, log MSE) over the summary's points
whose MSE is above the float floor. Its 95 % confidence interval is the union of two:
  - lack of fit: slope ± t · se_fit, se_fit = sqrt(SSR / (n - 2) / Σ (log v - mean)^2), t the 0.975
    quantile of Student's t with n - 2 degrees of freedom (scipy.stats.linregress): how straight
    the points are;
  - sampling: slope ± z · se_sampling, z = 1.96, se_sampling^2 = Σ (x_i - mean)^2 s_i^2 / (Σ (x_i -
    mean)^2)^2 (the variance of the least-squares slope from independent errors of its points),
    s_i = se(MSE_i) / MSE_i the delta-method standard error of log MSE_i (mse_vs_ols_se): the
    prompts of a fit vs N are drawn anew at every N, so three means that happen to lie on a line
    would otherwise give a tight interval around a slope that is sampling noise (a solver that
    never reads R got "0.03 [0.03, 0.04]" vs R when each R drew its own prompts). The points of a
    fit vs R read the same prompts (cells.prompt_seed), so their errors are positively
    correlated: the interval is conservative for three equally spaced R (only the end points
    weigh in the slope), not guaranteed for more (docs/report.md, "Scaling laws").
Two points give the slope without an interval; fewer give no fit.

Rounding-dominated points. The floor is one number per dtype; rounding that grows with the
grid value (float32 ln-closed-form, whose R + m loses digits as R grows: a U-curve in R) lies far
above it. A point in a precision below float64 whose mean is more than ROUNDING_RATIO = 3 times
the float64 mean of the same series and cell is left out too and counted in `n_rounding`
(`rounding_dominated`; only where the runs hold both dtypes: a fit of lower-precision points
without their float64 twins counts them in `n_unchecked`, and the page says "rounding unchecked").

The interval is conservative: the wider of two intervals each meant to cover 95 % covers more,
and with 3 points the lack-of-fit term uses t with 1 degree of freedom (12.7). With three equally
spaced log v (the default R grid) the least-squares slope is the slope between the end points:
the middle point moves only the interval.

Float floor. A prediction rounded in a float format of machine epsilon eps (float32 1.19e-7,
float64 2.22e-16) is off by about eps × |prediction| even when its method is exact, so an MSE
vs OLS at or below (FLOOR_ULPS · eps)² y-units² (prompts of the default generator have
predictions of order 1) is rounding, not method error: such points are left out of the fit and
counted in `n_floor`. FLOOR_ULPS = 100 leaves room for the rounding that accumulates over a
forward pass (float32 ols lands near 1e-14, far below its floor 1.4e-10).
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy import stats

FLOOR_ULPS = 100
EPS = {"float16": 9.77e-4, "bfloat16": 7.81e-3, "float32": 1.19e-7, "float64": 2.22e-16}
LEVEL = 0.95
ROUNDING_RATIO = 3.0  # a float32 mean this many times its float64 twin's is rounding-dominated


def float_floor(dtype: str) -> float:
    """(FLOOR_ULPS · eps(dtype))² in y-units²; the float64 floor for an unknown dtype name."""
    return (FLOOR_ULPS * EPS.get(str(dtype), EPS["float64"])) ** 2


def fit_exponent(v, mse, dtype: str, se=None, rounding=None) -> dict:
    """Fit MSE ∝ v^p over the points above the float floor of `dtype`.

    Args:
        v: grid values (R or N), positive. mse: mean MSE vs OLS at those values (y units²).
        se: the standard errors of those means (y units²; None or NaN: that term of the interval
            is left out, as for tables from before the column).
        rounding: per point, whether it is rounding-dominated (rounding_dominated; None: none is).
    Returns:
        {"exponent", "ci_low", "ci_high", "n_points" (used), "n_floor" (left out: at or below the
        floor), "n_rounding" (left out: rounding-dominated), "n_nan" (left out: no finite MSE, e.g.
        a solver that answered no prompt)}; exponent NaN when fewer than 2 points remain, interval
        NaN when fewer than 3.
    """
    v, m = np.asarray(v, dtype=float), np.asarray(mse, dtype=float)
    usable = np.isfinite(v) & (v > 0) & np.isfinite(m)
    above = usable & (m > float_floor(dtype))
    good = above & ~(np.asarray(rounding, dtype=bool) if rounding is not None else np.zeros_like(above))
    out = {"exponent": math.nan, "ci_low": math.nan, "ci_high": math.nan, "n_points": int(good.sum()),
           "n_floor": int((usable & ~above).sum()), "n_rounding": int((above & ~good).sum()),
           "n_nan": int((~usable).sum())}
    if good.sum() < 2 or len(set(v[good])) < 2:
        return out
    lx, ly = np.log(v[good]), np.log(m[good])
    fit = stats.linregress(lx, ly)
    out["exponent"] = float(fit.slope)
    if good.sum() >= 3:
        t = float(stats.t.ppf(0.5 + LEVEL / 2, good.sum() - 2))
        # lack of fit; linregress gives stderr NaN for points on a flat line (r = 0 / 0): they fit it exactly
        half = t * (0.0 if np.ptp(ly) == 0 else fit.stderr)
        s_log = (np.asarray(se, dtype=float)[good] if se is not None else np.full(good.sum(), np.nan)) / m[good]
        if np.isfinite(s_log).all():  # sampling: each point's own error, propagated to the slope
            dx = lx - lx.mean()
            z = float(stats.norm.ppf(0.5 + LEVEL / 2))
            half = max(half, z * math.sqrt(float((dx**2 * s_log**2).sum())) / float((dx**2).sum()))
        out["ci_low"], out["ci_high"] = fit.slope - half, fit.slope + half
    return out


def rounding_dominated(summary: pd.DataFrame) -> pd.Series:
    """Per summary row: a mean in a lower precision than float64 more than ROUNDING_RATIO times the
    float64 mean of the same series and cell, so mostly its rounding, not its method (the float
    floor is one number per dtype and misses rounding that grows with R: float32 ln-closed-form at
    R = 1000 reads 2.3e-9 against 7.2e-11 in float64, and the fit through it gave "-3.06" for a
    U-curve; found by a review). False where the cell has no float64 row (rounding_unchecked)."""
    return (summary["dtype"] != "float64") & (summary["mse_vs_ols"] > ROUNDING_RATIO * _float64_twin(summary))


def rounding_unchecked(summary: pd.DataFrame) -> pd.Series:
    """Per summary row: in a lower precision than float64 with no float64 row of the same series and
    cell, so rounding_dominated cannot tell (a float32-only run's U-curve in R went into the fit
    unremarked; found by a review)."""
    return (summary["dtype"] != "float64") & _float64_twin(summary).isna()


def _float64_twin(summary: pd.DataFrame) -> pd.Series:
    """Per summary row: the float64 mean MSE vs OLS of the same series and cell (NaN: none)."""
    cell = ["series", "solver_params", "prompts", "N", "noise", "R", "device", "d", "ood"]
    cell = [c for c in cell if c in summary]
    ref = summary[summary["dtype"] == "float64"].groupby(cell, dropna=False)["mse_vs_ols"].first()
    keys = pd.MultiIndex.from_frame(summary[cell]) if len(cell) > 1 else pd.Index(summary[cell[0]])
    return pd.Series(ref.reindex(keys).to_numpy(), index=summary.index)


def scaling_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Every fit: one row per (series, vs ∈ {R, N}, the other grid axes).

    Args:
        summary: report.aggregate output (mse_vs_ols per series and cell), optionally with
            report.with_failed_points' rows (failed = True: every cell of the point errored or was
            skipped), which are no data but are counted (`n_failed`): a fit through the ok points
            that remain read like a full one (a review).
    Returns:
        columns series, solver, solver_params, vs, N, noise, R, dtype, device, d, ood (the fixed
        axes; the fitted axis is NaN), exponent, ci_low, ci_high, n_points, n_floor, n_rounding,
        n_unchecked (points of a lower precision with no float64 twin: rounding not checked), n_nan,
        n_failed, max_mse.
    """
    rows = []
    keys = ["series", "solver", "solver_params", "prompts", "N", "noise", "R", "dtype", "device", "d", "ood"]
    failed = summary["failed"].astype(bool) if "failed" in summary else pd.Series(False, index=summary.index)
    ok = summary[~failed]  # (a failed row is no data: it is not its twin's float64 reference either)
    summary = summary.assign(_failed=failed, _rounding=rounding_dominated(ok).reindex(summary.index, fill_value=False),
                             _unchecked=rounding_unchecked(ok).reindex(summary.index, fill_value=False))
    for vs in ("R", "N"):
        fixed = [k for k in keys if k != vs]
        for key, every in summary.groupby(fixed, dropna=False, sort=True):
            if every[vs].nunique() < 2:
                continue
            g = every[~every["_failed"]]
            if g.empty:  # no ok point: nothing to fit (every cuda cell skipped without a GPU doubled the table)
                continue
            row = dict(zip(fixed, key), vs=vs, **{vs: math.nan})
            se = g["mse_vs_ols_se"] if "mse_vs_ols_se" in g else None
            row.update(fit_exponent(g[vs], g["mse_vs_ols"], key[fixed.index("dtype")], se, g["_rounding"]))
            row["n_unchecked"] = int(g["_unchecked"].sum())
            row["n_failed"] = int(every["_failed"].sum())
            row["max_mse"] = float(g["mse_vs_ols"].max())
            rows.append(row)
    cols = [*keys, "vs", "exponent", "ci_low", "ci_high", "n_points", "n_floor", "n_rounding", "n_unchecked", "n_nan",
            "n_failed", "max_mse"]
    return pd.DataFrame(rows, columns=cols).drop(columns="prompts")


def scaling_at(fits: pd.DataFrame, setting: dict, order: list[str]) -> pd.DataFrame:
    """The page's table: per series and dtype, "p [low, high] (n)" vs R (at setting's N, noise,
    device, d, ood) and vs N (at its R, noise, device, d, ood); "at float floor" when every point
    with a finite MSE is at the float floor, "no finite MSE" when none has one; "k failed" counts
    points whose every cell errored or was skipped, and a series with no fit at the setting says
    so ("no fit: fewer than 2 R values with ok cells here": one R there, no cell there, or every
    cell but one value's failed)."""
    def text(r, vs: str) -> str:
        if r is None:
            return f"no fit: fewer than 2 {vs} values with ok cells here"
        nan = ", ".join(t for t in (f"{r['n_nan']} NaN" if r["n_nan"] else "",
                                    f"{r['n_failed']} failed" if r.get("n_failed", 0) else "") if t)  # (older csv)
        rounding = f"{r['n_rounding']} rounding" if r.get("n_rounding", 0) else ""  # (a scaling.csv of before it)
        if not math.isfinite(r["exponent"]):
            if r["n_points"] == 0:
                what = ("rounding-dominated" if r.get("n_rounding", 0) else "at float floor" if r["n_floor"]
                        else "no finite MSE")
                return f"{what} ({nan})" if nan and (r["n_floor"] or r.get("n_failed", 0)) else what
            return f"({r['n_points']} point above floor{', ' + rounding if rounding else ''}{', ' + nan if nan else ''})"
        ci = f" [{r['ci_low']:.2f}, {r['ci_high']:.2f}]" if math.isfinite(r["ci_low"]) else ""
        dropped = "".join(f", {d}" for d in (f"{r['n_floor']} at floor" if r["n_floor"] else "", rounding, nan) if d)
        unchecked = ", rounding unchecked: no float64 run" if r.get("n_unchecked", 0) else ""  # (older scaling.csv)
        return f"{r['exponent']:.2f}{ci} ({r['n_points']} pts{dropped}{unchecked})"

    def pick(df, vs, axes):
        m = df["vs"] == vs
        for a in axes:
            v = setting[a]
            m &= df[a].isna() if isinstance(v, float) and math.isnan(v) else df[a] == v
        return df[m]

    by_r = pick(fits, "R", ("N", "noise", "device", "d", "ood"))
    by_n = pick(fits, "N", ("R", "noise", "device", "d", "ood"))
    rows = []
    for s in order:
        for dtype in sorted(set(fits.loc[fits["series"] == s, "dtype"])):
            r = by_r[(by_r["series"] == s) & (by_r["dtype"] == dtype)]
            n = by_n[(by_n["series"] == s) & (by_n["dtype"] == dtype)]
            if r.empty and n.empty:
                continue
            rows.append({"series": s, "dtype": dtype,
                         "exponent vs R": text(r.iloc[0] if len(r) else None, "R"),
                         "exponent vs N": text(n.iloc[0] if len(n) else None, "N")})
    return pd.DataFrame(rows, columns=["series", "dtype", "exponent vs R", "exponent vs N"])
