"""Series: the label and sort order of each (solver, parameters, prompt source) in the tables and plots.

    add_series(table)      adds "series" (the solver plus the parameters that tell it apart, plus the
                           prompt source when there are several) and "series_rank"
    series_order(df)       the distinct series in that order
    params_sort_key(p)     sort key of a solver_params JSON string, numbers numerically
    series_styles(series)  series label -> matplotlib style
    same_setting_notes(t)  notes naming series that are one setting written two ways

Series style (docs/report.md, "Plots"): the colour names the solver *family* (the name before its
first "-": gd and gd-lsa are one family, trained-l1 / -nol1 / -lsa another), each solver of a
family gets its own shade of that colour, and the parameter set of a solver (steps = 1, 4, 16)
gets its own marker (a solver with a single parameter set takes its family's k-th marker instead,
so one-setting solvers of a family, e.g. trained-*, differ in marker too); solvers of one family
also differ in line style, and so do the prompt sources of one solver when the runs hold several
("gd steps=4 · d2.csv x→y"). Series that coincide on a plot: icl_bench/report/style.py.
"""
from __future__ import annotations

import json
import zlib

import numpy as np
import pandas as pd
import seaborn as sns

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


def same_setting_notes(table: pd.DataFrame) -> list[str]:
    """One note per group of series (a table with "series": add_series) of one solver and prompt
    source whose parameters are one setting once the omitted ones take their declared defaults and
    every value is read as Param.check reads it ("mean-y" from a config that left shift out,
    "mean-y shift=0" from one that wrote the default): their rows are other cells (the cell key is
    the parameters as written), so they stay two series, and the note says they are one setting
    (a plugin author's review found two series of equal numbers unexplained). Only rows of the
    same code and input files (`code_sha256`, `inputs_sha256`) are compared: the defaults are the
    code's here, and a parameter may name files (models_dir = "m" in two folders). A solver that
    does not load here has unknown defaults: no note."""
    groups: dict[tuple, list[str]] = {}
    column = lambda c: table[c].fillna("").astype(str) if c in table else pd.Series("", index=table.index)  # noqa: E731
    rows = zip(table["solver"], table["solver_params"], column("prompts"), column("code_sha256"),
               column("inputs_sha256"), table["series"])
    for solver, p, src, code, inputs, series in dict.fromkeys(rows):
        try:
            declared, given = get_solver_class(solver).params, json.loads(p) if p else {}
            if not isinstance(given, dict) or set(given) - set(declared):
                continue
            values = {k: declared[k].check(solver, k, given.get(k, declared[k].default)) for k in declared}
        except Exception:  # noqa: BLE001 - not loadable here, or values it now refuses: nothing to compare
            continue
        key = (solver, src, code, inputs, json.dumps(values, sort_keys=True, default=str))
        if series not in groups.setdefault(key, []):
            groups[key].append(series)
    return [f"{' and '.join(labels)} are one setting of {solver} (parameters left out take their declared "
            "defaults): runs that wrote a default and runs that left it out are shown apart"
            for (solver, *_), labels in groups.items() if len(labels) > 1]


def _value(v) -> str:
    """A parameter value in a series label: 1e-05, 16, true, text as it is; text that is empty, holds a
    space or does not print (a newline, NUL) is quoted as JSON (models_dir="" would read as unset)."""
    if isinstance(v, str) and (not v or " " in v or not v.isprintable()):
        return json.dumps(v)
    if isinstance(v, bool):  # as a config writes it (TOML), not Python's True (a plugin author's review)
        return "true" if v else "false"
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


MARKERS = ["o", "s", "^", "D", "v", "P", "X", "<", ">", "h"]
DASHES = ["-", "--", "-.", ":", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 1))]
FAMILY_PALETTE = "tab10"
# the built-in families keep their tab10 colour in every figure and run; plugins take the rest
KNOWN_FAMILIES = {"gd": 0, "ln": 1, "ols": 2, "scipy": 3, "trained": 4}


def family(solver: str) -> str:
    """The solver family: the name up to its first "-" ("gd-lsa" -> "gd", "trained-l1" -> "trained")."""
    return solver.split("-", 1)[0]


def series_styles(series: pd.DataFrame) -> dict[str, dict]:
    """series label -> matplotlib style {color, marker, linestyle, family}.

    Args:
        series: one row per series with columns "series", "solver", "series_rank" (report.add_series).
    Colours: one tab10 hue per family (fixed for the built-in families, KNOWN_FAMILIES; a plugin
    family's from its name, _plugin_colours), shades of it per solver;
    line style: by solver within its family (and by prompt source within the solver when the rows
    hold several `prompts`); marker: by the rank of the parameter set (solver_params) within its
    solver (so gd steps=4 and gd-lsa steps=4 share one, whatever their source), or, for a solver
    run with one parameter set, by the solver within its family (the four trained-* solvers: four
    markers, not four circles).
    """
    rows = series.drop_duplicates("series").sort_values("series_rank")
    params = rows["solver_params"] if "solver_params" in rows else rows["series"]  # (a table of labels only)
    source = rows["prompts"].fillna("") if "prompts" in rows else pd.Series("", index=rows.index)
    sources = list(dict.fromkeys(source))  # several: each its line style within a solver
    families = list(dict.fromkeys(family(s) for s in rows["solver"]))
    tab = sns.color_palette(FAMILY_PALETTE, 10)
    colours = {f: tab[KNOWN_FAMILIES[f]] for f in families if f in KNOWN_FAMILIES}
    colours.update(_plugin_colours([f for f in families if f not in KNOWN_FAMILIES], tab))
    out = {}
    for fam in families:
        colour = colours[fam]
        solvers = list(dict.fromkeys(s for s in rows["solver"] if family(s) == fam))
        shades = _shades(colour, len(solvers))  # darkest first; one solver keeps the family colour
        for k, (solver, shade) in enumerate(zip(solvers, shades)):
            mine = rows[rows["solver"] == solver]
            sets = list(dict.fromkeys(params[mine.index]))  # its parameter sets, in series order
            for s, p, src in zip(mine["series"], params[mine.index], source[mine.index]):
                m = sets.index(p) if len(sets) > 1 else k  # one parameter set: the solver's own marker (k) in its family
                dash = DASHES[(k * len(sources) + sources.index(src)) % len(DASHES)]
                out[s] = {"color": shade, "marker": MARKERS[m % len(MARKERS)], "linestyle": dash, "family": fam}
    return out


def _plugin_colours(others: list[str], tab: list) -> dict[str, tuple]:
    """Colours of the families outside KNOWN_FAMILIES (plugins): each takes the free tab10 colour its
    name hashes to (crc32, the same in every process), or the next free one after a family earlier in
    name order took it, so a plugin keeps its colour from one publish to the next whichever other
    plugins are present, as long as no other one collides with it; past the 5 free colours, husl."""
    free = [c for i, c in enumerate(tab) if i not in KNOWN_FAMILIES.values()]
    out, taken = {}, set()
    for f in sorted(others):
        if len(taken) == len(free):
            break
        slot = zlib.crc32(f.encode()) % len(free)
        while slot in taken:
            slot = (slot + 1) % len(free)
        taken.add(slot)
        out[f] = free[slot]
    rest = [f for f in sorted(others) if f not in out]
    out.update(zip(rest, sns.color_palette("husl", len(rest))))
    return out


def _shades(colour, n: int) -> list:
    """n distinguishable shades of one colour: mixed towards black and towards white."""
    if n == 1:
        return [colour]
    c = np.asarray(colour, dtype=float)
    mix = np.linspace(-0.45, 0.5, n)  # < 0: towards black, > 0: towards white
    return [tuple(c * (1 + m) if m < 0 else c + (1 - c) * m) for m in mix]
