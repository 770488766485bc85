"""Cells of the benchmark matrix: what one result row depends on, its key, and its prompts.

A *cell* is one (solver, solver parameters, grid point) of the matrix, the grid point holding one
value per axis of bench/axes.py. A cell is a pure function of its `Cell` (docs/design.md,
"Execution"): the prompts are drawn from a seed derived from the run's seed and the grid point's
N, noise and d (not R: prompt_seed), wherever the cell runs, and every input it reads (a CSV file)
is part of its key by content hash.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
from dataclasses import asdict, dataclass, fields as dataclass_fields
from functools import lru_cache

from icl_bench.bench.axes import AXES
from icl_bench.bench.contract import files_digest, input_files, torch_defaults_kept
from icl_bench.bench.config import MatrixConfig, without_generator_fields
from icl_bench.provenance import NO_SOURCE, code_digest, module_digest
from icl_bench.prompts.data import DataSource, sample_data_prompts, snapshot
from icl_bench.prompts.generator import Dist, PromptSpec, sample_prompts
from icl_bench.prompts.multivariate import sample_prompts_mv
from icl_bench.prompts.ood import apply_ood
from icl_bench.solvers.base import SkipCell
from icl_bench.solvers.registry import get_solver, get_solver_class, known_names


@dataclass(frozen=True)
class Cell:
    """One cell of the matrix: everything its result row depends on."""

    solver: str
    solver_params: str  # canonical JSON of the solver's parameters as given in the config
    N: int
    noise: float  # NaN for real data (the CSV source has no synthetic noise)
    R: float
    dtype: str
    device: str
    seed: int  # the run's base seed; the prompts' seed is derived from it and the grid point
    n_prompts: int
    batch_size: int
    prompts: str  # canonical JSON of the prompt source (distributions or CSV file)
    repeats: int = 3
    max_seconds: float = 1.0
    data_sha256: str = ""  # digest of the CSV file's bytes (CSV source only): edited data = new cells
    inputs_sha256: str = ""  # digest of the files the solver reads (Solver.input_files: checkpoints)
    code_sha256: str = ""  # digest of the code behind the numbers (provenance.code_digest): edited code = new cells
    optional: bool = False  # run only because all_solvers: a solver that fails to load is skipped (not in the key)
    d: int = 1  # regressors per example (the grid axis d)
    ood: str = "none"  # out-of-distribution map of the prompts (prompts/ood.py); "none" = in-distribution

    @property
    def key(self) -> str:
        """Stable file name of this cell's row (sha1 of its canonical JSON): every input the cell
        reads is in it (prompt source, CSV bytes, the solver's input files, the code that computes
        it), so an edited input or solver gives a new key and --resume or the cell cache never
        serve a stale row."""
        fields = {f.name: getattr(self, f.name) for f in dataclass_fields(self)}  # (asdict deep-copies: 5x slower)
        del fields["optional"]
        for name in ("data_sha256", "inputs_sha256", "code_sha256"):  # absent: the key stays what it always was
            if not fields[name]:
                del fields[name]
        if fields["d"] == 1:  # one regressor: the key of every 1-D cell stays what it always was
            del fields["d"]
        if fields["ood"] == "none":  # in-distribution cells keep the keys they had before the ood axis
            del fields["ood"]
        text = json.dumps(fields, sort_keys=True, allow_nan=True)
        return hashlib.sha1(text.encode()).hexdigest()[:20]

    def describe(self) -> str:
        dim = f" d={self.d}" if self.d != 1 else ""
        ood = "" if self.ood == "none" else f" ood={self.ood}"
        return f"{self.solver} {self.solver_params} N={self.N} noise={self.noise} R={self.R}{dim} {self.dtype} {self.device}{ood}"


def prompt_seed(seed: int, N: int, noise: float, d: int = 1) -> int:
    """Seed of one grid point's prompts: shared by every solver, dtype and device there, and by
    every R of the same (N, noise, d): R is the embedding constant, not part of the prompt, so the
    points of an error-vs-R curve are measured on the same prompts (paired), and a solver that
    does not read R (gd, gd-lsa) reads the same error at every R instead of the sampling noise
    between independent draws (docs/report.md, "Scaling laws")."""
    point = [seed, N, noise] if d == 1 else [seed, N, noise, d]
    digest = hashlib.sha256(json.dumps(point, allow_nan=True).encode()).digest()
    return int.from_bytes(digest[:7], "little")


def inputs_digest(name: str, params: dict) -> str:
    """files_digest of the files solver `name` with `params` reads (Solver.input_files, e.g.
    checkpoints); "" when it reads none, cannot be built or its input_files() fails (run_cell makes
    that the cell's error: bench/contract.py). torch's defaults are kept: a constructor that changed
    them here, before any cell, had changed every cell's (a review)."""
    try:
        with torch_defaults_kept([]):  # (the cell's own run of the constructor notes it in the row)
            files = input_files(get_solver(name, **params))
    except KeyboardInterrupt:
        raise
    except BaseException:  # a solver that does not load or build (GeneratorExit from a plugin too), or whose
        return ""  # input_files() fails: its cells are error / skipped rows
    return files_digest(files)


@lru_cache(maxsize=256)
def _codes_here(name: str) -> tuple[str, ...] | None:
    """Code digests of solver `name` that match in this process: that of the solver's module, and
    that of no module (icl_bench and the package versions alone), which a driver that could not
    load the solver keys its cells by (a solver registered on the workers only). None: nothing to
    compare, where the solver does not load, its module has no source file here, or it is a
    script's `__main__` (a class registered from a script, on the workers by a WorkerPlugin: a
    worker's own `__main__` is the dask command, another file; provenance.module_digest)."""
    module = _module(name)
    top = module.split(".")[0]
    if not module or top in ("__main__", "__mp_main__") or module_digest(module).startswith(NO_SOURCE):
        return None
    return code_digest(module), code_digest("")


def keys_its_files(cell: Cell) -> bool:
    """Whether `cell`'s key names the files its solver reads: not where the driver could not load
    the solver (one registered on the Dask workers only), whose key has the code digest of no
    module and no files (_codes_here)."""
    return cell.code_sha256 != _no_solver_digest()


@lru_cache(maxsize=1)
def _no_solver_digest() -> str:
    return code_digest("")


def digest_mismatch(cell: Cell) -> str:
    """"" when this process would compute `cell` with the code and input files its key names, else
    what differs. A Dask worker with another checkout, other package versions or other checkpoints
    under a relative models_dir would otherwise store its numbers under the driver's digests, and a
    cache would hand them to later runs (docs/scale-out.md, "Workers"). The code is hashed once per
    process per solver (the code a process runs is the code it imported); the input files are read again
    for every cell (a checkpoint retrained between two runs on a long-lived worker). Where the
    solver's code cannot be compared (`_codes_here` gives None) or the driver could not load the
    solver, its files are not compared either: the driver's key names none."""
    codes = _codes_here(cell.solver)
    if codes is None or cell.code_sha256 == codes[-1]:
        return ""
    inputs = inputs_digest(cell.solver, json.loads(cell.solver_params))
    differ = [f"{what} {theirs[:12] or '(none)'} on the driver, {mine[:12] or '(none)'} here"
              for what, mine, theirs in (("code_sha256", codes[0], cell.code_sha256),
                                         ("inputs_sha256", inputs, cell.inputs_sha256)) if mine != theirs]
    return "; ".join(differ)


def _module(name: str) -> str:
    """The module that defines solver `name` ("" when it does not load: its cells are error rows)."""
    try:
        return get_solver_class(name).__module__
    except KeyboardInterrupt:
        raise
    except BaseException:
        return ""


def same_matrix(a: dict, b: dict) -> bool:
    """Two configs (to_dict() form) that expand to the same cells: equal up to the order of the
    grid lists and of each solver's parameter combinations (cells are keyed by content, so
    --resume after reordering [grid] N = [1, 4] -> [4, 1] reuses every finished cell)."""
    def canon(d: dict) -> dict:
        d = without_generator_fields(json.loads(json.dumps(d, sort_keys=True, default=str)))  # (older CSV records)
        for k, v in (d.get("grid") or {}).items():
            d["grid"][k] = sorted(v, key=lambda e: json.dumps(e, sort_keys=True))
        for k, v in (d.get("solvers") or {}).items():
            d["solvers"][k] = sorted(v, key=lambda e: json.dumps(e, sort_keys=True))
        return d

    return canon(a) == canon(b)


def expand_cells(cfg: MatrixConfig) -> list[Cell]:
    """Every cell of the matrix, in a fixed order: grid points (axes of bench/axes.py, first axis
    outermost), then solvers (by name), then their parameter sets (as listed). By name, not as the
    TOML lists them: a run resumed from its config.json (stored with sorted keys) gave its rows in
    another order than the run it continued (found by a review)."""
    solvers = {name: cfg.solvers[name] for name in sorted(cfg.solvers)}
    optional = set()
    if cfg.all_solvers:
        optional = set(known_names()) - set(solvers)  # not asked for by name
        solvers = {name: cfg.solvers.get(name, [{}]) for name in sorted(set(known_names()) | set(solvers))}
    inputs = {(n, json.dumps(p, sort_keys=True)): inputs_digest(n, p) for n, combos in solvers.items() for p in combos}
    code = {n: code_digest(_module(n)) for n in solvers}
    digest = ""
    values = {a.name: list(cfg.grid[a.name]) for a in AXES}
    if cfg.data is not None:
        source = json.dumps({"csv": cfg.data.model_dump()}, sort_keys=True)
        values["noise"] = [math.nan]  # real data has no synthetic noise
        digest = snapshot(cfg.data)  # the file read once: every cell of this process draws from these bytes
    else:
        source = json.dumps({k: asdict(v) for k, v in cfg.prompts.items()}, sort_keys=True)
    cells = []
    for point in itertools.product(*values.values()):
        at = dict(zip(values, point))
        for name, combos in solvers.items():
            for params in combos:
                text = json.dumps(params, sort_keys=True)
                cells.append(Cell(
                    solver=name, solver_params=text, **at, seed=cfg.seed,
                    n_prompts=cfg.n_prompts, batch_size=min(cfg.batch_size, cfg.n_prompts), prompts=source,
                    repeats=cfg.timing.repeats, max_seconds=cfg.timing.max_seconds, data_sha256=digest,
                    inputs_sha256=inputs[(name, text)], code_sha256=code[name], optional=name in optional))
    return cells


@lru_cache(maxsize=2)
def cell_prompts(source: str, N: int, noise: float, R: float, n_prompts: int, seed: int, dtype: str, device: str,
                 d: int = 1, ood: str = "none", data_sha256: str = ""):
    """The prompt batch of one grid point (cached: all its solvers share it); d > 1 regressors:
    x (B, N, d) from icl_bench.prompts.multivariate (the distributions apply per coordinate). An
    `ood` map is applied to the in-distribution prompts of the same point (prompts/ood.py), so its
    rows pair with theirs; the maps are defined for one regressor (d > 1 with a map: SkipCell).
    data_sha256: the cell's digest of the CSV file (Cell.data_sha256): its prompts are drawn from
    the bytes with that digest (prompts.data._read: those expand_cells read, or in another process
    the file if it still hashes so, else RuntimeError, an error row), never from a file edited since."""
    spec = json.loads(source)
    pseed = prompt_seed(seed, N, noise, d)
    if "csv" in spec:
        batch = sample_data_prompts(DataSource(**spec["csv"]), N, R, n_prompts, seed=pseed, dtype=dtype, device=device,
                                    data_sha256=data_sha256)
    elif d > 1:
        if ood != "none":
            raise SkipCell(f"ood map {ood!r} is defined for one regressor (d = 1); this cell has d = {d}")
        dists = {k: Dist(**v) for k, v in spec.items()}
        return sample_prompts_mv(PromptSpec(N=N, noise=noise, R=R, **dists), n_prompts, d=d, seed=pseed,
                                 dtype=dtype, device=device)
    else:
        dists = {k: Dist(**v) for k, v in spec.items()}
        batch = sample_prompts(PromptSpec(N=N, noise=noise, R=R, **dists), n_prompts, seed=pseed, dtype=dtype, device=device)
    return apply_ood(batch, ood, seed=pseed + 1)
