"""Short labels of prompt sources, for series labels when the published runs hold several.

A result row's `prompts` column is the canonical JSON of its prompt source (bench/cells.py): a
[prompts] table of distributions ({"x": {"dist", "loc", "scale"}, "slope": ..., "intercept": ...})
or a CSV file ({"csv": {"path", "x", "y"}}). Rows of two sources are different experiments, so
report.add_series appends a source label to the series label when the table holds more than one
(docs/report.md, "Series"):

    CSV file       its file name and columns: "d2.csv x→y" (the whole path when two sources share
                   a file name and columns)
    distributions  the fields whose distribution differs between the distribution sources:
                   "x=normal(0, 5)"; a lone distribution source beside CSV files names its fields
                   that are not standard normal, or reads "default [prompts]"
    ""             a run from before the column: "prompts not recorded"

Labels that would still coincide fall back to the source's JSON, so distinct sources always get
distinct labels.
"""
from __future__ import annotations

import json
from pathlib import PurePath

FIELDS = ("x", "slope", "intercept")  # the [prompts] table's entries, in the order a label names them
DEFAULT = {"dist": "normal", "loc": 0.0, "scale": 1.0}  # prompts/generator.py: Dist()


def _parse(source: str):
    try:
        return json.loads(source) if source else None
    except ValueError:
        return None


def _dist(d) -> str:
    """normal(0, 5) for {"dist": "normal", "loc": 0.0, "scale": 5.0} (mean, standard deviation);
    uniform[-1, 1] for {"dist": "uniform", "loc": -1.0, "scale": 2.0}, its interval [loc, loc + scale]
    (prompts/generator.py: Dist; "uniform(-1, 2)" read as U(-1, 2): a review); other values as JSON."""
    if isinstance(d, dict) and {"dist", "loc", "scale"} <= set(d):
        try:
            lo, scale = float(d["loc"]), float(d["scale"])
            if d["dist"] == "uniform":
                return f"uniform[{lo:g}, {lo + scale:g}]"
            return f"{d['dist']}({lo:g}, {scale:g})"
        except (TypeError, ValueError):
            pass
    return json.dumps(d, sort_keys=True)


def _csv_label(csv: dict, full: bool) -> str:
    path = str(csv.get("path", ""))
    name = path if full else PurePath(path).name or path
    return f"{name} {csv.get('x', '')}→{csv.get('y', '')}"


def source_labels(sources) -> dict[str, str]:
    """{source JSON: short label} for the distinct `sources`; every label "" when there is one."""
    sources = list(dict.fromkeys(sources))
    if len(sources) <= 1:
        return {s: "" for s in sources}
    parsed = {s: _parse(s) for s in sources}
    csvs = {s: p["csv"] for s, p in parsed.items() if isinstance(p, dict) and isinstance(p.get("csv"), dict)}
    dists = {s: p for s, p in parsed.items() if isinstance(p, dict) and s not in csvs}
    names = [*FIELDS, *sorted({k for p in dists.values() for k in p} - set(FIELDS))]
    differ = [k for k in names if len({json.dumps(p.get(k), sort_keys=True) for p in dists.values()}) > 1]
    short = {s: _csv_label(c, False) for s, c in csvs.items()}
    labels = {}
    for s in sources:
        if s in csvs:
            full = sum(v == short[s] for v in short.values()) > 1  # d.csv in two folders: the paths tell them apart
            labels[s] = _csv_label(csvs[s], full)
        elif s in dists:
            p = dists[s]
            keys = differ or [k for k in names if k in p and p[k] != DEFAULT]
            labels[s] = " ".join(f"{k}={_dist(p.get(k))}" for k in keys) or "default [prompts]"
        else:
            labels[s] = "prompts not recorded" if not s else s
    taken = list(labels.values())
    return {s: (s or "prompts not recorded") if taken.count(v) > 1 else v for s, v in labels.items()}


def lone_source_label(sources) -> str:
    """The label of the one prompt source of `sources` when it is not the default generator (a CSV
    file: "msft.csv Open→Close"; a [prompts] table: its fields that are not standard normal), else
    "" (several sources: the series labels name them; the default: nothing to say). For the
    headline's heading, which otherwise never said a run's prompts came from a CSV file (a review)."""
    distinct = [s for s in dict.fromkeys(sources) if s]
    if len(distinct) != 1 or not isinstance(p := _parse(distinct[0]), dict):
        return ""
    if isinstance(p.get("csv"), dict):
        return _csv_label(p["csv"], False)
    return " ".join(f"{k}={_dist(p[k])}" for k in FIELDS if k in p and p[k] != DEFAULT)


def has_csv(sources) -> bool:
    """Whether any of `sources` (a rows' `prompts` column) is a CSV file."""
    return any(isinstance(p := _parse(str(s)), dict) and isinstance(p.get("csv"), dict) for s in dict.fromkeys(sources))
