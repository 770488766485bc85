"""Aggregation: run folders -> the tables a paper or README shows (pandas).

A run folder is what `icl-bench run` writes: results.parquet (one row per cell) and metadata.json
(read and checked by load.py).
Several folders (other seeds, other machines) are stacked and aggregated together:

    summary   one row per (solver, solver_params, N, noise, R, dtype, device, prompts) over the
              cells with status "ok": mean MSE vs OLS with a 95 % confidence interval, mean MSE
              vs truth (with its CI), median throughput, number of seeds and prompts
    failures  every cell whose status is "error" or "skipped", with its message (never dropped)
    sparsity  solvers with weights: weight_sparsity and weight_l1 per solver, params and R
    headline  mean MSE vs OLS by solver (rows) x N (columns) at one representative setting; beside
              it the median squared error (the typical prompt's), which the heavy tail does not move

Confidence interval of a mean MSE ("over prompts and seeds"). Each cell row carries the mean
squared error m_i over its n_i prompts and that mean's standard error se_i = sd / sqrt(n_i)
(metrics.py). Rows of the same cell and seed from several runs saw the same prompts, so they are
averaged first (not counted twice); runs whose rows of one cell and seed differ in n_prompts, in
the CSV's bytes or in the solver's input files (load.REPEAT_SAME) did not, and are refused
(`load_runs`). Distinct seeds draw independent prompts, so all prompts of a group are one i.i.d.
sample: the pooled mean is m = sum(n_i m_i) / n with n = sum(n_i) (n_i the prompts the seed's
mean was taken over, where its prediction and the reference are finite: `scored`) and its
standard error se = sqrt(sum(n_i^2 se_i^2)) / n. The 95 % interval is taken for log(m) by the
delta method (se of log m ~ se / m) and mapped back: [m / f, m * f], f = exp(t * se / m), t the
0.975 quantile of Student's t with n - 1 degrees of freedom (scipy.stats). Squared errors are
skewed and heavy-tailed, so m +- t se would often reach below 0; the log interval stays positive.
Its coverage is below 95 % for heavy-tailed errors: 71-89 % of 4096-prompt cells held the true
mean (results/ci_coverage.md, docs/report.md). An m of exactly 0 gets [0, 0]. Runs written
before the runner stored standard errors give NaN intervals.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from icl_bench.bench.contract import ILL_ANSWERED, NO_ANSWER, WEIGHTS_BROKE
from icl_bench.errors import ConfigError
from icl_bench.report.load import AXES, BACKFILL, KEYS, check_repeats, load_run
from icl_bench.report.series import add_series, params_sort_key, series_order  # (also report.<name> for callers)
from icl_bench.report.sources import source_labels
from icl_bench.report.validate import at_value

LEVEL = 0.95  # confidence level of the intervals
COUNTS = ("n_nonfinite", "n_ill_posed", "n_nonfinite_well_posed")  # summed over seeds in the summary


def load_runs(paths) -> tuple[pd.DataFrame, dict[str, dict | None]]:
    """Stack several run folders. Returns (table, {run folder: metadata or None}).

    Raises:
        ConfigError: no folder given, or any folder is bad (see `load_run`).
    """
    paths = list(paths)
    if not paths:
        raise ConfigError("RUN_DIR: give at least one run folder")
    loaded = [load_run(p) for p in paths]
    table = pd.concat([t for t, _ in loaded], ignore_index=True)
    check_repeats(table)
    return add_series(table), {str(Path(p)): m for p, (_, m) in zip(paths, loaded)}


def scored(group: pd.DataFrame) -> pd.Series:
    """Per row, the prompts each error's mean was taken over: the well-posed prompts less the solver's
    non-finite answers there (failed_answers; metrics.py scores vs OLS, truth and target on the same
    prompts; a run from before the ill-posed counts: n_prompts - n_nonfinite)."""
    bad, of = failed_answers(group)
    return of - bad


def _pooled(group: pd.DataFrame, metric: str) -> pd.Series:
    """Pooled mean, standard error and 95 % CI of one metric over a group's per-seed rows
    (see the module docstring for the method)."""
    n = scored(group)  # each seed's mean is over the prompts it scored only
    group, n = group[n > 0], n[n > 0]  # a seed with no finite prediction has no mean to pool
    m = group[metric].astype(float)  # (mse_vs_target has no standard error: its mean alone)
    se = group[f"{metric}_se"].astype(float) if f"{metric}_se" in group else pd.Series(math.nan, index=group.index)
    total = n.sum()
    if not total > 0:
        return pd.Series({f"{metric}{s}": math.nan for s in ("", "_se", "_ci_low", "_ci_high")})
    mean = float((n * m).sum(skipna=False) / total)
    sem = float(np.sqrt(((n * se) ** 2).sum(skipna=False)) / total)
    t = float(stats.t.ppf(0.5 + LEVEL / 2, max(total - 1, 1)))
    if mean > 0:
        z = t * sem / mean  # huge only for standard errors the runner cannot write (a foreign table)
        f = (math.exp(z) if z < 700 else math.inf) if math.isfinite(sem) else math.nan
        low, high = mean / f, mean * f
    else:  # exactly 0 (every prompt exact) or NaN
        low = high = mean if sem == 0 or mean != mean else math.nan
    return pd.Series({metric: mean, f"{metric}_se": sem, f"{metric}_ci_low": low, f"{metric}_ci_high": high})


def aggregate(table: pd.DataFrame) -> pd.DataFrame:
    """The summary table: one row per KEYS over the "ok" cells (see the module docstring).

    Args:
        table: stacked result rows (load_runs).
    Returns:
        DataFrame with KEYS, "series", n_seeds, n_prompts and COUNTS summed over seeds
        (n_nonfinite NaN where a run from before it contributes; n_ill_posed and
        n_nonfinite_well_posed seed by seed, a seed of a run from before them counting each NaN
        as failed, NaN when no seed has them),
        mse_vs_ols (squared units of y) with _se, _ci_low, _ci_high; the same for mse_vs_truth;
        mse_vs_target (vs the query's observed y, pooled mean, no interval); abs_err_median (units
        of y: the median over a seed's prompts of |prediction - OLS|; with several seeds the median
        of theirs), prompts_per_s (median over every timed row, prompts
        per second). Sorted by KEYS.
    """
    ok = table[table["status"] == "ok"]
    cols = ["mse_vs_ols", "mse_vs_ols_se", "mse_vs_truth", "mse_vs_truth_se", "mse_vs_target", "abs_err_median",
            "n_prompts", *COUNTS]
    cols = [c for c in cols if c in ok.columns]
    if ok.empty:
        return pd.DataFrame(columns=[*KEYS, "series", "n_seeds", "n_prompts", "mse_vs_ols", "mse_vs_truth", "prompts_per_s"])
    # repeated runs of one cell and seed saw the same prompts: average them before pooling seeds
    per_seed = ok.groupby([*KEYS, "series", "series_rank", "seed"], dropna=False, sort=False)[cols].mean().reset_index()
    rows = []
    for key, g in per_seed.groupby([*KEYS, "series", "series_rank"], dropna=False, sort=True):
        row = dict(zip([*KEYS, "series", "series_rank"], key))
        row.update(n_seeds=int(g["seed"].nunique()), n_prompts=int(g["n_prompts"].sum()))
        if "n_nonfinite" in g:
            row["n_nonfinite"] = int(round(g["n_nonfinite"].sum())) if g["n_nonfinite"].notna().all() else math.nan
        if "n_ill_posed" in g and g["n_ill_posed"].notna().any():  # seed by seed: a seed of a run from before
            bad, of = failed_answers(g)  # the columns counts every NaN as failed and none as ill-posed
            row.update(n_ill_posed=int(round((g["n_prompts"] - of).sum())), n_nonfinite_well_posed=int(round(bad.sum())))
        for metric in ("mse_vs_ols", "mse_vs_truth"):
            row.update(_pooled(g, metric).to_dict())
        if "mse_vs_target" in g:  # vs the query's observed y (no standard error stored: the pooled mean only)
            row["mse_vs_target"] = float(_pooled(g, "mse_vs_target")["mse_vs_target"])
        if "abs_err_median" in g:  # a typical prompt's error, which the heavy tail does not move (median of seeds)
            row["abs_err_median"] = float(g["abs_err_median"].median())
        rows.append(row)
    summary = pd.DataFrame(rows)
    speed = ok.groupby([*KEYS, "series"], dropna=False)["prompts_per_s"].median().rename("prompts_per_s")
    return summary.merge(speed.reset_index(), on=[*KEYS, "series"], how="left")  # (series: an edited CSV's two)


def with_failed_points(summary: pd.DataFrame, table: pd.DataFrame) -> pd.DataFrame:
    """The summary for the error plots: every row with failed = False, plus a row with NaN metrics
    and failed = True for each KEYS point of a series with no ok cell there (every cell errored or
    was skipped). A line drawn through it breaks, so a failed N is a gap,
    not a straight line from its neighbours that reads as measured (found by a review)."""
    out = summary.assign(failed=False)
    if summary.empty or "series" not in table:
        return out
    bad = table[table["status"] != "ok"].drop_duplicates([*KEYS, "series"])[[*KEYS, "series", "series_rank"]]
    # (every series: gd_steps joins "flaky steps=2", failed at every cell, into the line of flaky,
    # which it must break; a review. The plots keep only failed rows inside a line: plot_gaps.gaps)
    seen = pd.MultiIndex.from_frame(summary[[*KEYS, "series"]].astype(str))
    bad = bad[~pd.MultiIndex.from_frame(bad[[*KEYS, "series"]].astype(str)).isin(seen)]
    if bad.empty:
        return out
    return pd.concat([out, bad.assign(failed=True, n_prompts=0, n_seeds=0)], ignore_index=True)


def failures(table: pd.DataFrame) -> pd.DataFrame:
    """Every cell that did not finish: status "error" or "skipped", with its message and run."""
    cols = ["run", "solver", "solver_params", *AXES, "seed", "status", "message"]
    bad = table.loc[table["status"] != "ok", cols]
    return _sorted_by_params(bad, ["solver", "solver_params", *AXES, "seed"]).reset_index(drop=True)


def _sorted_by_params(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """df sorted by `by`, solver_params compared by their values (numbers numerically)."""
    if df.empty:
        return df
    key = df["solver_params"].map(params_sort_key)
    rank = {k: i for i, k in enumerate(sorted(set(key)))}
    return (df.assign(_p=key.map(rank)).sort_values([c if c != "solver_params" else "_p" for c in by], kind="stable")
            .drop(columns="_p"))


def failure_summary(table: pd.DataFrame) -> pd.DataFrame:
    """failures() grouped by (solver, solver_params, status, message): number of cells and the
    grid values they cover (compact enough for markdown; failures() has every cell)."""
    bad = failures(table)
    if bad.empty:
        return pd.DataFrame(columns=["solver", "solver_params", "status", "message", "n_cells", *AXES])

    def values(s: pd.Series) -> str:
        nan = ["nan"] if s.isna().any() else []
        return ", ".join([str(v) for v in sorted(s.dropna().unique())] + nan)

    agg = {"n_cells": ("seed", "size"), **{a: (a, values) for a in AXES}}
    out = bad.groupby(["solver", "solver_params", "status", "message"], dropna=False).agg(**agg).reset_index()
    return _sorted_by_params(out, ["solver", "solver_params", "status", "message"]).reset_index(drop=True)


def no_answer_notes(table: pd.DataFrame) -> list[str]:
    """One line per solver with "ok" cells in which it answered no prompt (the runner's message
    "no finite prediction ..."): their MSE is NaN, and a NaN must come with its reason. Then one
    line per solver with "ok" cells in which it answered ill-posed prompts (ILL_ANSWERED), which
    every solver answers NaN: those answers are not scored, and the contract break is named; one
    per solver whose MSE vs OLS or its standard error overflowed to inf (a diverging gd: a mean of
    inf, or an interval of NaN, must come with its reason too); and one per solver whose weights()
    broke its contract or held NaN / inf (its weight columns are NaN)."""
    cell = [*KEYS, "seed"]  # a cell repeated by two run folders (or in two seeds' runs) is one cell each
    ok, message = table["status"] == "ok", table["message"].fillna("")
    label = "series" if "series" in table else "solver"  # (load_runs' tables have the series label)
    n_cells = lambda name: len(table[table[label] == name].drop_duplicates(cell))  # noqa: E731
    rows = table[ok & message.str.startswith(NO_ANSWER)]
    out = [f"{name}: {NO_ANSWER} (NaN / inf on every well-posed prompt) in {len(g.drop_duplicates(cell))} of "
           f"{n_cells(name)} cells; its MSE there is NaN" for name, g in rows.groupby(label, sort=False)]
    rows = table[ok & message.str.contains(ILL_ANSWERED, regex=False)]
    out += [f"{name}: {ILL_ANSWERED} in {len(g.drop_duplicates(cell))} of {n_cells(name)} cells (every solver "
            "answers NaN there; those answers are not scored)" for name, g in rows.groupby(label, sort=False)]
    big = lambda c: table[c].astype(float).abs() == math.inf if c in table else False  # noqa: E731
    rows = table[ok & big("mse_vs_ols")]  # a diverging solver's finite answers
    out += [f"{name}: its squared errors overflowed to inf (answers beyond ~1e154: it diverged) in "
            f"{len(g.drop_duplicates(cell))} of {n_cells(name)} cells; its mean MSE there is inf"
            for name, g in rows.groupby(label, sort=False)]
    rows = table[ok & big("mse_vs_ols_se") & ~big("mse_vs_ols")]  # the squares of squared errors beyond ~1e77
    out += [f"{name}: the standard error of its MSE overflowed to inf (squared errors beyond ~1e154: it diverged) "
            f"in {len(g.drop_duplicates(cell))} of {n_cells(name)} cells; its interval there is NaN"
            for name, g in rows.groupby(label, sort=False)]
    rows = table[ok & message.str.contains(WEIGHTS_BROKE, regex=False)]  # (runner.run_cell: weight columns NaN)
    return out + [f"{name}: its weights() gave no weight sparsity in {len(g.drop_duplicates(cell))} of {n_cells(name)} "
                  f"cells, where it is NaN ({g.message.iloc[0]})" for name, g in rows.groupby(label, sort=False)]


def sparsity(table: pd.DataFrame) -> pd.DataFrame:
    """Solvers with weights: weight_sparsity (fraction of entries < 1e-3 max|w|; mean, min, max
    over cells) and weight_l1 (mean) per solver, solver_params and R. Empty if no solver has weights."""
    ok = table[(table["status"] == "ok") & np.isfinite(table["weight_sparsity"].astype(float))]
    cols = ["series_rank", "solver", "solver_params", "series", "R"]
    if ok.empty:
        return pd.DataFrame(columns=[*cols, "n_cells", "weight_sparsity", "weight_l1"])
    return ok.groupby(cols, dropna=False).agg(
        n_cells=("weight_sparsity", "size"), weight_sparsity=("weight_sparsity", "mean"),
        weight_sparsity_min=("weight_sparsity", "min"), weight_sparsity_max=("weight_sparsity", "max"),
        weight_l1=("weight_l1", "mean")).reset_index().drop(columns="series_rank")


def representative(table: pd.DataFrame, at: dict[str, str] | None = None) -> dict:
    """One value per grid axis for the plots and the headline table.

    Default per axis: the lower median of the distinct values that have ok cells (N = [10, 30,
    100, 300] -> 30; R = [10, 100, 1000] -> 100; dtype -> float32; device -> cpu; ood -> none), axis
    by axis (ood and d first, then AXES order) among the ok cells at the values chosen before it (the
    `at` values first), so the setting is one that some cells have. NaN when the axis is NaN
    throughout (noise with CSV data).
    Args:
        table: stacked result rows. at: overrides, axis -> value as text (from --at AXIS=VALUE),
            read in the axis's type (validate.at_value).
    Raises:
        ConfigError: an unknown axis, a value not of the axis's type, a value that no ok cell
            has (the message lists them), or --at values that no ok cell has together.
    """
    ok = table[table["status"] == "ok"]
    ok = ok if not ok.empty else table
    chosen = {}
    for axis, text in (at or {}).items():
        if axis not in AXES:
            raise ConfigError(f"--at: unknown axis {axis!r}; accepted: {', '.join(AXES)}")
        chosen[axis] = at_value(axis, text, ok[axis])  # in the axis's type: N=4.0 is 4, R=1e1 is 10.0
    if len(chosen) > 1 and select(ok, chosen, list(chosen)).empty:  # each value alone has ok cells (a review)
        given = " and ".join(f"{a}={text}" for a, text in at.items())
        first, *rest = chosen
        at_first = select(ok, {first: chosen[first]}, [first])
        show = lambda v: f"{v:g}" if isinstance(v, float) else str(v)  # noqa: E731
        have = "; ".join(f"{a} = {', '.join(map(show, sorted(at_first[a].dropna().unique())))}" for a in rest)
        raise ConfigError(f"--at: no ok cell has {given} together; the ok cells at {first}={at[first]} have {have}")
    # ood and d first, then each axis among the ok cells at the values chosen so far (--at's first). Chosen
    # each on its own, --at d=3 took N = 3 (ill-posed there), two runs of other grids got a setting neither
    # had, and an OOD-only run beside another put the headline on a map (found by reviews)
    for axis in sorted(AXES, key=lambda a: a not in ("ood", "d")):
        if axis not in chosen:
            pool = select(ok, chosen, list(chosen)) if chosen else ok
            have = sorted((pool if not pool.empty else ok)[axis].dropna().unique().tolist())
            if axis == "ood" and "none" in have:  # the in-distribution prompts, not a median of map names
                have = ["none"]
            chosen[axis] = have[(len(have) - 1) // 2] if have else math.nan
    return {a: chosen[a] for a in AXES}  # (in AXES order: the titles name them so)


def select(df: pd.DataFrame, setting: dict, axes) -> pd.DataFrame:
    """Rows of df at setting[axis] for each axis in axes (NaN matches NaN)."""
    mask = pd.Series(True, index=df.index)
    for a in axes:
        v = setting[a]
        mask &= df[a].isna() if isinstance(v, float) and math.isnan(v) else (df[a] == v)
    return df[mask]


NO_CELL = "(no ok cell)"  # a headline entry with nothing to average: skipped, errored or not run
NOT_RECORDED = "(not recorded)"  # a median table entry of a run written before abs_err_median existed


def headline(summary: pd.DataFrame, setting: dict, table: pd.DataFrame | None = None, *,
             stat: str = "mean") -> pd.DataFrame:
    """Mean MSE vs OLS "mean [CI low, CI high]" by series (rows) x N (columns) at `setting`
    (noise, R, dtype, device fixed), "(k of n NaN/inf)" appended where k predictions were not finite
    (the mean is over the others), NO_CELL where a series has no ok cell at that N (not a bare
    nan, which would read as a NaN answer). With the run's `table` (every status, load_runs'
    series), the series and N it ran at the setting without an ok cell are rows / columns of
    NO_CELL too: a series that errored everywhere is not silently absent. Empty when no ok cell
    matches. `stat` "median": the typical prompt's squared error instead, abs_err_median² (squared
    units of y; the top 1 % of prompts carry most of a mean, results/ci_coverage.md), no interval,
    the same "(k of n NaN/inf)" (the median is over the finite answers), NOT_RECORDED where the cell's
    run has no abs_err_median; "target": the mean squared error against the query's observed y
    (mse_vs_target: the held-out prediction error, what CSV data is scored by), no interval."""
    fixed = tuple(a for a in AXES if a != "N")
    at = select(summary, setting, fixed)
    if at.empty:
        return pd.DataFrame()
    ran = at
    if table is not None:
        ran = select(table, setting, fixed)
        if "run" in ran:  # only the runs the headline shows: a left-out run adds no row or N
            ran = ran[ran["run"].isin(ran.loc[ran["status"] == "ok", "run"])]
    bad, of = failed_answers(at)
    flag = [f" ({int(k)} of {int(n)} NaN/inf)" if k > 0 else "" for k, n in zip(bad, of)]  # in both tables: a
    if stat in ("median", "target"):  # over the finite answers alone it would read as good as ols (a review)
        col = "abs_err_median" if stat == "median" else "mse_vs_target"
        v = at[col].astype(float) if col in at else pd.Series(math.nan, index=at.index)
        v = v * v if stat == "median" else v
        text = at.assign(cell=[(f"{x:.3g}" if x == x or f else NOT_RECORDED) + f for x, f in zip(v, flag)])
    else:
        text = at.assign(cell=[f"{m:.3g} [{lo:.3g}, {hi:.3g}]{f}" for m, lo, hi, f in
                               zip(at["mse_vs_ols"], at["mse_vs_ols_ci_low"], at["mse_vs_ols_ci_high"], flag)])
    wide = text.pivot_table(index="series", columns="N", values="cell", aggfunc="first")
    wide = wide.reindex(index=series_order(pd.concat([at, ran])), columns=sorted(set(at["N"]) | set(ran["N"])))
    wide = wide.astype(object).fillna(NO_CELL)  # (a column added for an N with no ok cell is float)
    wide.columns = [f"N={n}" for n in wide.columns]
    return wide.reset_index()


def failed_answers(rows: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """(non-finite predictions on well-posed prompts, well-posed prompts) per summary or result
    row: a NaN on an ill-posed prompt is the right answer, not a failure. Rows from runs before
    n_ill_posed / n_nonfinite_well_posed existed count every prompt (n_nonfinite of n_prompts)."""
    n = rows["n_prompts"].astype(float)
    bad = rows["n_nonfinite"].astype(float).fillna(0.0) if "n_nonfinite" in rows else pd.Series(0.0, index=rows.index)
    if {"n_ill_posed", "n_nonfinite_well_posed"} <= set(rows):
        exact = rows["n_ill_posed"].notna() & rows["n_nonfinite_well_posed"].notna()
        bad = bad.where(~exact, rows["n_nonfinite_well_posed"].astype(float))
        n = n.where(~exact, n - rows["n_ill_posed"].astype(float))
    return bad, n


def ill_posed_note(summary: pd.DataFrame, setting: dict) -> list[str]:
    """One line when prompts of the headline's setting are ill-posed (no least-squares answer, e.g.
    x constant over a CSV window): no series is scored on them, and their NaN is not counted."""
    at = select(summary, setting, tuple(a for a in AXES if a != "N"))
    if "n_ill_posed" not in at or not (at["n_ill_posed"] > 0).any():
        return []
    hit = at[at["n_ill_posed"] > 0]
    src = hit["prompts"].fillna("").astype(str) if "prompts" in hit else pd.Series("", index=hit.index)
    label = source_labels(at["prompts"].fillna("").astype(str) if "prompts" in at else [""])  # "" for one source
    hit = hit.assign(src=src).sort_values("n_ill_posed", ascending=False, kind="stable")  # k and n of one row,
    per_n = hit.groupby(["src", "N"], sort=False).agg(k=("n_ill_posed", "first"), n=("n_prompts", "first"))  # the top
    where = ", ".join(f"N={n}: {int(r.k)} of {int(r.n)}" + (f" ({label[s]})" if label.get(s) else "")
                      for (s, n), r in per_n.sort_index(level=1, sort_remaining=False).iterrows())
    return [f"ill-posed prompts (no finite least-squares answer in the cell's dtype, e.g. x constant over the context, "
            f"or CSV values beyond float32's range: a solver should answer NaN there, and the MSE vs OLS leaves them "
            f"out) at {where}"]


def to_markdown(df: pd.DataFrame) -> str:
    """A DataFrame as a GitHub markdown table; "(none)" when empty. Metrics to 3 significant digits,
    grid values (display_keys) in full; text cells escaped (md_cell)."""
    if df.empty:
        return "(none)\n"
    shown = display_keys(df)
    for c in shown.columns:
        if not pd.api.types.is_numeric_dtype(shown[c]):
            shown[c] = shown[c].map(md_cell)
    keys = [i for i, c in enumerate(shown.columns) if c in AXES and not pd.api.types.is_numeric_dtype(shown[c])]
    return shown.to_markdown(index=False, floatfmt=".3g", disable_numparse=keys or False) + "\n"  # (keys: as written)


def display_keys(df: pd.DataFrame) -> pd.DataFrame:
    """A copy of `df` whose float grid-axis columns (noise, R) are text with every digit they need
    (12 significant): at 3, noise 0.1 and 0.1001, or R 1000 and 1004, read as one cell (a review)."""
    out = df.copy()
    for c in AXES:
        if c in out and pd.api.types.is_float_dtype(out[c]):
            out[c] = [f"{v:.12g}" for v in out[c]]
    return out


def md_cell(v):
    """A table cell's text for markdown: "|" (it split the row: a label "tag=a|b" moved every value one
    column right) and "<", "&" (raw HTML: a label "<b>x</b>" rendered bold) escaped; others as they are."""
    if not isinstance(v, str):
        return v
    return v.replace("&", "&amp;").replace("<", "&lt;").replace("|", "\\|")


def setting_text(setting: dict, axes=None, fmt=str, varied=()) -> str:
    """"N = 30, noise = 0.1, ..." for `axes` (default: every axis of `setting`); an axis at the value every run
    had before it existed (BACKFILL: d = 1, ood = none) is named only when in `varied` (coverage.varied_axes)."""
    axes = list(setting) if axes is None else axes
    return ", ".join(f"{a} = {fmt(setting[a])}" for a in axes if a in varied or a not in BACKFILL or setting.get(a) != BACKFILL[a])
