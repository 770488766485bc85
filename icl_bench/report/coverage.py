"""What a published report leaves out, and why (docs/report.md, "Several runs").

The headline table and the plots that fix axes show one representative setting
(report.representative). Runs with different grids, or series that ran on part of the grid,
can have no ok cell there: they are then absent from the headline, and these notes say so and
name the values they do have, so nothing disappears silently. Likewise the other values of the
axes a setting text leaves unnamed at their default (d = 1, ood = none: aggregate.BACKFILL): when
the runs hold d = 2 or OOD rows, the headline and plots name d / ood and a note lists the values
they leave out.
"""
from __future__ import annotations

import pandas as pd

from icl_bench.report.aggregate import AXES, BACKFILL, select, setting_text
from icl_bench.report.sources import lone_source_label

FIXED = ("noise", "R", "dtype", "device", "d", "ood")  # the headline fixes these; N is its columns


def _values(s: pd.Series) -> str:
    """The distinct values of an axis, "n/a" for NaN (a CSV run's noise): "0, 0.1", "n/a"."""
    vals = [f"{v:g}" if isinstance(v, float) else str(v) for v in sorted(s.dropna().unique().tolist())]
    return ", ".join(vals + (["n/a"] if s.isna().any() else []))


def _fmt(v) -> str:
    return "n/a" if isinstance(v, float) and v != v else f"{v:g}" if isinstance(v, float) else str(v)


def at_flag(axis: str, value) -> str:
    """"--at AXIS=VALUE" as `--at` reads it back (validate.at_value): NaN (a CSV run's noise) as
    "nan", not the tables' "n/a", which --at refuses (a review)."""
    return f"--at {axis}={'nan' if pd.isna(value) else _fmt(value)}"


def varied_axes(df: pd.DataFrame) -> set[str]:
    """The grid axes with more than one value in df's ok rows (every row if it has no status
    column, e.g. the summary): a setting text must name these even at their default."""
    ok = df[df["status"] == "ok"] if "status" in df else df
    return {a for a in AXES if a in ok and ok[a].nunique(dropna=False) > 1}


def setting_words(setting: dict, axes, df: pd.DataFrame) -> str:
    """setting_text of `axes`, naming d / ood whenever df holds more than one value of them, and the
    prompt source when df's rows share one that is not the default generator ("prompts = msft.csv
    Open→Close", as the headline's heading: a figure of a CSV run said only "noise σ = n/a"; a tryout)."""
    source = lone_source_label(df["prompts"].fillna("").astype(str)) if "prompts" in df else ""
    return setting_text(setting, axes, _fmt, varied_axes(df)) + (f", prompts = {source}" if source else "")


def hidden_values(table: pd.DataFrame, setting: dict) -> list[str]:
    """One line per BACKFILL axis (d, ood) whose other ok values the headline and plots leave out."""
    ok = table[table["status"] == "ok"]
    out = []
    for axis in BACKFILL:
        other = ok.loc[ok[axis] != setting[axis], axis]
        if len(other):
            where = " (the mechanism section shows the OOD rows)" if axis == "ood" else ""
            out.append(f"{axis} = {_values(other)}: left out of the headline and of the plots, which show "
                       f"{axis} = {_fmt(setting[axis])}{where}; show another with --at (e.g. --at {axis}={_fmt(other.iloc[0])})")
    return out


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


def prompt_sets_note(table: pd.DataFrame, setting: dict, most: int = 8) -> list[str]:
    """One line when the series of the headline's setting (every N) were measured on different
    prompts: other prompt seeds, or other numbers of prompts per seed (runs of other seeds or
    n_prompts published together). Their differences then include the sampling noise between
    prompt sets: gd-lsa and gd, one algorithm, read 0.795 and 0.876 side by side, 1 seed against
    2 (a review). Empty when every series read the same prompts."""
    at = select(table[table["status"] == "ok"], setting, FIXED)
    if at.empty or "seed" not in at:
        return []
    groups: dict = {}
    for series, g in at.groupby("series", sort=False):
        seeds = tuple(sorted(int(v) for v in g["seed"].unique()))
        sizes = tuple(sorted(int(v) for v in g["n_prompts"].unique()))
        groups.setdefault((seeds, sizes), []).append(str(series))
    if len(groups) < 2:
        return []
    parts = []
    for (seeds, sizes), names in groups.items():
        shown = ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")
        parts.append(f"prompt seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))} × "
                     f"{' or '.join(map(str, sizes))} prompts: {shown}")
    return ["the series at this setting were measured on different prompts, so a difference between series of "
            "different prompt sets includes the sampling noise between those sets (equal methods can read "
            "differently): " + "; ".join(parts) + "; publish runs of the same seeds and n_prompts to compare them"]


def _absent(g: pd.DataFrame, setting: dict) -> tuple[str, str]:
    """Why the ok rows `g` have none at `setting`, and "" or ", e.g. --at A=V": the values they have
    of each FIXED axis whose setting value they lack ("its ok cells have R = 10; dtype = float64"),
    or, when each value has ok rows but no row has them all, that, with the --at values of the
    nearest ok setting."""
    why = "; ".join(f"{a} = {_values(g[a])}" for a in FIXED if select(g, setting, (a,)).empty)
    if why:
        return f"its ok cells have {why}", ""
    differ = pd.Series(0, index=g.index)  # per ok row: the FIXED axes on which it is not at the setting
    for a in FIXED:
        differ += ~g.index.isin(select(g, setting, (a,)).index)
    near = g.loc[[differ.idxmin()]]  # the first ok row that differs from the setting on the fewest axes
    flags = " ".join(at_flag(a, near[a].iloc[0]) for a in FIXED if select(near, setting, (a,)).empty)
    return "it has ok cells at each of these values but none at all of them together", f", e.g. {flags}"


def left_out(table: pd.DataFrame, setting: dict) -> list[str]:
    """Notes on every run folder and series that the headline (at `setting`) does not show.

    Args:
        table: stacked rows (report.load_runs). setting: the representative setting.
    Returns:
        lines "run X: left out of the headline and the plots at ... (its ok cells have R = 10)",
        "d = 2: left out of the headline and of the plots, which show d = 1; ..." (hidden_values)
        and "series S: ..." (empty when everything with ok cells is shown): "not in the headline"
        for a series the headline has no row of, "a row of (no ok cell) in the headline" for one
        that ran at the setting in a run the headline shows (aggregate.headline gives it that row).
    """
    ok = table[table["status"] == "ok"]
    at = setting_words(setting, FIXED, table)
    notes = [*grid_differences(table), *hidden_values(table, setting)]
    alone = table["run"].nunique() == 1  # "publish it alone" is no advice then
    gone = set()  # runs already named as left out: their series need no second note
    for run, g in table.groupby("run", sort=False):
        mine = ok[ok["run"] == run]
        if mine.empty:
            notes.append(f"run {run}: left out of every table and plot: it has no ok cells")
            gone.add(run)
        elif select(mine, setting, FIXED).empty:
            why, example = _absent(mine, setting)
            hint = "choose the setting with --at" if alone else "publish it alone, or choose the setting with --at"
            notes.append(f"run {run}: left out of the headline and of the plots at {at}: {why} ({hint}{example})")
            gone.add(run)
    here = select(table, setting, FIXED)  # the rows headline() makes rows of: runs with ok cells at the setting
    in_headline = set(here.loc[here["run"].isin(here.loc[here["status"] == "ok", "run"]), "series"])
    for series, g in ok.groupby("series", sort=False):
        if select(g, setting, FIXED).empty and not set(g["run"]) <= gone:
            why, example = _absent(g, setting)
            where = (f"a row of (no ok cell) in the headline at {at}, where none of its cells is ok (the failed and "
                     "skipped cells say why)") if series in in_headline else f"not in the headline at {at}"
            notes.append(f"series {series}: {where}: {why}" + (f" ({example[2:]})" if example else ""))
    return notes
