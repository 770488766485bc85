"""Checks of what `icl-bench publish` reads from a run folder, before anything uses it, and of
the --at values it is given (read in the type of their axis).

A run folder may be old, hand-edited or not written by icl-bench at all; whatever is wrong with it
is refused as one ConfigError line that names the file and what was expected (the CLI prints it
and exits with code 2, docs/report.md), never a traceback from deep inside the report.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from icl_bench.bench.axes import AXES, BY_NAME
from icl_bench.bench.schema import DTYPES, METRIC_COLUMNS, STATUSES
from icl_bench.config_base import integer
from icl_bench.errors import ConfigError

KINDS = {**DTYPES, "rel_mse_vs_ols": "float64"}  # the schema, and a column report/mechanism.py reads if present
# value checks beyond the dtype: every grid axis as the matrix config checks it (bench/axes.py), and
# the seed and prompt count; each raises a config problem whose text says what is accepted
CHECKS = {**{a.name: a.check for a in AXES}, "seed": integer(0), "n_prompts": integer(1)}
# numeric columns of the schema that may hold NaN besides the metrics (noise: CSV data; the others:
# runs from before the runner always set them)
NAN_OK = {"noise", "n_nonfinite", "batch_size", "n_ill_posed", "n_nonfinite_well_posed"}
NAN_OK |= {c for c, t in DTYPES.items() if t == "float64" and c not in BY_NAME}
TEXT_MAY_BE_NULL = {"message", "data_sha256", "inputs_sha256", "code_sha256", "started_at", "executor", "worker"}
JSON_OBJECT = {"solver_params": "the canonical JSON of the solver's parameters",
               "prompts": "the canonical JSON of the prompt source"}


def read_metadata(path: Path) -> dict | None:
    """The run folder's metadata.json as a dict, or None when the folder has none.

    Raises:
        ConfigError: the file cannot be read, is not UTF-8 JSON, or is JSON but not an object
            (`icl-bench run` writes an object: config, seed, versions, device, start / end).
    """
    file = path / "metadata.json"
    if not file.is_file():
        return None
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"RUN_DIR: {file} cannot be read ({exc})") from None
    except RecursionError:  # json recurses once per nested array / object
        raise ConfigError(f"RUN_DIR: {file} cannot be read (JSON nested too deeply); expected a JSON object "
                          "(the metadata `icl-bench run` writes)") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"RUN_DIR: {file} holds a JSON {_json_kind(meta)}; expected a JSON object "
                          "(the metadata `icl-bench run` writes)")
    return meta


def _json_kind(value) -> str:
    """The JSON name of a decoded value's type (array, string, number, ...)."""
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")


def check_table(table: pd.DataFrame, parquet: Path) -> pd.DataFrame:
    """`table` (read from `parquet`) with every result-schema column it has in its schema dtype.

    Checked: numeric columns hold numbers (integer columns whole numbers), NaN only where the
    runner writes it (NAN_OK), metrics >= 0, weight_sparsity <= 1, n_nonfinite <= n_prompts; text columns hold text, null only where older runs may have it
    (TEXT_MAY_BE_NULL); status is one of STATUSES; solver_params and prompts are "" or a JSON
    object; grid axes, seed and n_prompts pass CHECKS. Columns the schema lacks are carried along
    unread; absent ones are the caller's business (load.load_run: REQUIRED, BACKFILL).
    Raises:
        ConfigError: one line naming `parquet`, the column, a bad value and what was expected.
    """
    cast = {}
    for col in table.columns:
        kind = KINDS.get(col)
        where = f"RUN_DIR: {parquet} column {col!r}"
        if kind == "object":
            _check_text(table[col], col, where)
        elif kind is not None:
            cast[col] = _numbers(table[col], col, kind, where)
    table = table.assign(**cast)
    if "weight_sparsity" in table and (table["weight_sparsity"] > 1).any():  # a fraction of the weights
        v = float(table["weight_sparsity"][table["weight_sparsity"] > 1].iloc[0])
        raise ConfigError(f"RUN_DIR: {parquet} column 'weight_sparsity' holds {v!r}; expected a fraction in [0, 1] (or NaN)")
    for col in ("n_ill_posed", "n_nonfinite_well_posed"):  # the headline's "(k of n NaN/inf)" and the pooling weights
        if {col, "n_prompts", "status"} <= set(table):
            ok = table[(table["status"] == "ok") & table[col].notna()]
            wrong = ok[(ok[col] < 0) | (ok[col] > ok["n_prompts"])]
            if len(wrong):
                r = wrong.iloc[0]
                raise ConfigError(f"RUN_DIR: {parquet} column {col!r} holds {r[col]:g} in an ok row of n_prompts "
                                  f"{r['n_prompts']:g}; expected 0 to n_prompts")
    if {"n_ill_posed", "n_nonfinite_well_posed", "n_nonfinite", "n_prompts", "status"} <= set(table):
        ok = table[table["status"] == "ok"]
        wrong = ok[(ok["n_ill_posed"] + ok["n_nonfinite_well_posed"] > ok["n_prompts"])
                   | (ok["n_nonfinite_well_posed"] > ok["n_nonfinite"])]
        if len(wrong):
            r = wrong.iloc[0]
            raise ConfigError(f"RUN_DIR: {parquet} holds an ok row with n_ill_posed {r['n_ill_posed']:g}, "
                              f"n_nonfinite_well_posed {r['n_nonfinite_well_posed']:g}, n_nonfinite {r['n_nonfinite']:g} "
                              f"and n_prompts {r['n_prompts']:g}; expected n_ill_posed + n_nonfinite_well_posed <= "
                              "n_prompts and n_nonfinite_well_posed <= n_nonfinite")
    if {"n_nonfinite", "n_prompts"} <= set(table) and (table["n_nonfinite"] > table["n_prompts"]).any():
        r = table[table["n_nonfinite"] > table["n_prompts"]].iloc[0]  # the headline read "(999 of 16 NaN)"
        raise ConfigError(f"RUN_DIR: {parquet} column 'n_nonfinite' holds {r['n_nonfinite']:g} in a row of "
                          f"n_prompts {r['n_prompts']:g}; expected at most n_prompts")
    return table


def _numbers(s: pd.Series, col: str, kind: str, where: str) -> pd.Series:
    """The column `s` as `kind` (int64 or float64), after its checks (see check_table)."""
    what = "integers" if kind == "int64" else "numbers"
    if s.map(_missing).all():  # a column of nulls only (pyarrow's null type reads back as object)
        s = pd.Series(math.nan, index=s.index)
    elif pd.api.types.is_bool_dtype(s) or not pd.api.types.is_numeric_dtype(s):
        v = next(v for v in s if not _missing(v))
        raise ConfigError(f"{where} holds {_shown(v)} ({type(v).__name__}); expected {what} ({kind})")
    if kind == "int64" and pd.api.types.is_integer_dtype(s):  # as written: exact (a seed may exceed 2^53)
        _check_values(s.unique().tolist(), col, where)
        return s.astype("int64")
    values = s.astype("float64")
    nan = values.isna()
    if nan.any() and col not in NAN_OK:
        raise ConfigError(f"{where} is NaN or null in {int(nan.sum())} of {len(s)} rows; expected {what} ({kind})")
    if kind == "int64":
        bad = values[~nan & ~(np.isfinite(values) & (values == values.round()) & (values.abs() < 2.0**63))]
        if not bad.empty:
            raise ConfigError(f"{where} holds {float(bad.iloc[0])!r}; expected {what} ({kind})")
    if col in METRIC_COLUMNS and (values < 0).any():  # errors, their standard errors, throughput, weights
        raise ConfigError(f"{where} holds {float(values[values < 0].iloc[0])!r}; expected numbers >= 0 (or NaN)")
    _check_values([int(v) if kind == "int64" else v for v in values[~nan].unique().tolist()], col, where)
    return values if kind == "float64" or nan.any() else values.astype("int64")


def _check_values(values: list, col: str, where: str) -> None:
    """Run column `col`'s value check (CHECKS: the axis or config check) on each distinct value."""
    if col not in CHECKS:
        return
    for v in values:
        try:
            CHECKS[col](v)
        except Exception as exc:  # noqa: BLE001 -- a config problem (pydantic) carrying its text
            raise ConfigError(f"{where}: {exc}") from None


def _check_text(s: pd.Series, col: str, where: str) -> None:
    """ConfigError unless the text column `s` passes its checks (see check_table)."""
    missing = s.map(_missing)
    if missing.any() and col not in TEXT_MAY_BE_NULL:
        raise ConfigError(f"{where} is null in {int(missing.sum())} of {len(s)} rows; expected text")
    other = [v for v in s[~missing] if not isinstance(v, str)]
    if other:
        raise ConfigError(f"{where} holds {_shown(other[0])} ({type(other[0]).__name__}); expected text")
    for v in s[~missing].unique().tolist():
        if col == "status" and v not in STATUSES:
            raise ConfigError(f"{where} holds {_shown(v)}; accepted: {', '.join(STATUSES)}")
        if col == "solver" and not (v.strip() and v.isprintable()):  # an unlabelled headline row (a review):
            raise ConfigError(f"{where} holds an empty name ({_shown(v)}); expected a solver's name")  # no run writes one
        if col in JSON_OBJECT and v != "" and not isinstance(decoded := _json(v), dict):
            why = "JSON nested too deeply to read" if decoded is TOO_DEEP else "not a JSON object"
            raise ConfigError(f"{where} holds {_shown(v)}, {why}; expected {JSON_OBJECT[col]}")
        if col in CHECKS:
            try:
                CHECKS[col](v)
            except Exception as exc:  # noqa: BLE001 -- a config problem (pydantic) carrying its text
                raise ConfigError(f"{where}: {exc}") from None


def _missing(v) -> bool:
    return v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v))


TOO_DEEP = object()  # _json's answer for JSON nested deeper than the decoder recurses


def _json(text: str):
    """The decoded JSON text, None when it is not JSON, TOO_DEEP when it nests too deeply to decode."""
    try:
        return json.loads(text)
    except ValueError:
        return None
    except RecursionError:  # json recurses once per nested array / object
        return TOO_DEEP


def _shown(v, limit: int = 60) -> str:
    """repr(v), cut to `limit` characters (one line: repr escapes newlines)."""
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def at_value(axis: str, text: str, values: pd.Series):
    """The value `--at AXIS=TEXT` names, in the axis's type (bench/axes.py): an integer for N and d
    ("4" and "4.0" are 4), a float for noise and R ("1e1" is 10.0, "nan" the NaN of CSV data), the
    text itself for dtype, device and ood.

    Args:
        axis: a grid axis name. text: the value as typed. values: the axis column of the ok cells.
    Raises:
        ConfigError: TEXT is not a number (numeric axes) or not an integer (N, d), or no ok cell
            has that value; the message lists the values the ok cells have.
    """
    have = sorted(values.dropna().unique().tolist())
    nan = bool(values.isna().any())
    accepted = ", ".join([*map(str, have), *(["nan"] if nan else [])])
    kind = BY_NAME[axis].column_dtype
    value = text
    if kind != "object":
        try:
            value = float(text)
        except ValueError:
            what = "integers" if kind == "int64" else "numbers"
            raise ConfigError(f"--at: {axis}={text} is not a number ({axis} takes {what}); accepted: {accepted}") from None
    if kind == "int64":
        if not (math.isfinite(value) and value == round(value)):
            raise ConfigError(f"--at: {axis}={text} is not an integer ({axis} takes integers); accepted: {accepted}")
        value = int(text) if text.strip().lstrip("+-").isdigit() else int(value)  # exact beyond 2**53
    if isinstance(value, float) and math.isnan(value) and nan:
        return value
    if value not in have:
        raise ConfigError(f"--at: {axis}={text} has no ok cells; accepted: {accepted}")
    return have[have.index(value)]  # the table's own value: noise=-0 titled the headline "noise = -0"
