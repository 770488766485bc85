"""Loading run folders for the report: results.parquet and metadata.json, checked against the
result schema (validate.py), older tables filled in (BACKFILL), and rows of one cell and seed from
several runs accepted as repeats only when they saw the same prompts (REPEAT_SAME).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from icl_bench.bench.axes import AXIS_NAMES, BY_NAME
from icl_bench.errors import ConfigError
from icl_bench.files import refuse_link_loop
from icl_bench.report.validate import check_table, read_metadata

AXES = AXIS_NAMES  # the grid axes of a result row (their one definition: bench/axes.py)
# axes added after runs were first published; a table without the column has the one default value
BACKFILL = {"d": 1, "ood": "none"}
KEYS = ["solver", "solver_params", *AXES, "prompts"]  # one summary row per distinct KEYS
REQUIRED = ["solver", "solver_params", *(a for a in AXES if a not in BACKFILL), "seed", "n_prompts",
            "mse_vs_ols", "mse_vs_truth",
            "prompts_per_s", "weight_sparsity", "weight_l1", "status", "message"]

def load_run(path: str | Path) -> tuple[pd.DataFrame, dict | None]:
    """Read one run folder.

    Args:
        path: a folder written by `icl-bench run` (results.parquet, optionally metadata.json).
    Returns:
        (table with a "run" column holding the folder path, metadata dict or None if absent).
    Raises:
        ConfigError: the folder is missing, has no results.parquet, the parquet or metadata.json
            cannot be read (metadata.json: or is not a JSON object), a required column is missing,
            the table has no rows, or it does not fit the result schema (validate.check_table).
    """
    path = Path(path)
    refuse_link_loop(path, "RUN_DIR", "give the --out folder of `icl-bench run`")  # not "is not a folder"
    if not path.is_dir():
        raise ConfigError(f"RUN_DIR: {path} is not a folder (expected the --out folder of `icl-bench run`)")
    parquet = path / "results.parquet"
    if not parquet.is_file():
        hint = (f"an unfinished run: complete it with `icl-bench run --resume --out {path}`, which reads the config it recorded"
                if (path / "cells.sqlite").is_file()
                else "is it the --out folder of `icl-bench run`?")
        raise ConfigError(f"RUN_DIR: {path} has no results.parquet ({hint})")
    try:
        table = pd.read_parquet(parquet)
    except Exception as exc:  # pyarrow raises several types for truncated / foreign files
        raise ConfigError(f"RUN_DIR: {parquet} cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
    if "ood" not in table.columns:  # runs from before the ood axis: all in-distribution
        table["ood"] = "none"
    missing = [c for c in REQUIRED if c not in table.columns]
    if missing:
        raise ConfigError(f"RUN_DIR: {parquet} lacks the columns {', '.join(missing)}")
    if table.empty:
        raise ConfigError(f"RUN_DIR: {parquet} has no rows")
    table = check_table(table, parquet)  # a table icl-bench did not write: one line, not a traceback
    meta = read_metadata(path)  # None when absent; ConfigError when unreadable or not an object
    for col in ("mse_vs_ols_se", "mse_vs_truth_se", "prompts", "data_sha256", "inputs_sha256", "code_sha256"):  # older runs:
        if col not in table.columns:  # no SE, one prompt source, no digests of their inputs
            table[col] = math.nan if col.endswith("_se") else ""
    for axis, value in BACKFILL.items():  # older runs: one regressor
        if axis not in table.columns:
            table[axis] = pd.Series(value, index=table.index, dtype=BY_NAME[axis].column_dtype)
    return table.assign(run=str(path)), meta


def unfinished_notes(metas: dict) -> list[str]:
    """One note per run folder of `metas` (path -> metadata dict, None when absent: load_run) that
    has no metadata.json. `icl-bench run` writes it last, so without it nothing marks the folder a
    finished run (docs/design.md §10): it stopped before writing it, or was copied without it, and
    its tables may lack cells. Publish still reads the folder; the note says so and how to finish it."""
    return [f"run {run}: no metadata.json, which `icl-bench run` writes last, so nothing marks it a finished run "
            "(it stopped before writing it, or was copied without it) and its tables may lack cells; complete it "
            f"with `icl-bench run --resume --out {run}`, which reads the config it recorded"
            for run, meta in metas.items() if meta is None]


def shared_timing(rows: pd.DataFrame) -> pd.Series:
    """(rows,) bool: the ok rows whose prompts_per_s was timed while other icl-bench cells ran on
    the same machine (concurrency > 1; False where it is not recorded: runs from before the column)."""
    if "concurrency" not in rows.columns:
        return pd.Series(False, index=rows.index)
    return (rows["status"] == "ok") & (rows["concurrency"].astype(float) > 1)


def shared_timing_notes(table: pd.DataFrame) -> list[str]:
    """A note when ok rows were timed while other cells ran on their machine, naming how many and
    where. Their throughput is kept (a run beside another one on a shared machine would otherwise
    show none) but it measures the load too: docs/design.md §10, docs/scale-out.md "Honest timing"."""
    shared = shared_timing(table)
    if not shared.any():
        return []
    n_ok = int((table["status"] == "ok").sum())
    runs = ", ".join(sorted(set(table.loc[shared, "run"])))
    return [f"throughput: {int(shared.sum())} of {n_ok} ok rows were timed while other icl-bench cells ran on the "
            f"same machine (concurrency > 1, in {runs}): their prompts/s measure that load too and understate the "
            "solver alone; quote only rows with concurrency == 1 (results.parquet), or time with the local executor "
            "on an otherwise idle machine: concurrency counts icl-bench's own cells only, not other load "
            "(docs/scale-out.md, \"Honest timing\")"]


REPEAT_SAME = {  # a column that must agree between rows of one cell and seed, and what it means when not
    "n_prompts": "another n_prompts draws other prompts (a cell's n prompts are not the first n of a larger batch)",
    "data_sha256": "the CSV file's bytes differ (other data under the same path)",
    "inputs_sha256": "the solver read other files (checkpoints)",
    "code_sha256": ("the solver's code differs (its package or icl-bench was edited, or torch / numpy / numba / "
                    "scipy upgraded, between the runs)"),
}


def check_repeats(table: pd.DataFrame) -> None:
    """Rows of one cell and seed are averaged as repeats (they saw the same prompts through the same
    solver), which holds only when they agree in every REPEAT_SAME column; otherwise they are
    neither repeats nor independent seeds. Rows of runs from before the digest columns ("") agree
    with anything. Raises ConfigError naming the cell, the differing values and their runs."""
    ok = table[table["status"] == "ok"]
    for col, why in REPEAT_SAME.items():
        values = ok[col] if col == "n_prompts" else ok[col].fillna("").replace("", np.nan)
        counts = values.groupby([ok[k] for k in [*KEYS, "seed"]], dropna=False).nunique()
        mixed = counts[counts > 1]
        if mixed.empty:
            continue
        key = dict(zip([*KEYS, "seed"], mixed.index[0]))
        rows = ok[np.logical_and.reduce([(ok[k] == v) | (ok[k].isna() & pd.isna(v)) for k, v in key.items()])]
        shown = {(int(v) if col == "n_prompts" else str(v)[:12], r) for v, r in zip(rows[col], rows["run"])
                 if col == "n_prompts" or (isinstance(v, str) and v)}
        seen = ", ".join(f"{v} in {run}" for v, run in sorted(shown))  # (digests: their first 12 hex digits)
        count = "the only such cell" if len(mixed) == 1 else f"one of {len(mixed)} such cells"
        raise ConfigError(f"RUN_DIR: {_cell_words(key)} has {col} {seen} ({count}): {why}, so these rows are "
                          "neither repeats nor independent seeds; publish such runs separately, or rerun one with "
                          "other seeds")


def _cell_words(key: dict) -> str:
    """One cell (KEYS and seed) in words: solver, parameters, grid values, seed."""
    parts = [key["solver"]]
    if isinstance(key["solver_params"], str) and key["solver_params"] not in ("", "{}"):
        parts.append(key["solver_params"])
    parts += [f"N={key['N']}", f"noise={key['noise']:g}", f"R={key['R']:g}", key["dtype"], key["device"]]
    if key["d"] != 1:
        parts.append(f"d={key['d']}")
    if key["ood"] != "none":
        parts.append(f"ood={key['ood']}")
    return " ".join([*parts, f"seed={key['seed']}"])
