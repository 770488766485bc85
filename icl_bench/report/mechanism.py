"""Mechanism section of the report: per solver, the relative error under x shift and x scale
(the out-of-distribution rows of the run) and a verdict (docs/report.md, "Mechanism").

It reads stored result rows only. A run with an `ood` column holds, beside the in-distribution
rows (ood = "none"), rows evaluated on transformed prompts (prompts/ood.py): "x-shift:T" (x and
u -> x + T, y unchanged), "x-scale:S" (x and u -> S·x, y unchanged), "student-t:NU", "outliers:F". The x
transforms leave the OLS prediction unchanged, so a method that computes OLS is invariant to them.

Relative error = MSE vs OLS / E[(OLS prediction)^2] (the run's `rel_mse_vs_ols` column when it
has one). Without that column the denominator is the second moment of the noise-free answer of
the prompt generator, E[(a + b u)^2] = E[a^2] + 2 E[a] E[b] E[u] + E[b^2] E[u^2], computed from
the run's `prompts` column (normal: loc^2 + scale^2; uniform U[loc, loc + scale]:
loc^2 + loc·scale + scale^2 / 3); the x transforms do not change it. NaN for CSV prompts.

Verdict from the stored rows (thresholds of the mechanism study's success criterion, +5 shift
≤ 0.01 and x×10 ≤ 0.05, docs/mechanism.md; the full behavioural fingerprint of
icl_bench.analysis.fingerprint, which re-runs a solver on y maps as well, is `icl-bench analyze`'s):
    closed-form-like  every x_shift with |T| ≤ 5 has relative error ≤ SHIFT_TOL and every x_scale
                      with 0.1 ≤ S ≤ 10 has ≤ SCALE_TOL (invariant, like OLS);
    GD-like           not invariant, and its errors are within GD_BAND decades of the `gd`
                      baseline's at the same steps (or, without steps, the closest K) on the
                      same prompt source, on every shift / scale row that both have;
    neither           otherwise;  "no OOD rows" when the solver has none.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd

SHIFT_TOL, SCALE_TOL, GD_BAND = 0.01, 0.05, 1.0
MAX_SHIFT, SCALE_RANGE = 5.0, (0.1, 10.0)


def _moments(d: dict) -> tuple[float, float]:
    """(mean, second moment) of a Dist dict (prompts.Dist: normal or uniform, loc, scale)."""
    loc, scale = float(d.get("loc", 0.0)), float(d.get("scale", 1.0))
    if d.get("dist", "normal") == "uniform":
        return loc + scale / 2, loc * loc + loc * scale + scale * scale / 3
    return loc, loc * loc + scale * scale


def signal_power(prompts: str) -> float:
    """E[(a + b u)^2] of a generator prompt source (the `prompts` column); NaN for CSV data."""
    try:
        spec = json.loads(prompts) if prompts else {}
    except ValueError:
        return math.nan
    if not isinstance(spec, dict) or "csv" in spec:
        return math.nan
    (ma, a2), (mb, b2), (mu, u2) = (_moments(spec.get(k, {})) for k in ("intercept", "slope", "x"))
    return a2 + 2 * ma * mb * mu + b2 * u2


def parse_ood(value: str) -> tuple[str, float]:
    """("x_shift", 5.0) for the matrix's "x-shift:5" (prompts/ood.py) or "x_shift=5"; (name, NaN)
    for values without an amount ("none")."""
    text = str(value).replace("-", "_", 1) if not str(value).startswith("-") else str(value)
    name, _, num = text.replace(":", "=", 1).partition("=")
    try:
        return name, float(num) if num else math.nan
    except ValueError:
        return name, math.nan


def ood_rows(table: pd.DataFrame) -> pd.DataFrame:
    """ok rows of the x shift / scale / other OOD values with rel_err; empty without an `ood` column."""
    if "ood" not in table.columns:
        return pd.DataFrame()
    ok = table[table["status"] == "ok"].copy()
    if ok.empty:  # e.g. every cell skipped (a cuda grid on a CPU machine): nothing to divide
        return ok.assign(rel_err=pd.Series(dtype=float), transform=pd.Series(dtype=object), amount=pd.Series(dtype=float))
    if "rel_mse_vs_ols" in ok.columns:
        ok["rel_err"] = ok["rel_mse_vs_ols"].astype(float)
    else:
        power = {p: signal_power(p) for p in ok["prompts"].unique()}
        ok["rel_err"] = ok["mse_vs_ols"].astype(float) / ok["prompts"].map(power)
    parsed = [parse_ood(v) for v in ok["ood"]]
    ok["transform"], ok["amount"] = [p[0] for p in parsed], [p[1] for p in parsed]
    return ok


def _steps(params: str):
    d = json.loads(params) if params else {}
    return d.get("steps") if isinstance(d, dict) else None


def verdicts(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per series, in series order (report.add_series: by solver, then parameter values,
    numbers numerically): mean relative error per OOD value (columns named by the value) and the
    verdict with its reason (see the module docstring). `rows` from ood_rows()."""
    if rows.empty:
        return pd.DataFrame()
    index = ["series", "solver", "solver_params", *(["prompts"] if "prompts" in rows else [])]
    mean = rows.groupby([*index, "ood"], sort=False)["rel_err"].mean().reset_index()
    wide = mean.pivot_table(index=index, columns="ood", values="rel_err").reset_index()
    if "series_rank" in rows:  # the report's series order (numbers numerically: steps 1, 4, 16), not text order
        rank = rows.groupby("series")["series_rank"].min()
        wide = wide.sort_values("series", key=lambda s: s.map(rank), kind="stable").reset_index(drop=True)
    ood_cols = sorted([c for c in wide.columns if c not in index], key=_ood_order)
    gd = wide[wide["solver"] == "gd"]
    out = []
    for _, r in wide.iterrows():  # compared with gd on the same prompt source (series of two sources differ)
        v, why = _verdict(r, ood_cols, gd[gd["prompts"] == r["prompts"]] if "prompts" in index else gd)
        out.append({"series": r["series"], **{c: r[c] for c in ood_cols}, "verdict": v, "why": why})
    return pd.DataFrame(out)


def _ood_order(name: str):
    t, a = parse_ood(name)
    return ({"none": 0, "x_shift": 1, "x_scale": 2}.get(t, 3), t, a if a == a else 0.0)


def _verdict(r: pd.Series, cols: list[str], gd: pd.DataFrame) -> tuple[str, str]:
    shift = [c for c in cols if parse_ood(c)[0] == "x_shift" and abs(parse_ood(c)[1]) <= MAX_SHIFT]
    scale = [c for c in cols if parse_ood(c)[0] == "x_scale" and SCALE_RANGE[0] <= parse_ood(c)[1] <= SCALE_RANGE[1]]
    tested = [c for c in shift + scale if np.isfinite(r[c])]
    if not tested:
        return "no OOD rows", "no finite x_shift / x_scale rows for this solver"
    bad = [c for c in tested if r[c] > (SHIFT_TOL if c in shift else SCALE_TOL)]
    if not bad:
        return "closed-form-like", f"relative error ≤ {SHIFT_TOL} under shifts, ≤ {SCALE_TOL} under scales"
    if not gd.empty and r["solver"] != "gd":
        k = _steps(r["solver_params"])
        ks = {i: _steps(p) for i, p in zip(gd.index, gd["solver_params"])}
        best = min(ks, key=lambda i: abs(math.log((ks[i] or 1) / (k or 1))) if (ks[i] and k) else 0)
        ref = gd.loc[best]
        both = [c for c in tested if np.isfinite(ref.get(c, math.nan)) and ref[c] > 0 and r[c] > 0]
        if both and all(abs(math.log10(r[c] / ref[c])) <= GD_BAND for c in both):
            return "GD-like", f"within {GD_BAND:g} decade of {ref['series']} on {len(both)} OOD rows"
    elif r["solver"] == "gd":
        return "GD-like", "the gd baseline itself (not invariant)"
    return "neither", f"not invariant ({bad[0]}: {r[bad[0]]:.2g}) and not within {GD_BAND:g} decade of gd"


def section(table: pd.DataFrame) -> dict:
    """{"status": text, "table": DataFrame, "source": where the verdict came from}; the status says
    when the runs have no `ood` column or no OOD rows (the section is then empty)."""
    if "ood" not in table.columns:
        return {"status": "These runs have no 'ood' column: they were run without the out-of-distribution axis, "
                          "so there are no shift / scale rows to judge a mechanism from.",
                "table": pd.DataFrame(), "source": ""}
    rows = ood_rows(table)
    if rows.empty or (rows["ood"] == "none").all():
        only_none = bool((table["ood"] == "none").all())
        why = ("every row is in-distribution (ood = none): the matrix has no out-of-distribution axis. "
               "`icl-bench run --config ood` adds x-shift / x-scale rows to judge solvers from"
               if only_none else "no ok out-of-distribution rows")
        return {"status": f"The runs have an 'ood' column but {why}.",
                "table": pd.DataFrame(), "source": ""}
    tab = verdicts(rows)
    source = "thresholds of icl_bench/report/mechanism.py on the stored x-shift / x-scale rows"
    return {"status": f"{rows['ood'].nunique()} OOD values, {tab.shape[0]} series.", "table": tab, "source": source}
