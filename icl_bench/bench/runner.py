"""The matrix runner: expand a config into cells (bench/cells.py), run each, persist each row as
it completes.

`run_cell` is a pure function of its `Cell` (prompt generation included; a small cache shares one
prompt batch between the solvers of a grid point), so cells run on any executor
(bench/executors.py: in this process, or as tasks on a Dask cluster); the driver alone stores each
finished row as it arrives (docs/scale-out.md).

On disk, in the output folder (bench/store.py):
    config.json        the run's config, written first (--resume refuses another config)
    cells.sqlite       one finished row per cell (SQLite, WAL mode, one transaction per cell)
    results.parquet    the tidy table (one row per cell, the columns of bench/schema.py)
    results.csv        the same table as CSV
    metadata.json      config, seed, package versions, device, git commit, executor, start / end time
`resume=True` reuses every valid stored cell and recomputes the rest; a stored row that fails its
checksum is recomputed, never merged.
"""
from __future__ import annotations

import json
import math
import os
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from icl_bench.startup import Terminated, sigint_recorded, sigterm_seen, torch_threads
from icl_bench.bench import hostload, schema, store
from icl_bench.bench.contract import (InputFilesError, check_untouched, check_well_posed, files_digest, input_files,
                                      no_answer_message, torch_defaults_kept, weight_columns, where)
from icl_bench.bench.cache import CellCache, cache_key
from icl_bench.bench.cells import Cell, cell_prompts, digest_mismatch, expand_cells, keys_its_files, same_matrix
from icl_bench.bench.config import Executor, MatrixConfig
from icl_bench.bench.cluster import worker_name
from icl_bench.bench.executors import make_executor
from icl_bench.bench.metrics import prediction_metrics
from icl_bench.bench.schema import CELL_COLUMNS, COLUMNS, METRIC_COLUMNS, NO_COUNTS, RESULT_COLUMNS
from icl_bench.bench.timing import sync, time_passes
from icl_bench.files import dumps, refuse_link_loop
from icl_bench import provenance
from icl_bench.solvers import fused, fused_cpu
from icl_bench.solvers.base import SkipCell
from icl_bench.solvers.multivariate import check_regressors
from icl_bench.errors import cell_message
from icl_bench.solvers.registry import REGISTRY, SolverLoadError, get_solver, get_solver_class


def _timed_predictions(solver, batch, cell: Cell, started=None) -> tuple[torch.Tensor, float]:
    """Warm up, then time full passes of predict over the batch in chunks (icl_bench.bench.timing).

    Returns (predictions of the last pass (B,), median seconds per pass). Only predict() is
    inside the timer (the chunks are views cut before it starts); CUDA work is synchronised
    before each clock read; passes shorter than timing.MIN_SAMPLE_S are grouped per sample.
    `started`: called between the warm-up and the timed passes (hostload.timing_slot's START).
    """
    chunks = [batch.slice(i, i + cell.batch_size) for i in range(0, batch.B, cell.batch_size)]
    with torch.no_grad():
        solver.predict(chunks[0])  # warm-up: lazy construction, caches, kernels
        if chunks[-1].B != chunks[0].B:
            solver.predict(chunks[-1])  # the odd-sized last chunk too
        sync(cell.device)
        if started is not None:
            started()
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


def run_cell(cell: Cell, timing_slot=None) -> dict:
    """Run one cell and return its result row (never raises for a solver's failure).

    `timing_slot`: optional context-manager factory wrapped around the timed section; the dict it
    yields is merged into the row (bench/hostload.py: timing_slot gives `concurrency`).
    """
    row = {c: math.nan for c in COLUMNS}
    row.update({k: getattr(cell, k) for k in CELL_COLUMNS})
    row.update(status="ok", message="", **NO_COUNTS, started_at=datetime.now(timezone.utc).isoformat(),
               executor="local", worker="local")
    t0 = time.perf_counter()
    changed: list[str] = []  # one solver's set_default_dtype must reach neither the metrics nor the next cell
    _run_solver(cell, row, timing_slot, changed)
    if changed:
        row["message"] = "; ".join(m for m in (row["message"], *dict.fromkeys(changed)) if m)
    row["elapsed_s"] = time.perf_counter() - t0
    return row


def _run_solver(cell: Cell, row: dict, timing_slot, changed: list[str]) -> None:
    """run_cell's work: fill `row` with the solver's timing, metrics and message, or its status
    and message when it is skipped or fails (never raises for a solver's failure). The solver's
    own code runs in `torch_defaults_kept(changed)` blocks (bench/contract.py)."""
    try:
        if cell.device.startswith("cuda") and not torch.cuda.is_available():
            raise SkipCell("CUDA is not available on this machine (torch.cuda.is_available() is False)")
        with torch_defaults_kept(changed):
            solver = get_solver(cell.solver, **json.loads(cell.solver_params))
            files = input_files(solver)  # an input_files() that fails is this cell's error
        now = files_digest(files) if keys_its_files(cell) else cell.inputs_sha256
        if now != cell.inputs_sha256:  # the row is stored under a key that names what it read
            raise InputFilesError(f"input_files() named other files or bytes when the cell ran than when it was "
                                  f"keyed (sha256 {cell.inputs_sha256[:12] or '(none)'} then, "
                                  f"{now[:12] or '(none)'} now; files: "
                                  f"{', '.join(p.name for p in files) or 'none'}): one changed during the run. "
                                  "List only files the solver reads, never one it writes (a cache), and run again")
        pristine = cell_prompts(cell.prompts, cell.N, cell.noise, cell.R, cell.n_prompts, cell.seed, cell.dtype,
                                cell.device, cell.d, cell.ood, cell.data_sha256)
        batch = replace(pristine, **{k: v.clone() for k, v in pristine.tensors().items()})  # the cache stays intact
        check_well_posed(cell, batch)  # no prompt has an answer: skipped, with the reason
        check_regressors(solver, batch)  # d > 1 and no multivariate path: skipped, with the reason
        with torch_defaults_kept(changed):
            solver.check_batch(batch)
            with (timing_slot or (lambda: nullcontext({})))() as extra:
                pred, seconds = _timed_predictions(solver, batch, cell, extra.get(hostload.START))
        row.update(extra)
        check_untouched(batch, pristine)
        row.update(prediction_metrics(pred, batch))
        row["prompts_per_s"] = batch.B / seconds if seconds > 0 else math.inf
        # a weights() that breaks its contract costs the weight columns, not the answers' metrics
        with torch_defaults_kept(changed):
            row["weight_sparsity"], row["weight_l1"], note = weight_columns(solver)
        row["message"] = "; ".join(m for m in (no_answer_message(pred, batch), note) if m)
    except SkipCell as exc:
        row.update(status="skipped", message=cell_message(exc))
    except SolverLoadError as exc:  # a plugin that does not import: skipped unless asked for by name
        row.update({c: math.nan for c in METRIC_COLUMNS}, **NO_COUNTS)
        row.update(status="skipped" if cell.optional else "error", message=cell_message(exc))
    except KeyboardInterrupt:  # Ctrl-C (and SIGTERM, startup.Terminated) stops the run: the resume line
        raise
    except BaseException as exc:  # one failing cell is a row, never the end of the run (SystemExit and
        at = "" if isinstance(exc, InputFilesError) else where(exc)  # GeneratorExit from a plugin included)
        row.update({c: math.nan for c in METRIC_COLUMNS}, **NO_COUNTS)  # no half-computed numbers
        row.update(status="error", message=cell_message(exc, prefix=f"{type(exc).__name__}: ", where=at))


def failed_row(cell: Cell, status: str, message: str) -> dict:
    """The row of a cell the executor could not run (a worker died under it, no GPU worker...)."""
    row = {c: math.nan for c in COLUMNS}
    row.update({k: getattr(cell, k) for k in CELL_COLUMNS})
    row.update(status=status, message=cell_message(message), **NO_COUNTS, started_at=datetime.now(timezone.utc).isoformat(),
               executor="dask", worker="")
    return row


def run_cell_task(cell: Cell, *, threads: int = 0, exclusive: bool = False, executor: str = "local") -> dict:
    """run_cell as an executor task: marks this process busy on its machine, records the cells
    running there while it was timed (bench/hostload.py), and where it ran. In another process
    than the driver's (executor "dask") the cell is first checked against the code and input files
    its key names (cells.digest_mismatch): a worker that differs gives an error row, not numbers."""
    differ = digest_mismatch(cell) if executor != "local" else ""
    if differ:
        row = failed_row(cell, "error", f"this worker's solver code or input files differ from the driver's ({differ}): "
                                        "install the same icl-bench, solver and package versions on every worker, and "
                                        "let every worker read the driver's checkpoint files (absolute paths on a "
                                        "shared file system); an input file that changed during the run (one the "
                                        "solver writes itself?) reads the same")
        row.update(executor=executor, worker=worker_name())
        return row
    with torch_threads(threads), hostload.busy():
        row = run_cell(cell, timing_slot=lambda: hostload.timing_slot(exclusive))
    row.update(executor=executor, worker=worker_name())
    return row


def run_matrix(config: MatrixConfig, out: str | Path | None = None, *, resume: bool = False,
               progress: bool = True, executor: Executor | None = None,
               cache: str | Path | None = None) -> pd.DataFrame:
    """Run every cell of `config` and return the tidy result table (one row per cell).

    Args:
        config: a validated MatrixConfig (see bench/config.py: load_config / parse_config).
        out: output folder; None keeps everything in memory (nothing written).
        resume: reuse the finished cells found in `out` (otherwise `out` must not hold a run);
            `out` must hold a run of the same matrix (grid lists may be reordered).
        progress: show a progress bar (cells done / total and the last finished cell).
        executor: where the cells run; None: config.executor (default: in this process).
        cache: a folder holding a cell cache shared across run folders (bench/cache.py: CellCache):
            a cell found there with status "ok" is reused (timings included), every computed ok
            cell is added. With resume, only the "ok" cells in `out` are reused: an error or a
            skip (a plugin since fixed, a GPU now present) is tried again.
    Returns:
        pandas.DataFrame with COLUMNS, in the matrix order whatever the executor; failing cells
        have status "error", impossible ones "skipped".
    Raises:
        ConfigError: `out` is a file or not writable, already holds a run and resume is False,
            or is being written by another icl-bench process; the Dask scheduler cannot be
            reached or dask is not installed. Nothing is written to `out` then.
    """
    if not isinstance(config, MatrixConfig):  # a dict failed with "'dict' object has no attribute 'solvers'"
        raise TypeError(f"config: run_matrix takes a MatrixConfig (got {type(config).__name__}); build one with "
                        "icl_bench.bench.config.parse_config(dict) or load_config(path or packaged name)")
    for flag, path in (("--out", out), ("--cache", cache)):  # not "a link to ..., which does not exist"
        if path is not None and str(path).strip():
            refuse_link_loop(path, flag)
    cells = expand_cells(config)
    ex_cfg = executor or config.executor
    ex = make_executor(ex_cfg)  # before `out` is touched: an unreachable scheduler writes nothing
    cells_db = cache_db = None
    try:
        if cache is not None:  # first: a bad --cache must not leave a started run folder behind
            CellCache.check_path(cache, out)
            db = Path(cache) / store.STORE_NAME  # an existing cache is opened (and checked) now; a new one
            if db.exists() or db.is_symlink():  # is only made once --out is accepted
                cache_db = CellCache(cache, RESULT_COLUMNS, out=out)
        if out is not None:
            out = Path(out)
            if resume:
                config = _recorded_threads(config, out)
            identity = {k: v for k, v in config.to_dict().items() if k != "executor"}  # any executor resumes
            if config.data is not None and cells:  # --resume on edited CSV bytes is refused (store.prepare)
                identity[store.DATA_KEY] = cells[0].data_sha256
            config_json = dumps(identity, sort_keys=True)
            cells_db = store.CellStore(out, RESULT_COLUMNS, resume=resume, config_json=config_json, same=same_matrix)
        if cache is not None and cache_db is None:  # a new one is made only once --out is accepted
            cache_db = CellCache(cache, RESULT_COLUMNS, out=out)
        with torch_threads(config.timing.threads):  # timing.threads = 0: torch's default
            usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            on_this_machine = ex.kind == "local" or not ex_cfg.scheduler  # (a LocalCluster too; a cluster's workers: theirs)
            if on_this_machine and config.timing.threads > usable:
                warnings.warn(f"timing.threads = {config.timing.threads}, but this process may use {usable} CPUs: "
                              "the threads beyond them wait for a core, and the cells' times measure that wait "
                              "(docs/throughput.md)", stacklevel=2)
            started = datetime.now(timezone.utc).isoformat()
            stored = cells_db.load() if (cells_db is not None and resume) else {}
            keys = [cell.key for cell in cells]
            stale = len(set(stored) - set(keys))
            if stale:  # recomputed without a word, e.g. after a plugin's code was edited (a tryout)
                warnings.warn(f"--resume: {stale} of the {len(stored)} finished cells stored in {out} match no cell of "
                              "this run and are not reused: a cell's key covers the code of icl-bench and of its "
                              "solver's package, its inputs and the library versions, and one of them changed since "
                              "it ran (or its solver is no longer installed)", stacklevel=2)
            rows = {}
            timed_as = partial(cache_key, threads=config.timing.threads, exclusive=ex_cfg.exclusive_timing)
            wanted = {timed_as(k): k for k in keys if k not in stored}
            cached = {wanted[k]: row for k, row in cache_db.get(list(wanted)).items()} if cache_db is not None else {}
            for key, cell in zip(keys, cells):
                if key in stored or key in cached:
                    rows[key] = {**{k: getattr(cell, k) for k in CELL_COLUMNS}, **stored.get(key, cached.get(key, {}))}
                    if key in cached and cells_db is not None:
                        cells_db.put(key, rows[key])
            reused = len(rows)
            todo = list({k: c for k, c in zip(keys, cells) if k not in rows}.values())  # each key once
            key_of = {id(c): k for k, c in zip(keys, cells)}  # Cell.key hashes the cell: compute it once
            if ex.kind == "local":
                work = partial(run_cell_task, exclusive=ex_cfg.exclusive_timing)
            else:
                work = partial(run_cell_task, threads=config.timing.threads, exclusive=ex_cfg.exclusive_timing,
                               executor="dask")
            bar = tqdm(total=len(cells), initial=reused, unit="cell", disable=not progress, dynamic_ncols=True)
            session = {"command": provenance.command_line(), "started_at": started, "cells_reused": reused,
                       "cells_computed": 0}
            session_n = cells_db.open_session(session) if cells_db is not None else None
            logs = logging_redirect_tqdm() if progress else nullcontext()  # a log line (a kernel compiled) above the bar
            with (sigint_recorded(reraise=True) as seen, logs,
                  _recorded(session, session_n, cells_db, ex, len(set(keys)), rows)):
                for cell, row, failure in ex.results(todo, work):
                    if row is None:
                        row = failed_row(cell, *failure)
                    key = key_of[id(cell)]
                    if cells_db is not None:
                        cells_db.put(key, row)
                    session["cells_computed"] += 1  # (after the put: the interruption line counts stored cells)
                    if cache_db is not None:
                        cache_db.put(timed_as(key), row)
                    rows[key] = row
                    bar.set_postfix_str(cell.describe(), refresh=False)
                    bar.update()
                    if sigterm_seen():  # a SIGTERM or Ctrl-C that a C callback swallowed (startup.py)
                        raise Terminated
                    if seen:
                        raise KeyboardInterrupt
            bar.close()
            table = schema.table([rows[key] for key in keys])
            if cells_db is not None:
                meta = run_metadata(config, started=started, table=table, out=out)
                meta["n_cells_reused"] = reused  # cells taken from an earlier run (--resume) or the cell cache
                meta["executor"] = ex.describe(threads=config.timing.threads, table=table)
                meta["command"] = session["command"]  # of this session (a resumed run: the resume)
                meta["sessions"] = cells_db.close_session(session_n, {
                    **session, "finished_at": meta["finished_at"], "status": "finished", "executor": meta["executor"]})
                if config.data is not None:
                    from icl_bench.prompts.data import data_summary

                    meta["data_rows_dropped"] = data_summary(config.data, cells[0].data_sha256 if cells else "")[1]
                cells_db.write_results(table, meta)
    finally:
        try:
            ex.close()  # (a second Ctrl-C while a cluster closes raises here: the stores close all the same)
        finally:
            for db in (cells_db, cache_db):
                if db is not None:
                    db.close()
    return table


@contextmanager
def _recorded(session: dict, n, cells_db, ex, n_cells: int, rows: dict):
    """Record the end of `session` (number `n` in the run's store: CellStore.close_session) when the
    block is interrupted or fails: its command, executor kind and cells computed stay in
    metadata.json's `sessions` once the run is finished by a --resume. (A finished session is
    recorded by the caller, with its metadata; a killed one keeps its "running" record.) The
    exception leaves with `cells_done` = (cells stored, `n_cells` of the matrix, how many of the
    stored `rows` are skips or errors, which --resume runs again: CellStore.load), which the CLI's
    interruption line prints."""
    try:
        yield
    except BaseException as exc:
        try:
            again = sum(row.get("status", "ok") != "ok" for row in rows.values())
            exc.cells_done = (session["cells_reused"] + session["cells_computed"], n_cells, again)
        except AttributeError:  # (an exception type with __slots__)
            pass
        if cells_db is not None:
            try:
                cells_db.close_session(n, {**session, "finished_at": datetime.now(timezone.utc).isoformat(),
                                           "status": f"stopped ({type(exc).__name__})", "executor": {"kind": ex.kind}})
            except Exception:  # (a full disk, a damaged store: the cells are what matters, and they are stored)
                pass
        raise


def _recorded_threads(config: MatrixConfig, out: Path) -> MatrixConfig:
    """`config` with the run's recorded timing.threads when the config leaves threads unset: run
    folders made while the default was 0 (torch's own) resume under today's default of 1, with the
    threads their cells were timed with (they were refused as another config; found by a review)."""
    if "threads" in config.timing.model_fields_set:
        return config
    try:
        threads = json.loads((out / store.CONFIG_NAME).read_text())["timing"]["threads"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # no run there, not one of ours: prepare() says
        return config
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 0 or threads == config.timing.threads:
        return config
    return config.model_copy(update={"timing": config.timing.model_copy(update={"threads": threads})})


def _origin(name: str) -> str:
    """Where solver `name` comes from (Registry.origin), loading it here if only workers did."""
    try:
        get_solver_class(name)
    except Exception:  # unknown or broken here: its rows say what happened where it ran
        pass
    return REGISTRY.origin(name) or "not loadable in the driver"


def run_metadata(config, *, started: str, table, out=None) -> dict:
    """The metadata.json content of one run of `config` (a MatrixConfig) that produced `table`:
    config, seed, package versions, where each solver came from (`solvers`: "built-in (module)" or
    "plugin module:Class (distribution version)", so a plugin's version is on record), device, git
    commit ("-dirty" from changes outside the run folder `out`, whose files are the run's own),
    start / end time, status counts (the runner adds the executor, the command and `sessions`:
    every session that ran in the folder)."""
    return {
        "config": config.to_dict(),
        "seed": config.seed,
        "packages": provenance.package_versions(),
        "solvers": {s: _origin(s) for s in sorted(table["solver"].unique())},
        # numba's vector width (None: no fused path): ols's last bits follow it (docs/design.md §10-11)
        "device": {**provenance.device_info(), "numba_vectors": fused_cpu.describe() if fused.available() else None},
        "git_commit": provenance.git_commit(ignore=(out,) if out is not None else ()),
        "started_at": started,
        "finished_at": datetime.now(timezone.utc).isoformat(),
        "n_cells": int(len(table)),
        "status_counts": {str(k): int(v) for k, v in table["status"].value_counts().items()},
    }
