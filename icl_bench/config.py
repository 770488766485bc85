"""Matrix config: a TOML file -> a validated `MatrixConfig` (shared DESIGN.md section 3).

A list is a grid axis, a scalar a fixed value. Every problem raises `ConfigError` with one line
that names the key and the accepted values, before anything is written to disk.

    seed = 0                 # base seed; each (N, noise, R) grid point derives its own
    n_prompts = 2048         # prompts per cell
    batch_size = 2048        # prompts per predict() call
    [grid]                   # N, noise, R, dtype, device: lists or scalars
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
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

from icl_bench.errors import ConfigError
from icl_bench.prompts import DISTRIBUTIONS, DTYPES, Dist

TOP_KEYS = ("seed", "n_prompts", "batch_size", "all_solvers", "grid", "prompts", "solvers", "data", "timing",
            "executor")
EXECUTORS = ("local", "dask")
GRID_DEFAULTS = {"N": [20], "noise": [0.1], "R": [100.0], "dtype": ["float32"], "device": ["cpu"]}
DEVICES = ("cpu", "cuda")
PROMPT_KEYS = ("x", "slope", "intercept")
DIST_KEYS = ("dist", "loc", "scale")
MAX_THREADS = 1024  # torch.set_num_threads beyond this crashes the process (seen at 100000)
MAX_SEED = 2**63 - 1  # seeds are stored as 64-bit integers (parquet)
MAX_PROMPTS = 2**24  # n_prompts and batch_size: torch.quantile (abs_err_* metrics) takes <= 2**24 values
MAX_VALUES = 2**27  # n_prompts * (N + 1): prompt values one grid point holds in memory (~ 5 GiB in float64)
FLOAT_MAX = {"float32": 3.4028234663852886e38, "float64": 1.7976931348623157e308}


@dataclass(frozen=True)
class DataSource:
    """CSV prompt source: each prompt samples N rows as context and one other row as query."""

    path: str  # file path, or "matplotlib:NAME" for a sample file bundled with matplotlib
    x: str  # column of inputs
    y: str  # column of targets

    def resolve(self) -> Path:
        if self.path.startswith("matplotlib:"):
            import matplotlib

            return Path(matplotlib.get_data_path()) / "sample_data" / self.path.split(":", 1)[1]
        return Path(self.path)


@dataclass(frozen=True)
class Timing:
    repeats: int = 3  # timed passes over the cell's prompts; the median is reported
    max_seconds: float = 1.0  # stop repeating once this much time was spent timing (>= 1 pass)
    threads: int = 0  # torch.set_num_threads for the run (0: leave torch's default); docs/throughput.md


@dataclass(frozen=True)
class Executor:
    """Where the cells run (docs/scale-out.md). Not part of the run's identity: --resume may
    continue a run on another executor, and both give the same table (timing columns aside)."""

    kind: str = "local"  # "local": in this process; "dask": tasks on a Dask cluster
    scheduler: str = ""  # dask: address of a running scheduler (tcp://host:8786); "" = start a LocalCluster
    n_workers: int = 2  # dask LocalCluster: worker processes (one thread each)
    exclusive_timing: bool = False  # at most one cell per machine inside its timed section at a time
    retries: int = 2  # dask: times a cell is re-run after its worker died, before it becomes an error row


@dataclass
class MatrixConfig:
    """A validated benchmark matrix (see the module docstring for the TOML form)."""

    seed: int = 0
    n_prompts: int = 2048
    batch_size: int = 2048
    grid: dict[str, list] = field(default_factory=lambda: {k: list(v) for k, v in GRID_DEFAULTS.items()})
    prompts: dict[str, Dist] = field(default_factory=lambda: {k: Dist() for k in PROMPT_KEYS})
    solvers: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # name -> expanded parameter sets
    all_solvers: bool = True  # also run every other registered solver with its default parameters
    data: DataSource | None = None
    timing: Timing = field(default_factory=Timing)
    executor: Executor = field(default_factory=Executor)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["prompts"] = {k: asdict(v) for k, v in self.prompts.items()}
        return d


def _fail(key: str, msg: str):
    raise ConfigError(f"{key}: {msg}")


def _check_keys(table: dict, allowed, where: str) -> None:
    if not isinstance(table, dict):
        _fail(where, f"must be a table (got {type(table).__name__})")
    for k in table:
        if k not in allowed:
            _fail(f"{where}.{k}" if where else k, f"unknown key; accepted: {', '.join(allowed)}")


def _int(value, key: str, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(key, f"expected an integer >= {lo}, got {value!r}")
    if value < lo:
        _fail(key, f"must be >= {lo} (got {value})")
    if hi is not None and value > hi:
        _fail(key, f"must be <= {hi} (got {value})")
    return value


def _float(value, key: str, *, positive: bool | None) -> float:
    """A finite number; positive=True: > 0, False: >= 0, None: any sign."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(key, f"expected a number, got {value!r}")
    value = float(value)
    ok = math.isfinite(value) and (positive is None or (value > 0 if positive else value >= 0))
    if not ok:
        bound = {None: "", True: " and > 0", False: " and >= 0"}[positive]
        _fail(key, f"must be finite{bound} (got {value})")
    return value


def _axis(grid: dict, name: str) -> list:
    raw = grid.get(name, GRID_DEFAULTS[name])
    values = raw if isinstance(raw, list) else [raw]
    key = f"grid.{name}"
    if not values:
        _fail(key, "empty list; give at least one value")
    out = []
    for v in values:
        if name == "N":
            out.append(_int(v, key, 2))
        elif name == "noise":
            out.append(_float(v, key, positive=False))
        elif name == "R":
            out.append(_float(v, key, positive=True))
        else:
            accepted = tuple(DTYPES) if name == "dtype" else DEVICES
            if v not in accepted:
                _fail(key, f"unknown value {v!r}; accepted: {', '.join(accepted)}")
            out.append(v)
    if len(set(out)) != len(out):
        _fail(key, f"repeated values in {values!r}")
    return out


def _dist(raw, key: str) -> Dist:
    _check_keys(raw, DIST_KEYS, key)
    dist = raw.get("dist", "normal")
    if dist not in DISTRIBUTIONS:
        _fail(f"{key}.dist", f"unknown distribution {dist!r}; accepted: {', '.join(DISTRIBUTIONS)}")
    loc = _float(raw.get("loc", 0.0), f"{key}.loc", positive=None)
    return Dist(dist, loc, _float(raw.get("scale", 1.0), f"{key}.scale", positive=False))


def _solvers(raw, all_solvers: bool) -> dict[str, list[dict]]:
    from icl_bench.registry import SolverLoadError, UnknownSolverError, get_solver_class

    _check_keys(raw, list(raw) if isinstance(raw, dict) else (), "solvers")
    if not raw and not all_solvers:
        _fail("solvers", "empty table; name at least one solver, remove [solvers] or set all_solvers = true")
    out = {}
    for name, params in raw.items():
        if not isinstance(params, dict):
            _fail(f"solvers.{name}", f"must be a table of parameters (got {params!r})")
        try:
            cls = get_solver_class(name)
        except UnknownSolverError as exc:
            raise ConfigError(f"solvers.{name}: {str(exc).split(': ', 1)[1]}") from None
        except SolverLoadError:  # recorded as error rows by the runner; the rest still runs
            out[name] = [{k: v for k, v in params.items()}]
            continue
        axes = {k: (v if isinstance(v, list) else [v]) for k, v in params.items()}
        for k, v in axes.items():
            if not v:
                _fail(f"solvers.{name}.{k}", "empty list; give at least one value")
        combos = [dict(zip(axes, vals)) for vals in itertools.product(*axes.values())]
        for combo in combos:
            try:
                cls(**combo)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            except Exception:  # a solver that cannot even be built: its cells become error rows
                pass
        out[name] = combos
    return out


def parse_config(raw: dict, *, base_dir: Path | None = None) -> MatrixConfig:
    """Validate a config dict (as loaded from TOML) into a MatrixConfig.

    Raises:
        ConfigError: any unknown key, wrong type, out-of-range value, unknown solver or solver
            parameter, empty grid, or a missing CSV file / column.
    """
    _check_keys(raw, TOP_KEYS, "")
    cfg = MatrixConfig(
        seed=_int(raw.get("seed", 0), "seed", 0, MAX_SEED),
        n_prompts=_int(raw.get("n_prompts", 2048), "n_prompts", 1, MAX_PROMPTS),
        batch_size=_int(raw.get("batch_size", 2048), "batch_size", 1, MAX_PROMPTS),
    )
    grid = raw.get("grid", {})
    _check_keys(grid, tuple(GRID_DEFAULTS), "grid")
    cfg.grid = {name: _axis(grid, name) for name in GRID_DEFAULTS}
    if cfg.n_prompts * (max(cfg.grid["N"]) + 1) > MAX_VALUES:
        _fail("n_prompts", f"n_prompts * (N + 1) = {cfg.n_prompts * (max(cfg.grid['N']) + 1)} prompt values "
                           f"exceed {MAX_VALUES} per grid point; lower n_prompts or N")
    for dtype in cfg.grid["dtype"]:
        for R in cfg.grid["R"]:
            if R > FLOAT_MAX[dtype]:
                _fail("grid.R", f"R={R:g} overflows {dtype} (max {FLOAT_MAX[dtype]:.3g}); lower R or drop {dtype}")
    prompts = raw.get("prompts", {})
    _check_keys(prompts, PROMPT_KEYS, "prompts")
    cfg.prompts = {k: _dist(prompts.get(k, {}), f"prompts.{k}") for k in PROMPT_KEYS}
    if "timing" in raw:
        t = raw["timing"]
        _check_keys(t, ("repeats", "max_seconds", "threads"), "timing")
        cfg.timing = Timing(_int(t.get("repeats", 3), "timing.repeats", 1),
                            _float(t.get("max_seconds", 1.0), "timing.max_seconds", positive=True),
                            _int(t.get("threads", 0), "timing.threads", 0, hi=MAX_THREADS))
    if "executor" in raw:
        cfg.executor = parse_executor(raw["executor"])
    cfg.all_solvers = raw.get("all_solvers", "solvers" not in raw)
    if not isinstance(cfg.all_solvers, bool):
        _fail("all_solvers", f"expected true or false, got {cfg.all_solvers!r}")
    if "solvers" in raw:
        cfg.solvers = _solvers(raw["solvers"], cfg.all_solvers)
    if "data" in raw:
        cfg.data = _data(raw["data"], cfg.grid["N"], base_dir)
    return cfg


def parse_executor(raw: dict, where: str = "executor") -> Executor:
    """Validate an [executor] table; ConfigError names the key and the accepted values."""
    _check_keys(raw, tuple(Executor.__dataclass_fields__), where)
    kind = raw.get("kind", "local")
    if kind not in EXECUTORS:
        _fail(f"{where}.kind", f"unknown value {kind!r}; accepted: {', '.join(EXECUTORS)}")
    scheduler = raw.get("scheduler", "")
    if not isinstance(scheduler, str):
        _fail(f"{where}.scheduler", f"expected an address like 'tcp://host:8786', got {scheduler!r}")
    if scheduler and kind != "dask":
        _fail(f"{where}.scheduler", 'only with kind = "dask"')
    exclusive = raw.get("exclusive_timing", False)
    if not isinstance(exclusive, bool):
        _fail(f"{where}.exclusive_timing", f"expected true or false, got {exclusive!r}")
    return Executor(kind, scheduler, _int(raw.get("n_workers", 2), f"{where}.n_workers", 1, MAX_THREADS),
                    exclusive, _int(raw.get("retries", 2), f"{where}.retries", 0, 100))


def _data(raw, Ns: list[int], base_dir: Path | None) -> DataSource:
    import numpy as np
    import pandas as pd

    _check_keys(raw, ("path", "x", "y"), "data")
    for k in ("path", "x", "y"):
        if not isinstance(raw.get(k), str) or not raw.get(k):
            _fail(f"data.{k}", f"required text value (got {raw.get(k)!r})")
    src = DataSource(raw["path"], raw["x"], raw["y"])
    path = src.resolve()
    if not path.is_file() and base_dir is not None and (base_dir / path).is_file():
        src = DataSource(str(base_dir / path), src.x, src.y)
        path = src.resolve()
    if not path.is_file():
        _fail("data.path", f"no such file {str(path)!r}")
    try:
        frame = pd.read_csv(path)
    except (UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError, OSError) as exc:
        _fail("data.path", f"cannot read {str(path)!r} as CSV ({type(exc).__name__})")
    for k in ("x", "y"):
        col = getattr(src, k)
        if col not in frame.columns:
            _fail(f"data.{k}", f"no column {col!r} in {path.name}; columns: {', '.join(map(str, frame.columns))}")
        if len(frame) and not pd.api.types.is_numeric_dtype(frame[col]):
            _fail(f"data.{k}", f"column {col!r} is not numeric")
    if max(Ns) + 1 > len(frame):
        _fail("grid.N", f"N={max(Ns)} needs at least {max(Ns) + 1} rows of data; {path.name} has {len(frame)}")
    finite = int((np.isfinite(frame[src.x].to_numpy(float)) & np.isfinite(frame[src.y].to_numpy(float))).sum())
    if max(Ns) + 1 > finite:  # NaN / inf rows are kept (degenerate prompts), but some must be usable
        _fail("data.path", f"N={max(Ns)} needs at least {max(Ns) + 1} rows with finite x and y; {path.name} has {finite}")
    return src


def load_config(path: str | Path) -> MatrixConfig:
    """Read and validate a TOML matrix config.

    Raises:
        ConfigError: a missing / unreadable / non-UTF-8 / invalid TOML file, or any parse_config error.
    """
    return parse_config(read_toml(path), base_dir=Path(path).parent)


def read_toml(path: str | Path, key: str = "--config") -> dict:
    """The raw dict of a TOML file; ConfigError (naming `key`) if missing, not UTF-8 or invalid."""
    path = Path(path)
    if path.is_dir():
        _fail(key, f"{str(path)!r} is a folder; give a .toml file")
    if not path.is_file():
        _fail(key, f"no such file {str(path)!r}")
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8"))
    except OSError as exc:
        _fail(key, f"cannot read {path.name} ({exc.strerror or type(exc).__name__})")
    except UnicodeDecodeError:
        _fail(key, f"{path.name} is not UTF-8 text")
    except tomllib.TOMLDecodeError as exc:
        _fail(key, f"{path.name} is not valid TOML ({exc})")
