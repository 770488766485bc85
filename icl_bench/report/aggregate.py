"""Aggregation: run folders -> the tables a paper or README shows (pandas).

A run folder is what `icl-bench run` writes: results.parquet (one row per cell) and metadata.json.
Several folders (other seeds, other machines) are stacked and aggregated together:

    summary   one row per (solver, solver_params, N, noise, R, dtype, device, prompts) over the
              cells with status "ok": mean MSE vs OLS with a 95 % confidence interval, mean MSE
              vs truth (with its CI), median throughput, number of seeds and prompts
    failures  every cell whose status is "error" or "skipped", with its message (never dropped)
    sparsity  solvers with weights: weight_sparsity and weight_l1 per solver, params and R
    headline  mean MSE vs OLS by solver (rows) x N (columns) at one representative setting

Confidence interval of a mean MSE ("over prompts and seeds"). Each cell row carries the mean
squared error m_i over its n_i prompts and that mean's standard error se_i = sd / sqrt(n_i)
(metrics.py). Rows of the same cell and seed from several runs saw the same prompts, so they are
averaged first (not counted twice). Distinct seeds draw independent prompts, so all prompts of a
group are one i.i.d. sample: the pooled mean is m = sum(n_i m_i) / n with n = sum(n_i) and its
standard error se = sqrt(sum(n_i^2 se_i^2)) / n. The 95 % interval is taken for log(m) by the
delta method (se of log m ~ se / m) and mapped back: [m / f, m * f], f = exp(t * se / m), t the
0.975 quantile of Student's t with n - 1 degrees of freedom (scipy.stats). Squared errors are
skewed and heavy-tailed (prompts with nearly equal x have large errors), so the symmetric
m +- t se would often reach below 0; the log interval stays positive and is asymmetric like the
sampling distribution of m. Its coverage is approximate (normal theory); an m of exactly 0 gets
[0, 0]. Runs written before the runner stored standard errors give NaN intervals.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from icl_bench.errors import ConfigError

AXES = ("N", "noise", "R", "dtype", "device")  # the grid axes of a result row
KEYS = ["solver", "solver_params", *AXES, "prompts"]  # one summary row per distinct KEYS
REQUIRED = ["solver", "solver_params", *AXES, "seed", "n_prompts", "mse_vs_ols", "mse_vs_truth",
            "prompts_per_s", "weight_sparsity", "weight_l1", "status", "message"]
LEVEL = 0.95  # confidence level of the intervals


def load_run(path: str | Path) -> tuple[pd.DataFrame, dict | None]:
    """Read one run folder.

    Args:
        path: a folder written by `icl-bench run` (results.parquet, optionally metadata.json).
    Returns:
        (table with a "run" column holding the folder path, metadata dict or None if absent).
    Raises:
        ConfigError: the folder is missing, has no results.parquet, the parquet or metadata.json
            cannot be read, a required column is missing, or the table has no rows.
    """
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"RUN_DIR: {path} is not a folder (expected the --out folder of `icl-bench run`)")
    parquet = path / "results.parquet"
    if not parquet.is_file():
        hint = (f"an unfinished run: complete it with `icl-bench run --resume --out {path}`" if (path / "cells.sqlite").is_file()
                else "is it the --out folder of `icl-bench run`?")
        raise ConfigError(f"RUN_DIR: {path} has no results.parquet ({hint})")
    try:
        table = pd.read_parquet(parquet)
    except Exception as exc:  # pyarrow raises several types for truncated / foreign files
        raise ConfigError(f"RUN_DIR: {parquet} cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
    missing = [c for c in REQUIRED if c not in table.columns]
    if missing:
        raise ConfigError(f"RUN_DIR: {parquet} lacks the columns {', '.join(missing)}")
    if table.empty:
        raise ConfigError(f"RUN_DIR: {parquet} has no rows")
    meta = None
    if (path / "metadata.json").is_file():
        try:
            meta = json.loads((path / "metadata.json").read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"RUN_DIR: {path / 'metadata.json'} cannot be read ({exc})") from None
    for col in ("mse_vs_ols_se", "mse_vs_truth_se", "prompts"):  # older runs: no SE, one prompt source
        if col not in table.columns:
            table[col] = math.nan if col.endswith("_se") else ""
    return table.assign(run=str(path)), meta


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
    return add_series(table), {str(Path(p)): m for p, (_, m) in zip(paths, loaded)}


def add_series(table: pd.DataFrame) -> pd.DataFrame:
    """Add "series" (the solver name, plus the parameters that vary between its rows) and
    "series_rank" (sort order: by solver, then by those parameter values, numbers numerically).

    "gd-lsa steps=4" when gd-lsa ran with several parameter sets differing in steps; plain
    "ols" when a solver ran with one parameter set. Used as the line / bar label in plots.
    """
    labels, order = {}, []
    for solver, params in table.groupby("solver")["solver_params"]:
        sets = {p: json.loads(p) if p else {} for p in params.unique()}
        varying = sorted({k for d in sets.values() for k in d
                          if len({json.dumps(s.get(k)) for s in sets.values()}) > 1})
        for p, d in sets.items():
            labels[(solver, p)] = f"{solver} {' '.join(f'{k}={d.get(k)}' for k in varying)}".strip()
            order.append(((solver, tuple((type(d.get(k)).__name__, d.get(k)) for k in varying)), (solver, p)))
    rank = {key: i for i, (_, key) in enumerate(sorted(order, key=lambda o: o[0]))}
    keys = list(zip(table["solver"], table["solver_params"]))
    return table.assign(series=[labels[k] for k in keys], series_rank=[rank[k] for k in keys])


def series_order(df: pd.DataFrame) -> list[str]:
    """The distinct series of df in series_rank order (alphabetical if df has no series_rank)."""
    if "series_rank" not in df:
        return sorted(df["series"].unique())
    return df.sort_values("series_rank")["series"].drop_duplicates().tolist()


def _pooled(group: pd.DataFrame, metric: str) -> pd.Series:
    """Pooled mean, standard error and 95 % CI of one metric over a group's per-seed rows
    (see the module docstring for the method)."""
    n = group["n_prompts"].astype(float)
    m, se = group[metric].astype(float), group[f"{metric}_se"].astype(float)
    total = n.sum()
    mean = float((n * m).sum(skipna=False) / total)
    sem = float(np.sqrt(((n * se) ** 2).sum(skipna=False)) / total)
    t = float(stats.t.ppf(0.5 + LEVEL / 2, max(total - 1, 1)))
    if mean > 0:
        f = math.exp(t * sem / mean) if math.isfinite(sem) else math.nan
        low, high = mean / f, mean * f
    else:  # exactly 0 (every prompt exact) or NaN
        low = high = mean if sem == 0 or mean != mean else math.nan
    return pd.Series({metric: mean, f"{metric}_se": sem, f"{metric}_ci_low": low, f"{metric}_ci_high": high})


def aggregate(table: pd.DataFrame) -> pd.DataFrame:
    """The summary table: one row per KEYS over the "ok" cells (see the module docstring).

    Args:
        table: stacked result rows (load_runs).
    Returns:
        DataFrame with KEYS, "series", n_seeds, n_prompts (summed over seeds), n_nonfinite,
        mse_vs_ols (squared units of y) with _se, _ci_low, _ci_high; the same for mse_vs_truth;
        prompts_per_s (median over every timed row, prompts per second). Sorted by KEYS.
    """
    ok = table[table["status"] == "ok"]
    cols = ["mse_vs_ols", "mse_vs_ols_se", "mse_vs_truth", "mse_vs_truth_se", "n_prompts", "n_nonfinite"]
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
            row["n_nonfinite"] = int(g["n_nonfinite"].sum())
        for metric in ("mse_vs_ols", "mse_vs_truth"):
            row.update(_pooled(g, metric).to_dict())
        rows.append(row)
    summary = pd.DataFrame(rows)
    speed = ok.groupby(KEYS, dropna=False)["prompts_per_s"].median().rename("prompts_per_s").reset_index()
    return summary.merge(speed, on=KEYS, how="left")


def failures(table: pd.DataFrame) -> pd.DataFrame:
    """Every cell that did not finish: status "error" or "skipped", with its message and run."""
    cols = ["run", "solver", "solver_params", *AXES, "seed", "status", "message"]
    return table.loc[table["status"] != "ok", cols].reset_index(drop=True)


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
    return bad.groupby(["solver", "solver_params", "status", "message"], dropna=False).agg(**agg).reset_index()


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


def _coerce(axis: str, text: str):
    if axis == "N":
        return int(text)
    if axis in ("noise", "R"):
        return float(text)
    return str(text)


def representative(table: pd.DataFrame, at: dict[str, str] | None = None) -> dict:
    """One value per grid axis for the plots and the headline table.

    Default per axis: the lower median of the distinct values that have ok cells (N = [10, 30,
    100, 300] -> 30; R = [10, 100, 1000] -> 100; dtype -> float32; device -> cpu). NaN when the
    axis is NaN throughout (noise with CSV data).
    Args:
        table: stacked result rows. at: overrides, axis -> value as text (from --at AXIS=VALUE).
    Raises:
        ConfigError: an unknown axis, or a value that no ok cell has (the message lists them).
    """
    ok = table[table["status"] == "ok"]
    ok = ok if not ok.empty else table
    chosen = {}
    for axis, text in (at or {}).items():
        if axis not in AXES:
            raise ConfigError(f"--at: unknown axis {axis!r}; accepted: {', '.join(AXES)}")
        have = sorted(ok[axis].dropna().unique().tolist())
        try:
            value = _coerce(axis, text)
        except ValueError:
            value = None
        if value not in have:
            raise ConfigError(f"--at: {axis}={text} has no ok cells; accepted: {', '.join(map(str, have))}")
        chosen[axis] = value
    for axis in AXES:
        if axis not in chosen:
            have = sorted(ok[axis].dropna().unique().tolist())
            chosen[axis] = have[(len(have) - 1) // 2] if have else math.nan
    return chosen


def select(df: pd.DataFrame, setting: dict, axes) -> pd.DataFrame:
    """Rows of df at setting[axis] for each axis in axes (NaN matches NaN)."""
    mask = pd.Series(True, index=df.index)
    for a in axes:
        v = setting[a]
        mask &= df[a].isna() if isinstance(v, float) and math.isnan(v) else (df[a] == v)
    return df[mask]


def headline(summary: pd.DataFrame, setting: dict) -> pd.DataFrame:
    """Mean MSE vs OLS "mean [CI low, CI high]" by series (rows) x N (columns) at `setting`
    (noise, R, dtype, device fixed). Empty when no ok cell matches."""
    at = select(summary, setting, ("noise", "R", "dtype", "device"))
    if at.empty:
        return pd.DataFrame()
    text = at.assign(cell=[f"{m:.3g} [{lo:.3g}, {hi:.3g}]" for m, lo, hi in
                           zip(at["mse_vs_ols"], at["mse_vs_ols_ci_low"], at["mse_vs_ols_ci_high"])])
    wide = text.pivot_table(index="series", columns="N", values="cell", aggfunc="first")
    wide = wide.reindex([s for s in series_order(at) if s in wide.index])
    wide.columns = [f"N={n}" for n in wide.columns]
    return wide.reset_index()


def to_markdown(df: pd.DataFrame) -> str:
    """A DataFrame as a GitHub markdown table (3 significant digits); "(none)" when empty."""
    if df.empty:
        return "(none)\n"
    return df.to_markdown(index=False, floatfmt=".3g") + "\n"
