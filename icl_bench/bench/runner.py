"""The matrix runner: expand a config into cells (bench/cells.py), run each, persist each row as
it completes.

`run_cell` is a pure function of its `Cell` (prompt generation included; a small cache shares one
prompt batch between the solvers of a grid point), so cells can be farmed out to any executor.

On disk, in the output folder:
    config.json        the run's config, written first (--resume refuses another config)
    cells/<key>.json   one finished row per cell, written atomically (temp file + rename)
    results.parquet    the tidy table (one row per cell, the columns of bench/schema.py)
    results.csv        the same table as CSV
    metadata.json      config, seed, package versions, device, git commit, start / end time
`resume=True` reuses every valid cell file and recomputes the rest; a truncated or corrupt cell
file, or one written for another config, is recomputed, never merged. How the folder survives a
crash (atomic writes, fsync, lock, metadata.json written last) is in icl_bench/store.py.
"""
from __future__ import annotations

import json
import math
import time
import traceback
from contextlib import contextmanager
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from icl_bench.solvers.sparsity import weight_l1, weight_sparsity
from icl_bench.bench import schema, store
from icl_bench.bench.axes import AXIS_NAMES
from icl_bench.bench.cells import Cell, cell_prompts, expand_cells, same_matrix
from icl_bench.bench.config import MatrixConfig
from icl_bench.bench.metrics import prediction_metrics
from icl_bench.bench.schema import COLUMNS, METRIC_COLUMNS
from icl_bench.bench.timing import sync, time_passes
from icl_bench.files import dumps
from icl_bench.errors import ConfigError
from icl_bench.solvers.base import SkipCell
from icl_bench.solvers.multivariate import check_regressors
from icl_bench.solvers.registry import SolverLoadError, get_solver

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


def _timed_predictions(solver, batch, cell: Cell) -> tuple[torch.Tensor, float]:
    """Warm up, then time full passes of predict over the batch in chunks (icl_bench.bench.timing).

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
    """Solvers must never modify their batch (docs/design.md, "Solver"): name the fields that changed."""
    changed = [k for k, v in batch.tensors().items() if not _same(v, getattr(pristine, k))]
    if changed:
        raise RuntimeError(f"predict modified the prompt batch in place ({', '.join(changed)})")


def run_cell(cell: Cell) -> dict:
    """Run one cell and return its result row (never raises for a solver's failure)."""
    row = {c: math.nan for c in COLUMNS}
    row.update({k: getattr(cell, k) for k in ("solver", "solver_params", *AXIS_NAMES, "seed", "n_prompts",
                                               "batch_size", "prompts")})
    row.update(status="ok", message="", n_nonfinite=-1, started_at=datetime.now(timezone.utc).isoformat())
    t0 = time.perf_counter()
    try:
        if cell.device.startswith("cuda") and not torch.cuda.is_available():
            raise SkipCell("CUDA is not available on this machine (torch.cuda.is_available() is False)")
        solver = get_solver(cell.solver, **json.loads(cell.solver_params))
        pristine = cell_prompts(cell.prompts, cell.N, cell.noise, cell.R, cell.n_prompts, cell.seed, cell.dtype,
                                cell.device, cell.d, cell.ood)
        batch = replace(pristine, **{k: v.clone() for k, v in pristine.tensors().items()})  # the cache stays intact
        check_regressors(solver, batch)  # d > 1 and no multivariate path: skipped, with the reason
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
        config_json = dumps(config.to_dict(), sort_keys=True)
        lock = store.prepare(out, resume=resume, config_json=config_json, same=same_matrix)
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
                row = store.load_cell(path, cell.key) if (path and resume) else None
                cached = cache / f"{cell.key}.json" if cache is not None else None
                if row is None and cached is not None:  # the shared cell cache (same key = same inputs)
                    row = store.load_cell(cached, cell.key)
                    if row is not None and path:
                        store.save_cell(path, cell.key, row)
                if row is None:
                    row = run_cell(cell)
                    if path:
                        store.save_cell(path, cell.key, row)
                    if cached is not None:
                        store.save_cell(cached, cell.key, row)
                else:
                    reused += 1
                rows.append({c: row[c] for c in COLUMNS})
            table = schema.table(rows)
            if out is not None:
                meta = store.run_metadata(config, started=started, table=table)
                meta["n_cells_reused"] = reused  # cells taken from an earlier run (--resume) or the cell cache
                if config.data is not None:
                    from icl_bench.prompts.data import data_summary

                    meta["data_rows_dropped"] = data_summary(config.data)[1]
                store.write_results(out, table, meta)
    finally:
        if lock is not None:
            lock.close()
    return table
