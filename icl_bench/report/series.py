"""Series: the label and sort order of each (solver, parameters, prompt source) in the tables and plots.

    add_series(table)      adds "series" (the solver plus the parameters that tell it apart, plus the
                           prompt source when there are several) and "series_rank"
    series_order(df)       the distinct series in that order
    params_sort_key(p)     sort key of a solver_params JSON string, numbers numerically
"""
from __future__ import annotations

import json

import pandas as pd

from icl_bench.report.sources import source_labels
from icl_bench.solvers.registry import get_solver_class


def add_series(table: pd.DataFrame) -> pd.DataFrame:
    """Add "series" (the solver name plus every parameter that tells its rows apart from other
    series, plus the prompt source when the table holds several) and "series_rank" (sort order: by
    solver, then by those parameter values, numbers numerically, then by source in order of first
    appearance).

    A parameter is shown in a label when its value differs between any two series that have it:
    between parameter sets of one solver ("gd-lsa steps=4" beside "gd-lsa steps=16") or between
    solvers ("gd steps=8" beside "gd-lsa steps=4", even if gd ran with one value only). A solver
    whose parameters all agree with every other series keeps its plain name ("ols"). Rows of
    different prompt sources (the `prompts` column: two CSV files, or [prompts] tables) are
    different series, "gd steps=4 · d2.csv x→y" (sources.source_labels), and so are rows of one
    CSV path whose bytes differ (`data_sha256`: "· d.csv x→y (data sha256 1a2b3c4d)"); with one
    source (or no `prompts` column) the labels name no source. A parameter set in one run and left
    at its default in another is shown ("gd" beside "gd steps=4"), and so is one set off its declared
    default ("gd-lsa steps=2" alone: a bare "gd-lsa" reads as steps 16; _off_default).
    """
    prompts = table["prompts"].fillna("").astype(str) if "prompts" in table else pd.Series("", index=table.index)
    source = source_labels(prompts)
    if "data_sha256" in table:  # one CSV path, other bytes (the file was edited between runs): other data
        sha = table["data_sha256"].fillna("").astype(str)
        edited = sha.groupby(prompts).transform(lambda s: s[s != ""].nunique() > 1).astype(bool) & (sha != "")
        for p, h in dict.fromkeys(zip(prompts[edited], sha[edited])):  # (in order of first appearance)
            source[f"{p}\0{h}"] = f"{source[p]} (data sha256 {h[:8]})" if source[p] else f"data sha256 {h[:8]}"
        prompts = prompts.where(~edited, prompts + "\0" + sha)
    first = {p: i for i, p in enumerate(source)}  # sources in order of first appearance
    sets = {}
    for solver, params in table.groupby("solver")["solver_params"]:
        for p in params.unique():
            d = json.loads(p) if p else {}
            sets[(solver, p)] = d if isinstance(d, dict) else {}
    names = {k for d in sets.values() for k in d}
    shown = {k for k in names if len({json.dumps(d[k], sort_keys=True) for d in sets.values() if k in d}) > 1}
    shown |= {k for solver in {s for s, _ in sets} for k in names  # set in one run, left at its default in another
              if len({k in d for (s, _), d in sets.items() if s == solver}) > 1}
    keys = list(zip(table["solver"], table["solver_params"], prompts))
    labels, order = {}, []
    for solver, p, src in dict.fromkeys(keys):
        d = sets[(solver, p)]
        shown_keys = sorted(k for k in d if k in shown or k in _off_default(solver, d))
        label = f"{solver} {' '.join(f'{k}={_value(d[k])}' for k in shown_keys)}".strip()
        labels[(solver, p, src)] = f"{label} · {source[src]}" if source[src] else label
        order.append(((solver, tuple(_sort_key(d[k]) for k in shown_keys), first[src]), (solver, p, src)))
    taken = {}  # a label two settings would share (parameters that are no dict): their JSON tells them apart
    for key, label in labels.items():
        taken.setdefault(label, []).append(key)
    for label, same in taken.items():
        for solver, p, src in same if len(same) > 1 else ():
            labels[(solver, p, src)] = f"{label} {p or '{}'}"
    rank = {key: i for i, (_, key) in enumerate(sorted(order, key=lambda o: o[0]))}
    return table.assign(series=[labels[k] for k in keys], series_rank=[rank[k] for k in keys])


def _off_default(solver: str, params: dict) -> set[str]:
    """The parameters of `params` (one set of `solver`'s) whose value, as Param.check reads it (1 and
    1.0 are one float), is not the declared default; none for a solver that does not load here (a
    plugin not installed where the report is made: defaults unknown) or a parameter it lacks."""
    try:
        declared = get_solver_class(solver).params
    except Exception:
        return set()
    out = set()
    for k, v in params.items():
        try:
            if k in declared and declared[k].check(solver, k, v) != declared[k].check(solver, k, declared[k].default):
                out.add(k)
        except Exception:  # a value it now refuses (ConfigError) is no default
            out.add(k)
    return out


def _value(v) -> str:
    """A parameter value in a series label: 1e-05, 16, text as it is; text that is empty, holds a
    space or does not print (a newline, NUL) is quoted as JSON (models_dir="" would read as unset)."""
    if isinstance(v, str) and (not v or " " in v or not v.isprintable()):
        return json.dumps(v)
    return f"{v:g}" if isinstance(v, float) else str(v)


def _sort_key(v) -> tuple:
    """Numbers before text, numbers numerically (so steps sort 1, 4, 16, not 1, 16, 4)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return (0, float(v), "")
    return (1, 0.0, json.dumps(v, sort_keys=True))


def params_sort_key(params: str) -> tuple:
    """Sort key of a solver_params JSON string: its values in key order, numbers numerically."""
    d = json.loads(params) if params else {}
    return tuple((k, _sort_key(v)) for k, v in sorted(d.items())) if isinstance(d, dict) else ((str(d), (1, 0.0, "")),)


def series_order(df: pd.DataFrame) -> list[str]:
    """The distinct series of df in series_rank order (alphabetical if df has no series_rank)."""
    if "series_rank" not in df:
        return sorted(df["series"].unique())
    return df.sort_values("series_rank")["series"].drop_duplicates().tolist()
