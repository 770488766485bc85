"""Mechanism section of the report: per solver, the relative error under x shift and x scale
(the out-of-distribution rows of the run) and a verdict (docs/report.md, "Mechanism").

It reads stored result rows only. A run with an `ood` column holds, beside the in-distribution
rows (ood = "none"), rows evaluated on transformed prompts (prompts/ood.py): "x-shift:T" (x and
u -> x + T, y unchanged), "x-scale:S" (x and u -> S·x, y unchanged), "student-t:NU", "outliers:F". The x
transforms leave the OLS prediction unchanged, so a method that computes OLS is invariant to them.

Relative error = MSE vs OLS / E[(a + b u)^2], the second moment of the noise-free answer of the
in-distribution prompt generator (a run's own `rel_mse_vs_ols` column replaces it where there is
one): E[(a + b u)^2] = E[a^2] + 2 E[a] E[b] E[u] + E[b^2] E[u^2], computed from the run's `prompts`
column (normal: loc^2 + scale^2; uniform U[loc, loc + scale]: loc^2 + loc·scale + scale^2 / 3);
none for CSV prompts, whose rows are left out (ood_rows). It is not E[(OLS prediction)^2] of the
transformed prompts: the x transforms leave that equal to the denominator, but under student-t
noise and outliers the OLS prediction's second moment is larger (student-t:3: about 4, as
E[u^2] = 3; outliers:0.1: about 6; against 2 for the default generator at N = 20, measured over
10^5 prompts of prompts/ood.py), so those columns are MSE vs OLS in units of the
in-distribution signal, shown and not judged.

A cell is one grid point (N, noise, R, dtype, device, d, prompt source) of a series and one OOD
value; its relative error is the mean over the cell's seeds and runs. A series is read only at
the grid points where it has OOD rows (its in-distribution cells elsewhere, e.g. of another run
published alongside, are not its "none"). The table shows per OOD value the largest relative
error over those cells that have one, and `unmeasured_cells` counts the cells without one (the
cell errored, or answered NaN / inf on a well-posed prompt: such a cell fails the test). The verdict is judged cell by cell, on the x maps only, with the two
thresholds of the mechanism study's success criterion (docs/mechanism.md), which judges only x + 5
≤ 0.01 and x × 10 ≤ 0.05, applied here to every shift with |T| ≤ 5 and every scale in [0.1, 10]:
a model can meet the success criterion and read "neither" here (the shipped trained-l1 reads
0.052 on x × 0.1 in results/ood, against the limit 0.05; such a score moves by ±20 % between
prompt draws). The full behavioural
fingerprint of icl_bench.analysis.fingerprint, which re-runs a solver on y maps as well and
normalises by var(OLS), not by the signal power below, is `icl-bench analyze`'s:
    closed-form-like  every x_shift cell with |T| ≤ 5 has relative error ≤ SHIFT_TOL and every
                      x_scale cell with 0.1 ≤ S ≤ 10 has ≤ SCALE_TOL (invariant, like OLS);
    GD-like           not invariant, and in every such cell its error is within GD_BAND decades
                      of the `gd` baseline's in the cell of the same grid point and map, for the
                      gd series at the same steps (the closest steps otherwise); a solver without
                      a steps parameter (a trained model) is compared with the gd series closest
                      in error (smallest mean |log10 ratio| over the cells both have);
    neither           otherwise;  "no OOD rows" when the solver has no such cell, "no verdict" when
                      none of them has an error (every cell errored or answered NaN / inf).
"""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd

from icl_bench.report.sources import source_labels

SHIFT_TOL, SCALE_TOL, GD_BAND = 0.01, 0.05, 1.0
GRID = ("N", "noise", "R", "dtype", "device", "d", "prompts")  # a cell: one value of each, per series and OOD value
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


def _power(prompts: pd.Series) -> pd.Series:
    """signal_power per row (float; NaN for CSV prompts), each distinct source parsed once."""
    return prompts.map({p: signal_power(p) for p in prompts.unique()}).astype(float)


def ood_rows(table: pd.DataFrame) -> pd.DataFrame:
    """ok and errored rows of the x shift / scale / other OOD values with rel_err; empty without an
    `ood` column. A cell that errored, or whose solver answered NaN / inf on a well-posed prompt
    (n_nonfinite_well_posed > 0: its MSE is over the other prompts only), gets rel_err NaN, which
    fails its cell. Rows whose relative error has no denominator (CSV prompts: no generator, so no
    E[(a + b u)^2]) are left out: a NaN there says nothing of the solver."""
    if "ood" not in table.columns:
        return pd.DataFrame()
    ok = table[table["status"].isin(["ok", "error"])].copy()  # (skipped: never ran here, e.g. no GPU)
    if not (ok["status"] == "ok").any():  # e.g. every cell skipped (a cuda grid on a CPU machine)
        return ok.iloc[:0].assign(rel_err=pd.Series(dtype=float), transform=pd.Series(dtype=object),
                                  amount=pd.Series(dtype=float))
    power = _power(ok["prompts"])
    ok["rel_err"] = ok["mse_vs_ols"].astype(float) / power
    if "rel_mse_vs_ols" in ok.columns:  # a run's own relative error, where it has one
        ok["rel_err"] = ok["rel_mse_vs_ols"].astype(float).where(ok["rel_mse_vs_ols"].notna(), ok["rel_err"])
    if "n_nonfinite_well_posed" in ok.columns:
        ok.loc[ok["n_nonfinite_well_posed"].fillna(0) > 0, "rel_err"] = math.nan
    ok.loc[ok["status"] == "error", "rel_err"] = math.nan
    judged = np.isfinite(power.to_numpy())
    if "rel_mse_vs_ols" in ok.columns:
        judged |= ok["rel_mse_vs_ols"].notna().to_numpy()
    ok = ok[judged]
    parsed = [parse_ood(v) for v in ok["ood"]]
    ok["transform"], ok["amount"] = [p[0] for p in parsed], [p[1] for p in parsed]
    return ok


def _steps(params: str):
    d = json.loads(params) if params else {}
    return d.get("steps") if isinstance(d, dict) else None


def _cells(rows: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """Mean relative error per series, grid point and OOD value (over the seeds and runs of that
    cell), kept only at the grid points where the series has OOD rows: in-distribution cells of
    other runs published alongside are not its "none". Returns the cells, with a `point` column
    (the values of GRID as text, NaN as "nan"), and the GRID columns the rows have."""
    grid = [c for c in GRID if c in rows.columns]
    rows = rows.assign(point=list(zip(*(rows[c].astype(str) for c in grid))) if grid else [()] * len(rows))
    keys = ["series", "solver", "solver_params", "point"]
    has_ood = rows.assign(o=rows["ood"] != "none").groupby(keys, sort=False)["o"].transform("any")
    cells = (rows[has_ood].groupby([*keys, "ood"], sort=False)["rel_err"]  # a seed without a finite answer
             .agg(lambda s: s.mean(skipna=False)).reset_index())  # makes its cell NaN: not averaged away
    return cells, grid


def verdicts(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per series, in series order (report.add_series: by solver, then parameter values,
    numbers numerically): per OOD value (columns named by the value) the largest relative error
    over the series' cells (_cells), and the verdict with its reason, judged cell by cell (see the
    module docstring). `rows` from ood_rows()."""
    if rows.empty:
        return pd.DataFrame()
    cells, grid = _cells(rows)
    idx = ["series", "solver", "solver_params"]
    wide = cells.pivot_table(index=idx, columns="ood", values="rel_err", aggfunc="max",  # over the measured cells:
                             dropna=False).reset_index()  # one errored cell blanked every column (a review)
    unmeasured = cells.assign(u=cells["rel_err"].isna()).groupby(idx, sort=False)["u"].sum().rename("unmeasured_cells")
    wide = wide.merge(unmeasured.reset_index(), on=idx, how="left")
    wide = rows.drop_duplicates("series")[idx].merge(wide, on=idx, how="left")  # series without OOD rows: blank
    if "series_rank" in rows:  # the report's series order (numbers numerically: steps 1, 4, 16), not text order
        rank = rows.groupby("series")["series_rank"].min()
        wide = wide.sort_values("series", key=lambda s: s.map(rank), kind="stable").reset_index(drop=True)
    ood_cols = sorted([c for c in wide.columns if c not in (*idx, "unmeasured_cells")], key=_ood_order)
    by_series = {s: dict(zip(zip(g["point"], g["ood"]), g["rel_err"])) for s, g in cells.groupby("series", sort=False)}
    varied = [a for i, a in enumerate(grid) if len({p[i] for p in cells["point"]}) > 1]
    src = source_labels(cells["point"].map(lambda p: p[grid.index("prompts")]) if "prompts" in grid else [])
    shown = lambda a, v: src.get(v) or v if a == "prompts" else f"{a}={v}"  # noqa: E731 (a source by its label)
    where = lambda key: key[1] + "".join(f", {shown(a, key[0][grid.index(a)])}" for a in varied)  # noqa: E731
    gd = {r["series"]: (_steps(r["solver_params"]), by_series[r["series"]])
          for _, r in wide[wide["solver"] == "gd"].iterrows() if r["series"] in by_series}  # gd with OOD rows
    out = []
    for _, r in wide.iterrows():
        v, why = _verdict(r, by_series.get(r["series"], {}), gd, where)
        out.append({"series": r["series"], **{c: r[c] for c in ood_cols}, "unmeasured_cells": r["unmeasured_cells"],
                    "verdict": v, "why": why})
    return pd.DataFrame(out)


def _ood_order(name: str):
    t, a = parse_ood(name)
    return ({"none": 0, "x_shift": 1, "x_scale": 2}.get(t, 3), t, a if a == a else 0.0)


def _tol(ood: str) -> float:
    """SHIFT_TOL / SCALE_TOL for an x shift / scale within the judged range; NaN for other values."""
    t, a = parse_ood(ood)
    if t == "x_shift" and abs(a) <= MAX_SHIFT:
        return SHIFT_TOL
    return SCALE_TOL if t == "x_scale" and SCALE_RANGE[0] <= a <= SCALE_RANGE[1] else math.nan


def _decades(mine: dict, ref: dict) -> dict:
    """log10(mine / ref) per cell (grid point, OOD value) both have, finite and positive."""
    return {k: math.log10(v / ref[k]) for k, v in mine.items()
            if 0 < ref.get(k, math.nan) < math.inf and 0 < v < math.inf}


def _reference(steps, tested: dict, gd: dict) -> tuple[str | None, str]:
    """The gd series to compare with and why: at the same steps (the closest steps otherwise, ties
    to the one closest in error); for a solver without steps (a trained model) the gd series whose
    errors are closest, the smallest mean |log10 ratio| over the cells both have."""
    dist = {s: np.mean(np.abs(list(d.values()))) for s, (_, c) in gd.items() if (d := _decades(tested, c))}
    if not dist:
        return None, ""
    ks = {s: gd[s][0] for s in dist if isinstance(gd[s][0], (int, float)) and gd[s][0] > 0}
    if isinstance(steps, (int, float)) and steps > 0 and ks:
        best = min(ks, key=lambda s: (abs(math.log(ks[s] / steps)), dist[s]))
        return best, "the same steps" if ks[best] == steps else "the closest steps"
    best = min(dist, key=dist.get)
    return best, f"the gd setting closest in error, mean {dist[best]:.2g} decades"


def _verdict(r: pd.Series, mine: dict, gd: dict, where) -> tuple[str, str]:
    """(verdict, reason) of one series from its cells {(grid point, OOD value): relative error}."""
    tested = {k: v for k, v in mine.items() if not math.isnan(_tol(k[1]))}
    if not tested:
        return "no OOD rows", "no x-shift / x-scale cells in the judged range for this solver"
    if all(math.isnan(v) for v in tested.values()):  # nothing measured: "neither" read as a finding (an inf
        return "no verdict", (f"none of its {len(tested)} x-shift / x-scale cells has a relative error: each "  # is one)
                              "errored or answered NaN / inf on a well-posed prompt (failures.md, the headline's counts)")
    # an inf or NaN error (overflow, no finite answer) fails its cell: it is not left out of the test
    bad = {k: v / _tol(k[1]) if math.isfinite(v) else math.inf for k, v in tested.items() if not v <= _tol(k[1])}
    if not bad:
        return "closed-form-like", (f"each of its {len(tested)} x-shift / x-scale cells (grid point × map) within "
                                    f"tolerance: ≤ {SHIFT_TOL} under shifts |T| ≤ {MAX_SHIFT:g}, ≤ {SCALE_TOL} under "
                                    f"scales {SCALE_RANGE[0]:g} ≤ S ≤ {SCALE_RANGE[1]:g}")
    worst = max(bad, key=bad.get)
    w = tested[worst]
    not_inv = (f"not invariant ({where(worst)}: {w:.2g} > {_tol(worst[1])})" if w == w else
               f"not invariant ({where(worst)}: no error measured, the cell errored or answered NaN on a well-posed prompt)")
    home = mine.get((worst[0], "none"), math.nan)  # the same grid point, unmapped prompts
    if home == home and not home <= _tol(worst[1]) and w <= 2 * home:  # as inaccurate before any map: no
        not_inv = (f"inaccurate in distribution too ({where((worst[0], 'none'))}: {home:.2g} > {_tol(worst[1])}), "
                   "so its errors under the maps test no invariance")  # sign of a map (it read "not invariant": a tryout)
    if r["solver"] == "gd":
        return "GD-like", f"the gd baseline itself ({not_inv})"
    ref, how = _reference(_steps(r["solver_params"]), tested, gd)
    if ref is None:  # no cell where both errors are finite and positive
        shared = any(k in c for _, c in gd.values() for k in tested)
        return "neither", f"{not_inv}; " + ("no cell where its error and gd's are both finite and positive to compare"
                                            if shared else "no gd cell at its grid points to compare with")
    broken = [k for k, v in tested.items() if not math.isfinite(v) and 0 < gd[ref][1].get(k, math.nan) < math.inf]
    if broken:  # inf / NaN where gd's error is finite: infinitely far from it, not left out
        return "neither", (f"{not_inv} and not GD-like: {where(broken[0])} is {tested[broken[0]]:.2g} where "
                           f"{ref} ({how}) has {gd[ref][1][broken[0]]:.2g}")
    dec = _decades(tested, gd[ref][1])
    far = max(dec, key=lambda k: abs(dec[k]))
    if abs(dec[far]) <= GD_BAND:
        return "GD-like", (f"{not_inv}; within {GD_BAND:g} decade of {ref} ({how}) in each of the "
                           f"{len(dec)} x-shift / x-scale cells both have at the same grid point")
    return "neither", (f"{not_inv} and not within {GD_BAND:g} decade of {ref} ({how}) at the same grid point "
                       f"({where(far)}: {abs(dec[far]):.1f} decades)")


def section(table: pd.DataFrame) -> dict:
    """{"status": text, "table": DataFrame, "source": where the verdict came from}; the status says
    when the runs have no `ood` column or no OOD rows (the section is then empty)."""
    if "ood" not in table.columns:
        return {"status": "These runs have no 'ood' column: they were run without the out-of-distribution axis, "
                          "so there are no shift / scale rows to judge a mechanism from.",
                "table": pd.DataFrame(), "source": ""}
    rows = ood_rows(table)
    csv = ~np.isfinite(_power(table["prompts"].fillna("").astype(str))) if "prompts" in table \
        else pd.Series(False, index=table.index)
    csv_note = (" Rows of CSV prompts are left out: there is no generator to take E[(a + b·u)²] from."
                if bool((csv & (table["ood"] != "none")).any()) else "")
    if rows.empty or (rows["ood"] == "none").all():
        only_none = bool((table["ood"] == "none").all())
        why = ("every row is in-distribution (ood = none): the matrix has no out-of-distribution axis. "
               "`icl-bench run --config ood` adds x-shift / x-scale rows to judge solvers from"
               if only_none else "no ok out-of-distribution rows with a relative error")
        return {"status": f"The runs have an 'ood' column but {why}.{csv_note}",
                "table": pd.DataFrame(), "source": ""}
    tab = verdicts(rows)
    source = (f"thresholds of icl_bench/report/mechanism.py, applied in every cell of an x shift with |T| ≤ "
              f"{MAX_SHIFT:g} or an x scale with {SCALE_RANGE[0]:g} ≤ S ≤ {SCALE_RANGE[1]:g} (the x maps only: they "
              "leave the OLS answer unchanged; larger maps and the student-t and outlier columns are shown, not "
              "judged); an inf or NaN error fails its cell, as does an errored cell or a NaN answer on a well-posed "
              "prompt")
    status = (f"{rows['ood'].nunique()} OOD values, {tab.shape[0]} series. Each entry is the largest relative error "
              "over the series' cells at the grid points where it has OOD rows (a cell: one N, noise, R, dtype, device, "
              "d and prompt source; mean over its seeds and runs); relative error = MSE vs OLS / E[(a + b·u)²], the "
              "second moment of the noise-free answer of the in-distribution generator. A cell that errored, or "
              f"whose solver answered NaN on a well-posed prompt, fails.{csv_note}")
    return {"status": status, "table": tab, "source": source}
