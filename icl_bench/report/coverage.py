"""What a published report leaves out, and why (docs/report.md, "Several runs").

The headline table and the plots that fix axes show one representative setting
(report.representative). Runs with different grids, or series that ran on part of the grid,
can have no ok cell there: they are then absent from the headline, and these notes say so and
name the values they do have, so nothing disappears silently.
"""
from __future__ import annotations

import pandas as pd

from icl_bench.report.aggregate import AXES, select

FIXED = ("noise", "R", "dtype", "device")  # the headline fixes these; N is its columns


def _values(s: pd.Series) -> str:
    vals = sorted(s.dropna().unique().tolist())
    return ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in vals) + (", n/a" if s.isna().any() else "")


def _fmt(v) -> str:
    return "n/a" if isinstance(v, float) and v != v else f"{v:g}" if isinstance(v, float) else str(v)


def grid_differences(table: pd.DataFrame) -> list[str]:
    """One line per grid axis whose values differ between the run folders (empty for one run)."""
    if table["run"].nunique() < 2:
        return []
    out = []
    for axis in AXES:
        per_run = {run: _values(g[axis]) for run, g in table.groupby("run", sort=False)}
        if len(set(per_run.values())) > 1:
            out.append(f"the runs have different {axis} grids: " + "; ".join(f"{r}: {v}" for r, v in per_run.items()))
    return out


def left_out(table: pd.DataFrame, setting: dict) -> list[str]:
    """Notes on every run folder and series that the headline (at `setting`) does not show.

    Args:
        table: stacked rows (report.load_runs). setting: the representative setting.
    Returns:
        lines "run X: left out of the headline and the plots at ... (its ok cells have R = 10)"
        and "series S: ..." (empty when everything with ok cells is shown).
    """
    ok = table[table["status"] == "ok"]
    at = ", ".join(f"{a} = {_fmt(setting[a])}" for a in FIXED)
    notes = list(grid_differences(table))
    gone = set()  # runs already named as left out: their series need no second note
    for run, g in table.groupby("run", sort=False):
        mine = ok[ok["run"] == run]
        if mine.empty:
            notes.append(f"run {run}: left out of every table and plot: it has no ok cells")
            gone.add(run)
        elif select(mine, setting, FIXED).empty:
            why = "; ".join(f"{a} = {_values(mine[a])}" for a in FIXED if select(mine, setting, (a,)).empty)
            notes.append(f"run {run}: left out of the headline and of the plots at {at}: its ok cells have {why} "
                         f"(publish it alone, or choose the setting with --at)")
            gone.add(run)
    for series, g in ok.groupby("series", sort=False):
        if select(g, setting, FIXED).empty and not set(g["run"]) <= gone:
            why = "; ".join(f"{a} = {_values(g[a])}" for a in FIXED if select(g, setting, (a,)).empty)
            notes.append(f"series {series}: not in the headline at {at}: its ok cells have {why}")
    return notes
