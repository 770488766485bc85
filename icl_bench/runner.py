"""The matrix runner: expand a config into cells, run each, persist each row as it completes.

A *cell* is one (solver, solver params, N, noise, R, dtype, device, seed) point. `run_cell` is a
pure function of its `Cell` (prompt generation included; a small cache shares one prompt batch
between the solvers of a grid point), so cells can be farmed out to any executor later.

On disk, in the output folder:
    cells/<key>.json   one finished row per cell, written atomically (temp file + rename)
    results.parquet    the tidy table (one row per cell, DESIGN section 3 columns)
    results.csv        the same table as CSV
    metadata.json      config, seed, package versions, device, git commit, start / end time
`resume=True` reuses every valid cell file and recomputes the rest; a truncated or corrupt cell
file is recomputed, never merged.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from icl_bench import metadata
from icl_bench.config import DataSource, MatrixConfig
from icl_bench.errors import ConfigError
from icl_bench.metrics import prediction_metrics, weight_l1, weight_sparsity
from icl_bench.prompts import Dist, PromptSpec, sample_prompts
from icl_bench.registry import get_solver, known_names
from icl_bench.solver import SkipCell

COLUMNS = [
    "solver", "solver_params", "N", "noise", "R", "dtype", "device", "seed", "n_prompts",
    "mse_vs_ols", "mse_vs_truth", "mse_vs_target", "abs_err_median", "abs_err_p99", "n_nonfinite",
    "prompts_per_s", "batch_size", "weight_sparsity", "weight_l1", "status", "message",
    "prompts", "started_at", "elapsed_s",
    "mse_vs_ols_se", "mse_vs_truth_se",  # standard errors over the prompts (report: 95 % CIs)
]
TIMING_COLUMNS = ("prompts_per_s", "started_at", "elapsed_s")  # vary from run to run
METRIC_COLUMNS = ("mse_vs_ols", "mse_vs_truth", "mse_vs_target", "abs_err_median", "abs_err_p99",
                  "prompts_per_s", "weight_sparsity", "weight_l1", "mse_vs_ols_se", "mse_vs_truth_se")


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

    @property
    def key(self) -> str:
        """Stable file name of this cell's row (sha1 of its canonical JSON)."""
        text = json.dumps(asdict(self), sort_keys=True, allow_nan=True)
        return hashlib.sha1(text.encode()).hexdigest()[:20]

    def describe(self) -> str:
        return f"{self.solver} {self.solver_params} N={self.N} noise={self.noise} R={self.R} {self.dtype} {self.device}"


def prompt_seed(seed: int, N: int, noise: float, R: float) -> int:
    """Seed of one grid point's prompts: shared by every solver, dtype and device there."""
    digest = hashlib.sha256(json.dumps([seed, N, noise, R], allow_nan=True).encode()).digest()
    return int.from_bytes(digest[:7], "little")


def expand_cells(cfg: MatrixConfig) -> list[Cell]:
    """Every cell of the matrix, in a fixed order (grid point, then solver, then parameters)."""
    solvers = dict(cfg.solvers)
    if cfg.all_solvers:
        solvers = {name: cfg.solvers.get(name, [{}]) for name in sorted(set(known_names()) | set(solvers))}
    if cfg.data is not None:
        source = json.dumps({"csv": asdict(cfg.data)}, sort_keys=True)
        noises = [math.nan]
    else:
        source = json.dumps({k: asdict(v) for k, v in cfg.prompts.items()}, sort_keys=True)
        noises = cfg.grid["noise"]
    g = cfg.grid
    cells = []
    for N in g["N"]:
        for noise in noises:
            for R in g["R"]:
                for dtype in g["dtype"]:
                    for device in g["device"]:
                        for name, combos in solvers.items():
                            for params in combos:
                                cells.append(Cell(
                                    name, json.dumps(params, sort_keys=True), N, noise, R, dtype, device,
                                    cfg.seed, cfg.n_prompts, cfg.batch_size, source,
                                    cfg.timing.repeats, cfg.timing.max_seconds))
    return cells


@lru_cache(maxsize=2)
def _prompts(source: str, N: int, noise: float, R: float, n_prompts: int, seed: int, dtype: str, device: str):
    """The prompt batch of one grid point (cached: all its solvers share it)."""
    spec = json.loads(source)
    pseed = prompt_seed(seed, N, noise, R)
    if "csv" in spec:
        from icl_bench.data import sample_data_prompts

        return sample_data_prompts(DataSource(**spec["csv"]), N, R, n_prompts, seed=pseed, dtype=dtype, device=device)
    dists = {k: Dist(**v) for k, v in spec.items()}
    return sample_prompts(PromptSpec(N=N, noise=noise, R=R, **dists), n_prompts, seed=pseed, dtype=dtype, device=device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed_predictions(solver, batch, cell: Cell) -> tuple[torch.Tensor, float]:
    """Warm up, then time `repeats` full passes of predict over the batch in chunks.

    Returns (predictions of the last pass (B,), median seconds per pass). Only predict() is
    inside the timer; CUDA work is synchronised before each clock read.
    """
    chunks = [batch.slice(i, i + cell.batch_size) for i in range(0, batch.B, cell.batch_size)]
    with torch.no_grad():
        solver.predict(chunks[0])  # warm-up: lazy construction, caches, kernels
        _sync(cell.device)
        times, spent = [], 0.0
        for _ in range(cell.repeats):
            t0 = time.perf_counter()
            preds = [solver.predict(c) for c in chunks]
            _sync(cell.device)
            times.append(time.perf_counter() - t0)
            spent += times[-1]
            if spent >= cell.max_seconds:
                break
    for p, c in zip(preds, chunks):
        if not isinstance(p, torch.Tensor) or p.shape != (c.B,):
            shape = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
            raise TypeError(f"predict returned {shape}, expected a tensor of shape ({c.B},)")
        if p.dtype != c.dtype:
            raise TypeError(f"predict returned dtype {p.dtype}, expected {c.dtype}")
    return torch.cat(preds), sorted(times)[len(times) // 2]


def run_cell(cell: Cell) -> dict:
    """Run one cell and return its result row (never raises for a solver's failure)."""
    row = {c: math.nan for c in COLUMNS}
    row.update({k: getattr(cell, k) for k in ("solver", "solver_params", "N", "noise", "R", "dtype",
                                               "device", "seed", "n_prompts", "batch_size", "prompts")})
    row.update(status="ok", message="", n_nonfinite=-1, started_at=datetime.now(timezone.utc).isoformat())
    t0 = time.perf_counter()
    try:
        if cell.device.startswith("cuda") and not torch.cuda.is_available():
            raise SkipCell("CUDA is not available on this machine (torch.cuda.is_available() is False)")
        solver = get_solver(cell.solver, **json.loads(cell.solver_params))
        batch = _prompts(cell.prompts, cell.N, cell.noise, cell.R, cell.n_prompts, cell.seed, cell.dtype, cell.device)
        solver.check_batch(batch)
        pred, seconds = _timed_predictions(solver, batch, cell)
        row.update(prediction_metrics(pred, batch))
        row["prompts_per_s"] = batch.B / seconds if seconds > 0 else math.inf
        w = solver.weights()
        row["weight_sparsity"], row["weight_l1"] = weight_sparsity(w), weight_l1(w)
    except SkipCell as exc:
        row.update(status="skipped", message=str(exc))
    except Exception as exc:  # one failing cell is a row, never the end of the run
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        where = f" ({Path(frame.filename).name}:{frame.lineno})"
        row.update(status="error", message=f"{type(exc).__name__}: {exc}{where}")
    row["elapsed_s"] = time.perf_counter() - t0
    return row


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def _load_cell(path: Path, cell: Cell) -> dict | None:
    """A previously written row for `cell`, or None if absent, truncated, corrupt or foreign."""
    try:
        row = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(row, dict) or row.get("_key") != cell.key or set(COLUMNS) - set(row):
        return None
    return row


def run_matrix(config: MatrixConfig, out: str | Path | None = None, *, resume: bool = False,
               progress: bool = True) -> pd.DataFrame:
    """Run every cell of `config` and return the tidy result table (one row per cell).

    Args:
        config: a validated MatrixConfig (see config.load_config / parse_config).
        out: output folder; None keeps everything in memory (nothing written).
        resume: reuse the finished cells found in `out` (otherwise `out` must not hold a run).
        progress: show a progress bar (cells done / total and the current cell).
    Returns:
        pandas.DataFrame with COLUMNS; failing cells have status "error", impossible ones "skipped".
    Raises:
        ConfigError: `out` already holds a run and resume is False.
    """
    cells = expand_cells(config)
    cell_dir = None
    if out is not None:
        out = Path(out)
        if not resume and out.exists() and any(out.iterdir()):
            raise ConfigError(f"--out: {out} is not empty; pass --resume to continue that run or choose another folder")
        cell_dir = out / "cells"
        cell_dir.mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc).isoformat()
    rows = []
    bar = tqdm(cells, total=len(cells), unit="cell", disable=not progress, dynamic_ncols=True)
    for cell in bar:
        bar.set_postfix_str(cell.describe(), refresh=False)
        path = cell_dir / f"{cell.key}.json" if cell_dir else None
        row = _load_cell(path, cell) if (path and resume) else None
        if row is None:
            row = run_cell(cell)
            if path:
                _write_atomic(path, json.dumps({**row, "_key": cell.key}, allow_nan=True).encode())
        rows.append({c: row[c] for c in COLUMNS})
    table = pd.DataFrame(rows, columns=COLUMNS)
    if out is not None:
        meta = metadata.collect(config, started=started, table=table)
        buf = table.to_parquet(index=False)
        _write_atomic(out / "results.parquet", buf)
        _write_atomic(out / "results.csv", table.to_csv(index=False).encode())
        _write_atomic(out / "metadata.json", json.dumps(meta, indent=2, allow_nan=True).encode())
    return table

