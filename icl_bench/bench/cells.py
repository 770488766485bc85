"""Cells of the benchmark matrix: what one result row depends on, its key, and its prompts.

A *cell* is one (solver, solver parameters, grid point) of the matrix, the grid point holding one
value per axis of bench/axes.py. A cell is a pure function of its `Cell` (docs/design.md,
"Execution"): the prompts are drawn from a seed derived from the run's seed and the grid point,
wherever the cell runs, and every input it reads (a CSV file) is part of its key by content hash.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
from dataclasses import asdict, dataclass
from functools import lru_cache

from icl_bench.bench.axes import AXES
from icl_bench.bench.config import MatrixConfig
from icl_bench.prompts.data import DataSource, sample_data_prompts
from icl_bench.prompts.generator import Dist, PromptSpec, sample_prompts
from icl_bench.solvers.registry import known_names


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

    @property
    def key(self) -> str:
        """Stable file name of this cell's row (sha1 of its canonical JSON)."""
        fields = asdict(self)
        if not fields["data_sha256"]:  # generator prompts: the key stays what it always was
            del fields["data_sha256"]
        text = json.dumps(fields, sort_keys=True, allow_nan=True)
        return hashlib.sha1(text.encode()).hexdigest()[:20]

    def describe(self) -> str:
        return f"{self.solver} {self.solver_params} N={self.N} noise={self.noise} R={self.R} {self.dtype} {self.device}"


def prompt_seed(seed: int, N: int, noise: float, R: float) -> int:
    """Seed of one grid point's prompts: shared by every solver, dtype and device there."""
    digest = hashlib.sha256(json.dumps([seed, N, noise, R], allow_nan=True).encode()).digest()
    return int.from_bytes(digest[:7], "little")


def expand_cells(cfg: MatrixConfig) -> list[Cell]:
    """Every cell of the matrix, in a fixed order: grid points (axes of bench/axes.py, first axis
    outermost), then solvers (by name), then their parameter sets (as listed)."""
    solvers = dict(cfg.solvers)
    if cfg.all_solvers:
        solvers = {name: cfg.solvers.get(name, [{}]) for name in sorted(set(known_names()) | set(solvers))}
    digest = ""
    values = {a.name: list(cfg.grid[a.name]) for a in AXES}
    if cfg.data is not None:
        source = json.dumps({"csv": cfg.data.model_dump()}, sort_keys=True)
        values["noise"] = [math.nan]  # real data has no synthetic noise
        digest = hashlib.sha256(cfg.data.resolve().read_bytes()).hexdigest()
    else:
        source = json.dumps({k: asdict(v) for k, v in cfg.prompts.items()}, sort_keys=True)
    cells = []
    for point in itertools.product(*values.values()):
        at = dict(zip(values, point))
        for name, combos in solvers.items():
            for params in combos:
                cells.append(Cell(
                    solver=name, solver_params=json.dumps(params, sort_keys=True), **at, seed=cfg.seed,
                    n_prompts=cfg.n_prompts, batch_size=cfg.batch_size, prompts=source,
                    repeats=cfg.timing.repeats, max_seconds=cfg.timing.max_seconds, data_sha256=digest))
    return cells


@lru_cache(maxsize=2)
def cell_prompts(source: str, N: int, noise: float, R: float, n_prompts: int, seed: int, dtype: str, device: str):
    """The prompt batch of one grid point (cached: all its solvers share it)."""
    spec = json.loads(source)
    pseed = prompt_seed(seed, N, noise, R)
    if "csv" in spec:
        return sample_data_prompts(DataSource(**spec["csv"]), N, R, n_prompts, seed=pseed, dtype=dtype, device=device)
    dists = {k: Dist(**v) for k, v in spec.items()}
    return sample_prompts(PromptSpec(N=N, noise=noise, R=R, **dists), n_prompts, seed=pseed, dtype=dtype, device=device)
