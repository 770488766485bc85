"""The console summary printed after `icl-bench run` (docs/report.md, "Console summary").

Per series: how many cells ended ok / skipped / error over the whole run, and the mean MSE vs OLS
and median throughput at the representative setting (report.representative: one N, noise, R,
dtype, device, d, ood; d and ood are named when the run has other values of them), so numbers from different settings are never pooled into one median. Skipped
and failed cells follow, grouped by their message (one line per distinct reason, with the
number of cells and the series it hit). On stderr, `cell_warnings` then names the cells a user
must not miss: no well-posed prompt, plugins that failed to import, solvers that answered nothing.
"""
from __future__ import annotations

import math
import sys

import pandas as pd

from icl_bench.bench.contract import DEFAULTS_CHANGED, ILL_ANSWERED, NO_ANSWER, NO_PROMPT, WEIGHTS_BROKE
from icl_bench.report import aggregate as report
from icl_bench.report.coverage import varied_axes
from icl_bench.report.load import shared_timing

MAX_REASONS = 8  # distinct skip / error messages printed (the rest are counted)


def _fmt(v) -> str:
    return "n/a" if isinstance(v, float) and math.isnan(v) else f"{v:g}" if isinstance(v, float) else str(v)


def console_summary(table: pd.DataFrame) -> str:
    """The summary text for a run's result rows (the runner's table, one row per cell)."""
    table = report.add_series(table)
    setting = report.representative(table)
    at = report.select(table[table["status"] == "ok"], setting, report.AXES)
    counts = table.groupby("series").agg(
        ok=("status", lambda s: int((s == "ok").sum())), skipped=("status", lambda s: int((s == "skipped").sum())),
        error=("status", lambda s: int((s == "error").sum())))
    bad, of = report.failed_answers(at)  # a NaN on an ill-posed prompt is the right answer
    here = at.assign(nan=bad, of=of).groupby("series").agg(
        mse_vs_ols=("mse_vs_ols", "mean"), prompts_per_s=("prompts_per_s", "median"), nan=("nan", "sum"), of=("of", "sum"))
    if (here["nan"] > 0).any():  # the mean is over the scored predictions: say how many failed
        here["NaN/inf predictions"] = [f"{int(k)} of {int(n)}" if k > 0 else "-" for k, n in zip(here["nan"], here["of"])]
    out = counts.join(here.drop(columns=["nan", "of"]), how="left").reindex(report.series_order(table))
    where = report.setting_text(setting, report.AXES, _fmt, varied_axes(table))
    lines = [f"cells per series (whole run); MSE vs OLS (y units², mean over seeds) and prompts/s at {where}:",
             out.to_string(float_format=lambda v: f"{v:.3g}", na_rep="-")]
    shared = int(shared_timing(at).sum())  # a Dask run's medians, unmarked, read as the solvers' own (a review)
    if shared:
        lines.append(f"prompts/s: {shared} of the {len(at)} cells above were timed while other icl-bench cells ran on "
                     "the same machine (concurrency > 1): they understate the solver alone (docs/scale-out.md, "
                     "\"Honest timing\")")
    bad = table[table["status"] != "ok"]
    if not bad.empty:
        groups = (bad.groupby(["status", "message"], dropna=False)
                  .agg(cells=("series", "size"), series=("series", lambda s: ", ".join(report.series_order(
                      table[table["series"].isin(set(s))])))).reset_index().sort_values("cells", ascending=False))
        every = set(table["series"])
        groups["series"] = [("every series" if set(s.split(", ")) == every else s) for s in groups["series"]]
        lines.append(f"{len(bad)} cells not ok, by reason:")
        for _, g in groups.head(MAX_REASONS).iterrows():
            lines.append(f"  {g['status']} x{g['cells']} [{g['series']}]: {g['message']}")
        if len(groups) > MAX_REASONS:
            lines.append(f"  ... and {len(groups) - MAX_REASONS} more reasons (status and message of every cell: results.csv)")
    return "\n".join(lines)


def cell_warnings(table: pd.DataFrame) -> None:
    """After the summary, print to stderr a line for each kind of cell that is not a plain
    success: cells with no well-posed prompt (once per reason), skipped plugins that failed to
    import (once per solver), cells whose solver answered no prompt, cells whose solver answered
    ill-posed prompts, whose weights() broke its contract or held NaN / inf, or whose solver changed
    torch's default dtype or device (once per series), the first five errors."""
    empty = table[(table.status == "skipped") & table.message.str.startswith(NO_PROMPT)]
    for message, rows in empty.groupby("message"):
        print(f"icl-bench: WARNING: {len(rows)} cells skipped: {message}", file=sys.stderr)
    broken = table[(table.status == "skipped") & table.message.str.contains("failed to load", regex=False)]
    for solver, rows in broken.groupby("solver"):
        print(f"icl-bench: WARNING: solver {solver!r} skipped ({len(rows)} cells): {rows.message.iloc[0]}", file=sys.stderr)
    table = report.add_series(table)  # "mean-y shift=5", not "mean-y": which parameter setting answered nothing
    silent = table[(table.status == "ok") & table.message.str.startswith(NO_ANSWER)]
    for series, rows in silent.groupby("series"):
        ran = int(((table.series == series) & (table.status != "skipped")).sum())  # skipped cells did not answer
        print(f"icl-bench: WARNING: {series}: {NO_ANSWER} in {len(rows)} of the {ran} cells it ran "
              f"(e.g. {_where(rows.iloc[0])}: {rows.message.iloc[0]})", file=sys.stderr)
    made_up = table[(table.status == "ok") & table.message.str.contains(ILL_ANSWERED, regex=False)]
    for series, rows in made_up.groupby("series"):
        print(f"icl-bench: WARNING: {series}: {ILL_ANSWERED} in {len(rows)} cells (e.g. {_where(rows.iloc[0])}: "
              f"{rows.message.iloc[0]}); a solver answers NaN there "
              "(icl_bench.solvers.base.nan_if_ill_posed)", file=sys.stderr)
    odd = table[(table.status == "ok") & table.message.str.contains(WEIGHTS_BROKE, regex=False)]
    for series, rows in odd.groupby("series"):  # (runner.run_cell: its weight columns are NaN)
        print(f"icl-bench: WARNING: {series}: weight_sparsity and weight_l1 are NaN in {len(rows)} cells: "
              f"{rows.message.iloc[0]}", file=sys.stderr)
    changed = table[table.message.str.contains(DEFAULTS_CHANGED, regex=False)]  # put back after each cell
    for series, rows in changed.groupby("series"):
        cells = f"{len(rows)} cell{'s' if len(rows) > 1 else ''}"
        print(f"icl-bench: WARNING: {series}: {DEFAULTS_CHANGED} dtype or device in {cells} (e.g. {_where(rows.iloc[0])}: "
              f"{rows.message.iloc[0]}); a solver leaves process-wide settings as it found them", file=sys.stderr)
    errors = table[table.status == "error"]
    for _, r in errors.head(5).iterrows():
        print(f"error: {r['solver']} {r['solver_params']} {_where(r)} {r['device']}: {r['message']}", file=sys.stderr)


def _where(row) -> str:
    """"N=30 R=100.0 float32" of a result row, with d and ood where they are not 1 / none (the axis
    that told two cells apart was missing from the lines: a review)."""
    extra = "".join(f" {a}={row[a]}" for a, plain in (("d", 1), ("ood", "none")) if a in row and pd.notna(row[a])
                    and row[a] != plain)
    return f"N={row['N']}{extra} R={row['R']} {row['dtype']}"
