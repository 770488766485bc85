"""Matrix config: a TOML file -> a validated `MatrixConfig` (docs/design.md, "Matrix config").

A list is a grid axis, a scalar a fixed value. Every problem raises `ConfigError` with one line
that names the key and the accepted values, before anything is written to disk.

    seed = 0                 # base seed; each grid point derives its own
    n_prompts = 2048         # prompts per cell
    batch_size = 2048        # prompts per predict() call
    [grid]                   # the axes of bench/axes.py (N, noise, R, dtype, device): lists or scalars
    [prompts]                # x / slope / intercept = { dist, loc, scale } (default standard normal)
    all_solvers = true       # run every registered solver (default: true iff there is no [solvers])
    [solvers.NAME]           # one table per solver, its parameters (lists = grids); with
                             # all_solvers, the solvers not named here run with their defaults
    [data]                   # optional CSV prompt source: path, x, y (columns)
    [timing]                 # repeats (median reported), max_seconds (stop repeating after),
                             # threads (torch threads for the run; 0 = torch's default)
    [executor]               # where cells run (docs/scale-out.md): kind = "local" | "dask",
                             # scheduler, n_workers, exclusive_timing, retries
"""
from __future__ import annotations

import itertools
import json
import math
import os
from collections import Counter
from pathlib import Path
from typing import Annotated, Any, Optional
from urllib.parse import urlsplit

from pydantic import BeforeValidator, Field, ValidationInfo, create_model, field_validator, model_validator

from icl_bench.bench.axes import AXES
from icl_bench.bench.contract import torch_defaults_kept
from icl_bench.config_base import (FLOAT_MAX, FLOAT_TINY, MAX_SEED, MAX_THREADS, ConfigModel, axis_list, choice, flag, integer,
                                   number, problem, read_toml, text, top_level_hint, validate)
from icl_bench.errors import ConfigError
from icl_bench.prompts.data import DataSource, check_source
from icl_bench.prompts.generator import DISTRIBUTIONS, MAX_VALUES, Dist
from icl_bench.prompts.ood import needs_generator

MAX_PROMPTS = 2**24  # n_prompts and batch_size: torch.quantile (abs_err_* metrics) takes <= 2**24 values
MAX_CELLS = 10**6  # cells of one matrix: each is an object in memory before the first runs (~1 KB)
EXECUTORS = ("local", "dask")

Grid = create_model(  # one field per axis of bench/axes.py, in that order
    "Grid", __base__=ConfigModel,
    **{a.name: (Annotated[list, BeforeValidator(axis_list(a.check, same=a.same))], list(a.default)) for a in AXES},
)
Grid.__getitem__ = lambda self, name: getattr(self, name)  # cfg.grid["N"]
Grid.__doc__ = "The [grid] table: one list of values per axis (bench/axes.py)."


class DistTable(ConfigModel):
    """One `[prompts]` entry: {dist, loc, scale} (prompts/generator.py: Dist)."""

    dist: Annotated[str, BeforeValidator(choice(DISTRIBUTIONS, "distribution"))] = "normal"
    loc: Annotated[float, BeforeValidator(number())] = 0.0
    scale: Annotated[float, BeforeValidator(number(ge=0))] = 1.0

    def to_dist(self) -> Dist:
        return Dist(self.dist, self.loc, self.scale)


class Prompts(ConfigModel):
    """The [prompts] table: distributions of x, slope and intercept (default standard normal)."""

    x: DistTable = DistTable()
    slope: DistTable = DistTable()
    intercept: DistTable = DistTable()


class Timing(ConfigModel):
    """The [timing] table (bench/timing.py is the policy)."""

    repeats: Annotated[int, BeforeValidator(integer(1))] = 3  # timed passes; the median is reported
    max_seconds: Annotated[float, BeforeValidator(number(gt=0))] = 1.0  # stop repeating after this much timing
    # torch threads (0: torch's default). One by default (docs/design.md): with torch's default, two
    # threads on a loaded 2-core machine timed a plugin's cells 250x slower than one (found by a review)
    threads: Annotated[int, BeforeValidator(integer(0, MAX_THREADS))] = 1


class Executor(ConfigModel):
    """The [executor] table: where the cells run (bench/executors.py, docs/scale-out.md). Not part
    of the run's identity: --resume may continue a run on another executor, with the same table."""

    kind: Annotated[str, BeforeValidator(choice(EXECUTORS))] = "local"  # local: this process; dask: a cluster
    scheduler: Annotated[str, BeforeValidator(text)] = ""  # dask: tcp://host:8786 of a running cluster; "": a LocalCluster
    n_workers: Annotated[int, BeforeValidator(integer(1))] = 2  # LocalCluster: processes, one thread each (at most 4 per CPU: below)
    exclusive_timing: Annotated[bool, BeforeValidator(flag)] = False  # one timed cell per machine at a time
    retries: Annotated[int, BeforeValidator(integer(0, 100))] = 2  # LocalCluster: re-runs after a worker died

    @model_validator(mode="after")
    def _scheduler_needs_dask(self) -> "Executor":
        if self.scheduler and self.kind != "dask":
            raise problem('only with kind = "dask"', key="scheduler")
        if self.scheduler:  # an impossible port waited 10 s for "Timed out trying to connect" (a review)
            try:
                port = urlsplit(self.scheduler if "://" in self.scheduler else f"tcp://{self.scheduler}").port
            except ValueError:
                port = 0
            if not port:  # (None: no port given)
                raise problem(f"{self.scheduler!r} has no valid port; accepted: tcp://HOST:PORT, PORT 1-65535 "
                              "(a Dask scheduler listens on 8786 by default)", key="scheduler")
        for key, what in (("n_workers", "the processes of its LocalCluster"), ("retries", "re-runs after a worker died")):
            if key in self.model_fields_set and self.kind != "dask":  # a local run would ignore it (retries: a review)
                raise problem(f'only with kind = "dask" ({what})', key=key)
            # a running cluster has its own workers and allowed-failures: the value was recorded as if applied (a review)
            if key in self.model_fields_set and self.scheduler:
                raise problem("only for the LocalCluster a run starts, not with a scheduler (a running cluster has its "
                              "own: set them where it is started)", key=key)
        most = 4 * (os.cpu_count() or 1)  # 1024 processes on 2 cores ran no cell in 5 minutes
        if self.kind == "dask" and not self.scheduler and self.n_workers > most:
            raise problem(f"{self.n_workers} LocalCluster processes on this machine's {os.cpu_count()} CPUs; "
                          f"at most {most} (a larger cluster: start it yourself and pass its scheduler)", key="n_workers")
        return self


def _repeated(values: list) -> bool:
    """Whether two of `values` are equal (a set: linear in the list, where all pairs took hours for
    10^6 values; every pair for unhashable values)."""
    try:
        return len(set(values)) < len(values)
    except TypeError:
        return any(a == b for i, a in enumerate(values) for b in values[:i])


def _solver_grid(name: str, params: Any) -> list[dict]:
    """Expand one [solvers.NAME] table into its parameter sets; ConfigError for bad ones."""
    from icl_bench.solvers.registry import SolverLoadError, UnknownSolverError, get_solver_class

    if not isinstance(params, dict):
        raise ConfigError(f"solvers.{name}: must be a table of parameters (got {params!r})")
    try:
        cls = get_solver_class(name)
    except UnknownSolverError as exc:
        raise ConfigError(f"solvers.{name}: {str(exc).split(': ', 1)[1]}") from None
    except SolverLoadError:  # recorded as error rows by the runner; the rest still runs
        cls = None
    axes = {k: (v if isinstance(v, list) else [v]) for k, v in params.items()}
    for k, v in axes.items():
        if not v:
            raise ConfigError(f"solvers.{name}.{k}: empty list; give at least one value")
    if cls is None:  # a list is a grid here too: one error row per value, and config.json records the sets that a
        # --resume validates once the plugin loads (the unexpanded list read as one value there: it was refused as
        # 'expected float', and the config file as another config; found by a review)
        for k, v in axes.items():  # values equal in Python (1 and 1.0) would be one cell of a loaded float parameter:
            if _repeated(v):  # refused now, as they will be then (a --resume from config.json ran them twice)
                raise ConfigError(f"solvers.{name}.{k}: repeated values in {v!r}")
        return [dict(zip(axes, vals)) for vals in itertools.product(*axes.values())]
    declared = getattr(cls, "params", {})
    for k, v in axes.items():
        if k in declared:  # values that check to the same one (4 and 4, or 1 and 1.0 for a float) give one
            checked = [declared[k].check(name, k, x) for x in v]  # solver twice, under one row key
            if declared[k].same is not None:  # e.g. two spellings of one folder
                checked = [declared[k].same(c) for c in checked]
            if _repeated(checked):
                raise ConfigError(f"solvers.{name}.{k}: repeated values in {v!r}")
    combos = [dict(zip(axes, vals)) for vals in itertools.product(*axes.values())]
    for combo in combos:
        try:
            with torch_defaults_kept([]):  # a constructor's set_default_dtype is not the run's (bench/contract.py)
                cls(**combo)
        except ConfigError as exc:  # the solver contract's parameter errors (Param.check, unknown parameter, a
            # solver's own check of its values): already "solvers.NAME.PARAM: ...". A top-level key written
            # below [solvers.NAME] (`n_prompts = 16`) gets the hint of where it belongs (a review)
            hints = [(k, top_level_hint(k, MatrixConfig)) for k in combo if k not in declared]
            key, hint = next(((k, h) for k, h in hints if h), (None, ""))
            if hint and str(exc).startswith(f"solvers.{name}.{key}: unknown parameter"):
                raise ConfigError(f"{exc}{hint}") from None
            raise
        except KeyboardInterrupt:
            raise
        except BaseException:  # anything else (a plain ValueError, SystemExit, GeneratorExit) is the solver failing
            pass  # to build, not bad input: its cells become error rows with the exception (bench/runner.py: run_cell)
    return combos


class MatrixConfig(ConfigModel):
    """A validated benchmark matrix (see the module docstring for the TOML form)."""

    seed: Annotated[int, BeforeValidator(integer(0, MAX_SEED))] = 0
    n_prompts: Annotated[int, BeforeValidator(integer(1, MAX_PROMPTS))] = 2048
    batch_size: Annotated[int, BeforeValidator(integer(1, MAX_PROMPTS))] = 2048
    all_solvers: Annotated[bool, BeforeValidator(flag)] = True  # also run every other registered solver
    grid: Grid = Field(default_factory=Grid)
    prompts_: Prompts = Field(default_factory=Prompts, alias="prompts")
    solvers: dict[str, Any] = Field(default_factory=dict)  # name -> expanded parameter sets (list of dicts)
    data: Optional[DataSource] = None
    timing: Timing = Field(default_factory=Timing)
    executor: Executor = Field(default_factory=Executor)

    @model_validator(mode="before")
    @classmethod
    def _default_all_solvers(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and "all_solvers" not in raw:
            raw = {**raw, "all_solvers": "solvers" not in raw}
        return raw

    @field_validator("solvers", mode="before")
    @classmethod
    def _solvers(cls, raw: Any) -> dict:
        if not isinstance(raw, dict):
            raise problem(f"must be a table (got {type(raw).__name__})")
        return raw  # expanded in _check (needs all_solvers)

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> "MatrixConfig":
        g = self.grid
        if self.n_prompts * (max(g.N) + 1) * max(g.d) > MAX_VALUES:
            what = "n_prompts * (N + 1)" + (" * d" if max(g.d) > 1 else "")
            raise problem(f"{what} = {self.n_prompts * (max(g.N) + 1) * max(g.d)} prompt values exceed "
                          f"{MAX_VALUES} per grid point; lower n_prompts or N" + (" or d" if max(g.d) > 1 else ""),
                          key="n_prompts")
        if self.data is not None and max(g.d) > 1:
            raise problem("CSV data has one regressor (its x column); the grid's d must be [1]", key="grid.d")
        if self.data is not None and "noise" in g.model_fields_set:  # a given value would be ignored
            raise problem(f"{g.noise} would be ignored: CSV prompts ([data] / --data) take y from the file, so "
                          "there is no label noise to set (the rows' noise is NaN); remove grid.noise", key="grid.noise")
        if self.data is not None and any(needs_generator(v) for v in g.ood):  # it redraws x from the
            raise problem("student-t redraws the prompts from their slope and intercept, which CSV prompts ([data] / "  # generator
                          "--data) do not have; accepted with CSV prompts: none, x-shift:T, x-scale:S, outliers:F",
                          key="grid.ood")
        given = [k for k in ("x", "slope", "intercept") if k in self.prompts_.model_fields_set]
        if self.data is not None and given:
            raise problem("would be ignored: CSV prompts ([data] / --data) take x and y from the file, so no "
                          "distribution is drawn from; remove the [prompts] table", key=f"prompts.{given[0]}")
        for dtype in g.dtype:
            for R in g.R:
                if R > FLOAT_MAX[dtype]:
                    raise problem(f"R={R:g} overflows {dtype} (max {FLOAT_MAX[dtype]:.3g}); lower R or drop {dtype}", key="grid.R")
                if R < FLOAT_TINY[dtype]:  # rounds to 0 or a subnormal in the tokens: no constant to divide by
                    raise problem(f"R={R:g} underflows {dtype} (min {FLOAT_TINY[dtype]:.3g}); raise R or drop {dtype}", key="grid.R")
        if not self.solvers and not self.all_solvers:  # nothing would run: an empty run publish refuses
            if "solvers" in (info.context or {}).get("given", ()):
                raise problem("empty table; name at least one solver, remove [solvers] or set all_solvers = true", key="solvers")
            raise problem("no solver to run; add a [solvers.NAME] table, pass --solver NAME or set all_solvers = true",
                          key="solvers")
        return self

    def to_dict(self) -> dict:
        """Plain dict of the validated values (config.json, metadata.json), without_generator_fields."""
        return without_generator_fields(super().to_dict())

    @property
    def prompts(self) -> dict[str, Dist]:
        """{"x", "slope", "intercept"} -> Dist."""
        return {k: getattr(self.prompts_, k).to_dist() for k in ("x", "slope", "intercept")}


def without_generator_fields(doc: dict) -> dict:
    """`doc` (a config dict) with, where it is a CSV config ([data]), what the file replaces left
    out: [prompts] and grid.noise, whose defaults described prompts that were never drawn. Used
    for what a run records (MatrixConfig.to_dict), for reading an older record back
    (parse_recorded) and for comparing the two (cells.same_matrix). Changes `doc` in place."""
    if doc.get("data") is not None:
        doc.pop("prompts", None)
        if isinstance(doc.get("grid"), dict):
            doc["grid"].pop("noise", None)
    return doc


def _check_size(cfg: MatrixConfig, tables: dict) -> None:
    """ConfigError when the matrix has more than MAX_CELLS cells: grid points x parameter sets (each
    named solver's lists multiplied out; with all_solvers, one more per other registered solver),
    counted before the cells, or the parameter lists' repeats, are built."""
    from icl_bench.solvers.registry import known_names

    points = math.prod(len(cfg.grid[a.name]) for a in AXES)
    sets = sum(math.prod(len(v) if isinstance(v, list) else 1 for v in t.values()) if isinstance(t, dict) else 1
               for t in tables.values())
    if cfg.all_solvers:
        sets += len(set(known_names()) - set(tables))
    if points * sets > MAX_CELLS:  # 10^8 cells were a MemoryError in expand_cells
        raise ConfigError(f"grid: {points} grid points x {sets} solver settings = {points * sets} cells, more than "
                          f"{MAX_CELLS}; split the matrix into several configs")


def parse_config(raw: dict, *, base_dir: Path | None = None) -> MatrixConfig:
    """Validate a config dict (as loaded from TOML) into a MatrixConfig.

    Raises:
        ConfigError: any unknown key, wrong type, out-of-range value, unknown solver or solver
            parameter, empty grid, or a missing CSV file / column.
    """
    cfg = validate(MatrixConfig, raw, context={"given": tuple(raw) if isinstance(raw, dict) else ()})
    _check_size(cfg, raw.get("solvers", {}) if cfg.solvers else {})  # before the parameter lists are checked
    updates = {}
    if cfg.solvers:
        updates["solvers"] = {name: _solver_grid(name, params) for name, params in raw["solvers"].items()}
    if cfg.data is not None:
        updates["data"] = check_source(cfg.data, cfg.grid.N, base_dir)
    return cfg.model_copy(update=updates) if updates else cfg


def load_config(path: str | Path, key: str = "config") -> MatrixConfig:
    """Read and validate a TOML matrix config: a path, or a packaged config's name ("default",
    "ood"; icl_bench/configs). `key` names the argument in errors (the CLI passes "--config").

    Raises:
        ConfigError: neither a file nor a packaged name, an unreadable / non-UTF-8 / invalid TOML
            file, or any parse_config error.
    """
    from icl_bench.resources import check_kind, config_path

    given, path = path, config_path(path, key)
    raw = read_toml(path, key)
    check_kind(raw, given, "run", key)  # a training or sweep config: named as such, not as unknown keys
    return parse_config(raw, base_dir=Path(path).parent)


def parse_recorded(doc: dict) -> MatrixConfig:
    """The MatrixConfig a run recorded in its folder's config.json (bench/runner.py, run_matrix:
    MatrixConfig.to_dict() without the executor), so that `icl-bench run --resume --out DIR`
    continues a run without the TOML it was started from.

    The recorded [solvers] are already expanded (NAME -> a list of parameter sets); each set is
    checked again as a one-value grid, and the sets keep their order. A CSV run's record also
    holds the generator's defaults ([prompts], grid.noise), which a [data] config may not give:
    they are dropped. The CSV bytes' digest beside the config is checked by the store, not here.
    Raises:
        ConfigError: as parse_config, or a [solvers] entry that is not a list of tables.
    """
    from icl_bench.bench.store import DATA_KEY

    raw = {k: v for k, v in doc.items() if k not in ("solvers", DATA_KEY)}
    if isinstance(raw.get("grid"), dict):
        raw["grid"] = dict(raw["grid"])  # (a copy: the caller's record stays as read)
    without_generator_fields(raw)
    solvers = {} if doc.get("solvers") is None else doc["solvers"]
    if not isinstance(solvers, dict) or not all(isinstance(sets, list) and sets and all(isinstance(p, dict) for p in sets)
                                                for sets in solvers.values()):
        raise ConfigError("solvers: must map each solver's name to a non-empty list of parameter tables")
    first = {name: {k: [v] for k, v in sets[0].items()} for name, sets in solvers.items()}
    cfg = parse_config({**raw, "solvers": first} if solvers else raw)  # the rest of the config, checked as a TOML's
    if not solvers:
        return cfg
    expanded = {name: [combo for p in sets for combo in _solver_grid(name, {k: [v] for k, v in p.items()})]
                for name, sets in solvers.items()}
    for name, sets in expanded.items():  # a TOML refuses repeated values; a hand-edited record, repeated sets
        counts = Counter(json.dumps(p, sort_keys=True) for p in sets)  # (run twice under one key: a review)
        repeated = next((s for s, n in counts.items() if n > 1), None)
        if repeated is not None:
            raise ConfigError(f"solvers.{name}: the parameter set {repeated} is repeated; accepted: each set once")
    return cfg.model_copy(update={"solvers": expanded})
