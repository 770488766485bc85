"""The grid axes of the benchmark matrix: the one definition of each axis.

An axis has a name (the config key under [grid], the Cell field and the result column), its
default values, a validator for one value and the result column's dtype. The matrix config
(bench/config.py), the cell expansion (bench/cells.py), the result schema (bench/schema.py) and
the report (report/aggregate.py) all read this tuple; adding an axis means adding it here and
giving `Cell` a field of the same name that the prompt source or the solver reads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from icl_bench.config_base import choice, integer, number, problem
from icl_bench.errors import ConfigError
from icl_bench.prompts.generator import DTYPES
from icl_bench.prompts.multivariate import MAX_D
from icl_bench.prompts.ood import parse_ood

DEVICES = ("cpu", "cuda")


def shown(v: float) -> str:
    """A number as the report's tables and titles print it (6 significant digits): two grid values
    that print alike (R = 10.0 and 10.000000000000001) ran as two cells under one label, and
    `--at R=10` picked one of them (a review), so they are refused as one value."""
    return f"{v:g}"


def ood_value(v: Any) -> str:
    """One value of the `ood` axis: "none" or a map of prompts/ood.py ("x-shift:5", "outliers:0.1")."""
    try:
        parse_ood(v)
    except ConfigError as exc:
        raise problem(str(exc).split(": ", 1)[1]) from None
    return v


@dataclass(frozen=True)
class Axis:
    """One grid axis (see the module docstring)."""

    name: str
    default: tuple  # values when [grid] does not name the axis
    check: Callable[[Any], Any]  # one raw TOML value -> the checked value (raises a config problem)
    column_dtype: str  # pandas dtype of the result column
    numeric: bool  # True: plots may use it as an x axis; False: a categorical setting
    help: str
    same: Callable[[Any], Any] | None = None  # checked value -> canonical form (two values of one form: refused)


AXES: tuple[Axis, ...] = (
    Axis("N", (20,), integer(2), "int64", True, "context length: examples per prompt"),
    Axis("noise", (0.1,), number(ge=0), "float64", True, "std of the label noise (NaN for CSV data)", same=shown),
    Axis("R", (100.0,), number(gt=0), "float64", True, "the constant in every token's third slot", same=shown),
    Axis("dtype", ("float32",), choice(tuple(DTYPES)), "object", False, "floating-point type of prompts and solver"),
    Axis("device", ("cpu",), choice(DEVICES), "object", False, "torch device the solver runs on"),
    Axis("d", (1,), integer(1, MAX_D), "int64", True,
         "regressors per example (x in R^d; d > 1: docs/ln-closed-form-multivariate.md)"),
    Axis("ood", ("none",), ood_value, "object", False,
         "out-of-distribution map of the prompts (prompts/ood.py): none, x-shift:T, x-scale:S, student-t:NU, outliers:F",
         same=parse_ood),  # "x-shift:5" and "x-shift:5.0" name one map: ("x-shift", 5.0)
)
AXIS_NAMES: tuple[str, ...] = tuple(a.name for a in AXES)
BY_NAME: dict[str, Axis] = {a.name: a for a in AXES}
