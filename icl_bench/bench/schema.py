"""The result schema: the columns of one result row (one row per cell) and their dtypes.

The one definition used by the runner (bench/runner.py), the store (bench/store.py) and the
report (report/aggregate.py). The columns follow docs/design.md ("Result row"); the grid axes
come from bench/axes.py, in that order, after the solver's name and parameters.
"""
from __future__ import annotations

import math

import pandas as pd

from icl_bench.bench.axes import AXES

# (column, pandas dtype); "object" columns hold text.
SCHEMA: tuple[tuple[str, str], ...] = (
    ("solver", "object"), ("solver_params", "object"),  # name, canonical JSON of its parameters
    *((a.name, a.column_dtype) for a in AXES),
    ("seed", "int64"), ("n_prompts", "int64"),
    ("mse_vs_ols", "float64"), ("mse_vs_truth", "float64"), ("mse_vs_target", "float64"),
    ("abs_err_median", "float64"), ("abs_err_p99", "float64"),  # quantiles of |pred - ols|
    ("n_nonfinite", "int64"),  # predictions that are NaN / inf (-1: no predictions, status != ok)
    ("prompts_per_s", "float64"), ("batch_size", "int64"),
    ("weight_sparsity", "float64"), ("weight_l1", "float64"),  # NaN for solvers without weights
    ("status", "object"), ("message", "object"),  # ok / error / skipped, and why
    ("prompts", "object"),  # canonical JSON of the prompt source (distributions or CSV file)
    ("data_sha256", "object"), ("inputs_sha256", "object"),  # digests of the CSV's bytes and of the files the
    #   solver read (checkpoints); "" where none: what else made the cell's numbers (bench/cells.py, Cell)
    ("code_sha256", "object"),  # digest of the code that computed the row (provenance.code_digest); "" if unknown
    ("started_at", "object"), ("elapsed_s", "float64"),
    ("mse_vs_ols_se", "float64"), ("mse_vs_truth_se", "float64"),  # standard errors over the prompts
    ("executor", "object"), ("worker", "object"),  # where the cell ran: local / dask, the worker's address
    ("concurrency", "float64"),  # cells running on that machine while it was timed (NaN: not timed)
    ("n_ill_posed", "int64"),  # prompts whose OLS reference is not finite (no least-squares answer; -1 as above)
    ("n_nonfinite_well_posed", "int64"),  # of n_nonfinite, those on the other prompts (-1 as above)
)
COLUMNS: list[str] = [c for c, _ in SCHEMA]
DTYPES: dict[str, str] = dict(SCHEMA)
TIMING_COLUMNS = ("prompts_per_s", "started_at", "elapsed_s", "executor", "worker", "concurrency")  # vary run to run
CELL_COLUMNS = ("solver", "solver_params", *(a.name for a in AXES), "seed", "n_prompts", "batch_size",
                "prompts", "data_sha256", "inputs_sha256", "code_sha256")  # copied from the Cell; the store keeps only the others
RESULT_COLUMNS = tuple(c for c in COLUMNS if c not in CELL_COLUMNS)
METRIC_COLUMNS = ("mse_vs_ols", "mse_vs_truth", "mse_vs_target", "abs_err_median", "abs_err_p99",
                  "prompts_per_s", "weight_sparsity", "weight_l1", "mse_vs_ols_se", "mse_vs_truth_se")
STATUSES = ("ok", "error", "skipped")
NO_COUNTS = {"n_nonfinite": -1, "n_ill_posed": -1, "n_nonfinite_well_posed": -1}  # a row without predictions


def from_json(row: dict) -> dict:
    """A row read back from standard JSON: null -> NaN in the float columns."""
    return {c: (math.nan if row.get(c) is None and DTYPES[c] == "float64" else row.get(c)) for c in COLUMNS}


def table(rows: list[dict]) -> pd.DataFrame:
    """The result table of `rows` with exactly COLUMNS, in order, with their dtypes."""
    df = pd.DataFrame(rows, columns=COLUMNS)
    return df.astype({c: t for c, t in SCHEMA if t != "object"})
