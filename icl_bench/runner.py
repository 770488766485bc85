"""The matrix runner: expand a config into cells, run each, persist each row as it completes.

A *cell* is one (solver, solver params, N, noise, R, dtype, device, seed) point. `run_cell` is a
pure function of its `Cell` (prompt generation included; a small cache shares one prompt batch
between the solvers of a grid point), so cells can be farmed out to any executor later.

On disk, in the output folder:
    config.json        the run's config, written first (--resume refuses another config)
    cells/<key>.json   one finished row per cell, written atomically (temp file + rename)
    results.parquet    the tidy table (one row per cell, DESIGN section 3 columns)
    results.csv        the same table as CSV
    metadata.json      config, seed, package versions, device, git commit, start / end time
`resume=True` reuses every valid cell file and recomputes the rest; a truncated or corrupt cell
file, or one written for another config, is recomputed, never merged. How the folder survives a
crash (atomic writes, fsync, lock, metadata.json written last) is in icl_bench/rundir.py.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from icl_bench import metadata, rundir
from icl_bench.config import DataSource, MatrixConfig
from icl_bench.errors import ConfigError
from icl_bench.metrics import prediction_metrics, weight_l1, weight_sparsity
from icl_bench.prompts import Dist, PromptSpec, sample_prompts
from icl_bench.registry import SolverLoadError, get_solver, known_names
from icl_bench.solver import SkipCell
from icl_bench.timing import sync, time_passes

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
    data_sha256: str = ""  # digest of the CSV file's bytes (CSV source only): edited data = new cells
    inputs_sha256: str = ""  # digest of the files the solver reads (Solver.input_files: checkpoints)
    optional: bool = False  # run only because all_solvers: a solver that fails to load is skipped (not in the key)

    @property
    def key(self) -> str:
        """Stable file name of this cell's row (sha1 of its canonical JSON): every input the cell
        reads is in it (prompt source, CSV bytes, the solver's input files), so an edited input
        gives a new key and --resume or the cell cache never serve a stale row."""
        fields = asdict(self)
        del fields["optional"]
        for name in ("data_sha256", "inputs_sha256"):  # absent inputs: the key stays what it always was
            if not fields[name]:
                del fields[name]
        text = json.dumps(fields, sort_keys=True, allow_nan=True)
        return hashlib.sha1(text.encode()).hexdigest()[:20]

    def describe(self) -> str:
        return f"{self.solver} {self.solver_params} N={self.N} noise={self.noise} R={self.R} {self.dtype} {self.device}"


def prompt_seed(seed: int, N: int, noise: float, R: float) -> int:
    """Seed of one grid point's prompts: shared by every solver, dtype and device there."""
    digest = hashlib.sha256(json.dumps([seed, N, noise, R], allow_nan=True).encode()).digest()
    return int.from_bytes(digest[:7], "little")


def inputs_digest(name: str, params: dict) -> str:
    """sha256 over the names and bytes of the files solver `name` with `params` reads
    (Solver.input_files, e.g. checkpoints); "" when it reads none or cannot be built."""
    try:
        files = sorted(get_solver(name, **params).input_files())
    except Exception:  # a solver that does not load or build: its cells are error / skipped rows
        return ""
    if not files:
        return ""
    h = hashlib.sha256()
    for path in files:
        h.update(str(Path(path).name).encode() + b"\0")
        try:
            h.update(Path(path).read_bytes())
        except OSError as exc:
            h.update(f"unreadable: {exc}".encode())
    return h.hexdigest()


def expand_cells(cfg: MatrixConfig) -> list[Cell]:
    """Every cell of the matrix, in a fixed order (grid point, then solver, then parameters)."""
    solvers = dict(cfg.solvers)
    optional = set()
    if cfg.all_solvers:
        optional = set(known_names()) - set(solvers)  # not asked for by name
        solvers = {name: cfg.solvers.get(name, [{}]) for name in sorted(set(known_names()) | set(solvers))}
    inputs = {(n, json.dumps(p, sort_keys=True)): inputs_digest(n, p) for n, combos in solvers.items() for p in combos}
    digest = ""
    if cfg.data is not None:
        source = json.dumps({"csv": asdict(cfg.data)}, sort_keys=True)
        noises = [math.nan]
        digest = hashlib.sha256(cfg.data.resolve().read_bytes()).hexdigest()
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
                                text = json.dumps(params, sort_keys=True)
                                cells.append(Cell(
                                    name, text, N, noise, R, dtype, device,
                                    cfg.seed, cfg.n_prompts, cfg.batch_size, source,
                                    cfg.timing.repeats, cfg.timing.max_seconds, digest,
                                    inputs[(name, text)], name in optional))
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


def _timed_predictions(solver, batch, cell: Cell) -> tuple[torch.Tensor, float]:
    """Warm up, then time full passes of predict over the batch in chunks (icl_bench.timing).

    Returns (predictions of the last pass (B,), median seconds per pass). Only predict() is
    inside the timer (the chunks are views cut before it starts); CUDA work is synchronised
    before each clock read; passes shorter than timing.MIN_SAMPLE_S are grouped per sample.
    """
    chunks = [batch.slice(i, i + cell.batch_size) for i in range(0, batch.B, cell.batch_size)]
    with torch.no_grad():
        solver.predict(chunks[0])  # warm-up: lazy construction, caches, kernels
        if chunks[-1].B != chunks[0].B:
            solver.predict(chunks[-1])  # the odd-sized last chunk too
        sync(cell.device)
        preds, seconds, _, _ = time_passes(lambda: [solver.predict(c) for c in chunks], cell.device,
                                           repeats=cell.repeats, max_seconds=cell.max_seconds)
    for p, c in zip(preds, chunks):
        if not isinstance(p, torch.Tensor) or tuple(p.shape) != (c.B,):
            shape = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
            raise TypeError(f"predict returned {shape}, expected a tensor of shape ({c.B},)")
        if p.dtype != c.dtype:
            raise TypeError(f"predict returned dtype {p.dtype}, expected {c.dtype}")
        if p.device != c.device:
            raise TypeError(f"predict returned a tensor on {p.device}, expected {c.device}")
    return torch.cat(preds), seconds


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _check_untouched(batch, pristine) -> None:
    """Solvers must never modify their batch (DESIGN section 3): name the fields that changed."""
    changed = [k for k, v in batch.tensors().items() if not _same(v, getattr(pristine, k))]
    if changed:
        raise RuntimeError(f"predict modified the prompt batch in place ({', '.join(changed)})")


NO_ANSWER = "no finite prediction"  # the start of the message of a cell whose solver never answered


def no_answer_message(pred: torch.Tensor, batch) -> str:
    """"" or, when the solver answered NaN / inf on every well-posed prompt (there being at
    least one), a message saying so: such a cell's metrics are NaN and would otherwise read
    as "ok" with no explanation."""
    well_posed = torch.isfinite(batch.ols_prediction).cpu()  # (B,)
    answered = torch.isfinite(pred.detach()).cpu() & well_posed
    if not well_posed.any() or answered.any():
        return ""
    return f"{NO_ANSWER}: NaN/inf on all {int(well_posed.sum())} well-posed prompts"


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
        pristine = _prompts(cell.prompts, cell.N, cell.noise, cell.R, cell.n_prompts, cell.seed, cell.dtype, cell.device)
        batch = replace(pristine, **{k: v.clone() for k, v in pristine.tensors().items()})  # the cache stays intact
        solver.check_batch(batch)
        pred, seconds = _timed_predictions(solver, batch, cell)
        _check_untouched(batch, pristine)
        row.update(prediction_metrics(pred, batch))
        row["message"] = no_answer_message(pred, batch)
        row["prompts_per_s"] = batch.B / seconds if seconds > 0 else math.inf
        w = solver.weights()
        row["weight_sparsity"], row["weight_l1"] = weight_sparsity(w), weight_l1(w)
    except SkipCell as exc:
        row.update(status="skipped", message=str(exc))
    except SolverLoadError as exc:  # a plugin that does not import: skipped unless asked for by name
        row.update({c: math.nan for c in METRIC_COLUMNS}, n_nonfinite=-1)
        row.update(status="skipped" if cell.optional else "error", message=str(exc))
    except (Exception, SystemExit) as exc:  # one failing cell is a row, never the end of the run
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        where = f" ({Path(frame.filename).name}:{frame.lineno})"
        row.update({c: math.nan for c in METRIC_COLUMNS}, n_nonfinite=-1)  # no half-computed numbers
        row.update(status="error", message=" ".join(f"{type(exc).__name__}: {exc}{where}".splitlines()))
    row["elapsed_s"] = time.perf_counter() - t0
    return row


@contextmanager
def torch_threads(n: int):
    """torch.set_num_threads(n) inside the block (n = 0: unchanged); the old count is restored."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def same_matrix(a: dict, b: dict) -> bool:
    """Two configs (to_dict() form) that expand to the same cells: equal up to the order of the
    grid lists and of each solver's parameter combinations (cells are keyed by content, so
    --resume after reordering [grid] N = [1, 4] -> [4, 1] reuses every finished cell)."""
    def canon(d: dict) -> dict:
        d = json.loads(json.dumps(d, sort_keys=True, default=str))
        for k, v in (d.get("grid") or {}).items():
            d["grid"][k] = sorted(v, key=lambda e: json.dumps(e, sort_keys=True))
        for k, v in (d.get("solvers") or {}).items():
            d["solvers"][k] = sorted(v, key=lambda e: json.dumps(e, sort_keys=True))
        return d

    return canon(a) == canon(b)


def run_matrix(config: MatrixConfig, out: str | Path | None = None, *, resume: bool = False,
               progress: bool = True, cache: str | Path | None = None) -> pd.DataFrame:
    """Run every cell of `config` and return the tidy result table (one row per cell).

    Args:
        config: a validated MatrixConfig (see config.load_config / parse_config).
        out: output folder; None keeps everything in memory (nothing written).
        resume: reuse the finished cells found in `out` (otherwise `out` must not hold a run);
            `out` must hold a run of the same matrix (grid lists may be reordered).
        progress: show a progress bar (cells done / total and the current cell).
        cache: a folder of finished rows by cell key, shared across run folders: a cell found
            there is reused (timings included), every computed cell is added. None: no cache.
    Returns:
        pandas.DataFrame with COLUMNS; failing cells have status "error", impossible ones "skipped".
    Raises:
        ConfigError: `out` is a file or not writable, already holds a run and resume is False,
            or is being written by another icl-bench process.
    """
    cells = expand_cells(config)
    lock = cell_dir = None
    if out is not None:
        out = Path(out)
        config_json = json.dumps(config.to_dict(), sort_keys=True, default=str)
        lock = rundir.prepare(out, resume=resume, config_json=config_json, same=same_matrix)
        cell_dir = out / "cells"
    if cache is not None:
        cache = Path(cache)
        try:
            cache.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--cache: cannot create {cache} ({exc.strerror or type(exc).__name__})") from None
    try:
        with torch_threads(config.timing.threads):  # timing.threads = 0: torch's default
            started = datetime.now(timezone.utc).isoformat()
            rows, reused = [], 0
            bar = tqdm(cells, total=len(cells), unit="cell", disable=not progress, dynamic_ncols=True)
            for cell in bar:
                bar.set_postfix_str(cell.describe(), refresh=False)
                path = cell_dir / f"{cell.key}.json" if cell_dir else None
                row = rundir.load_cell(path, cell.key, COLUMNS) if (path and resume) else None
                cached = cache / f"{cell.key}.json" if cache is not None else None
                if row is None and cached is not None:
                    row = rundir.load_cell(cached, cell.key, COLUMNS)
                    if row is not None and path:
                        rundir.save_cell(path, cell.key, row)
                if row is None:
                    row = run_cell(cell)
                    if path:
                        rundir.save_cell(path, cell.key, row)
                    if cached is not None:
                        rundir.save_cell(cached, cell.key, row)
                else:
                    reused += 1
                rows.append({c: row[c] for c in COLUMNS})
            table = pd.DataFrame(rows, columns=COLUMNS)
            if out is not None:
                meta = metadata.collect(config, started=started, table=table)
                meta["n_cells_reused"] = reused  # cells taken from an earlier run (--resume) or the cell cache
                if config.data is not None:
                    from icl_bench.data import data_summary

                    meta["data_rows_dropped"] = data_summary(config.data)[1]
                rundir.write_results(out, table, meta)
    finally:
        if lock is not None:
            lock.close()
    return table
