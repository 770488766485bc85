"""Scale-out benchmark (docs/scale-out.md): runner overhead and store size at 100 000 cells, and
the speed-up of a 2-worker Dask LocalCluster over the local executor, every ratio measured in one
run of this script, with the machine's load average recorded beside each number.

    python -m benchmarks.experiments.scale_out          # full: 100 000 cells; writes results/scale_out.{md,json}
    python -m benchmarks.experiments.scale_out --cells 2000 --out /tmp/so   # a quick look
    python -m benchmarks.experiments.scale_out --render   # rewrite results/scale_out.md from its JSON

Goals (docs/scale-out.md): <= 1 ms of runner overhead per cell with a trivial solver, local;
<= 1 KB of store per cell; >= 1.6x speed-up of 2 Dask workers over local on a CPU-bound matrix.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

import torch

from icl_bench import Param, Solver, register_solver
from icl_bench import files
from icl_bench.bench import store as cellstore
from icl_bench.bench.cells import expand_cells
from icl_bench.bench.config import Executor, parse_config
from icl_bench.bench import runner
from icl_bench.bench.runner import run_cell, run_matrix
from icl_bench.bench.schema import RESULT_COLUMNS


@register_solver("bench-trivial")
class Trivial(Solver):
    """Predicts the first context y: no work, so the runner's own cost is what is measured."""

    params = {"k": Param(0, "a grid axis that changes nothing")}

    def predict(self, batch):  # (B, N) -> (B,)
        return batch.y[:, 0].clone()


def trivial_config(n_cells: int):
    """n_cells cells: 10 N x 10 noise x 10 R grid points x (n_cells / 1000) solver settings."""
    per_point = max(1, n_cells // 1000)
    return parse_config({
        "n_prompts": 8, "batch_size": 8, "timing": {"repeats": 1, "max_seconds": 1e-9, "threads": 1},
        "grid": {"N": list(range(2, 12)), "noise": [0.01 * i for i in range(10)], "R": [10.0 * (i + 1) for i in range(10)],
                 "dtype": ["float64"]},
        "solvers": {"bench-trivial": {"k": list(range(per_point))}}})


CPU_BOUND = {"seed": 1, "n_prompts": 2000, "batch_size": 500, "timing": {"repeats": 1, "threads": 1},
             "grid": {"N": [4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26], "noise": [0.0, 0.1], "R": [100.0],
                      "dtype": ["float64"]},
             "solvers": {"scipy-lstsq": {}}}  # scipy-lstsq loops over the prompts in Python: CPU-bound


def load() -> float:
    return round(os.getloadavg()[0], 2)


def timed(fn):
    """(fn(), wall seconds, (load before, load after)); CPU seconds of this process in LAST_CPU[0]."""
    la0, c0, t0 = load(), time.process_time(), time.perf_counter()
    out = fn()
    wall = time.perf_counter() - t0
    LAST_CPU[0] = time.process_time() - c0
    return out, wall, (la0, load())


LAST_CPU = [0.0]


def bench_store_and_overhead(n_cells: int, tmp: Path) -> dict:
    cfg = trivial_config(n_cells)
    cells = expand_cells(cfg)
    n = len(cells)
    put_s, real_put = [0.0], cellstore.CellStore.put

    def counting_put(self, key, row):
        t0 = time.perf_counter()
        real_put(self, key, row)
        put_s[0] += time.perf_counter() - t0

    cell_s, real_run_cell = [0.0, 0.0], runner.run_cell

    def counting_run_cell(cell, timing_slot=None):  # what the runner calls for each cell
        t0, c0 = time.perf_counter(), time.process_time()
        row = real_run_cell(cell, timing_slot)
        cell_s[0] += time.perf_counter() - t0
        cell_s[1] += time.process_time() - c0
        return row

    cellstore.CellStore.put, runner.run_cell = counting_put, counting_run_cell
    try:
        _, wall, la = timed(lambda: run_matrix(cfg, tmp / "run", progress=False))
        cpu = LAST_CPU[0]
    finally:
        cellstore.CellStore.put, runner.run_cell = real_put, real_run_cell
    store_bytes = (tmp / "run" / cellstore.STORE_NAME).stat().st_size
    _, resume_wall, la_resume = timed(lambda: run_matrix(cfg, tmp / "run", resume=True, progress=False))
    # reference, same run: the one-JSON-file-per-cell store this replaces (write_atomic + fsync)
    ref_dir = tmp / "json_cells"
    ref_dir.mkdir()
    row = run_cell(cells[0])
    n_ref = min(n, 2000)
    t0 = time.perf_counter()
    for i in range(n_ref):
        files.write_atomic(ref_dir / f"{i:020x}.json", json.dumps({**row, "_key": f"{i:020x}"}, allow_nan=True).encode())
    ref_put = (time.perf_counter() - t0) / n_ref
    ref_bytes = sum(p.stat().st_blocks * 512 for p in ref_dir.iterdir()) / n_ref
    # the store as it is (synchronous = NORMAL) against an fsync at every commit (FULL), same rows
    sync_put = {}
    for mode in ("NORMAL", "FULL"):
        store = cellstore.CellStore(tmp / f"sync_{mode}", RESULT_COLUMNS, resume=False)
        store._db.execute(f"PRAGMA synchronous={mode}")
        t0 = time.perf_counter()
        for i in range(n_ref):
            store.put(f"{mode}-{i}", row)
        sync_put[mode] = (time.perf_counter() - t0) / n_ref
        store.close()
    return {
        "cells": n, "wall_s": wall, "load_avg": la,
        "per_cell_ms": 1e3 * wall / n, "cpu_per_cell_ms": 1e3 * cpu / n,
        "run_cell_cpu_per_cell_ms": 1e3 * cell_s[1] / n,
        "store_put_per_cell_ms": 1e3 * put_s[0] / n,
        "run_cell_per_cell_ms": 1e3 * cell_s[0] / n,
        "runner_rest_per_cell_ms": 1e3 * (wall - put_s[0] - cell_s[0]) / n,
        "store_bytes_per_cell": store_bytes / n,
        "resume_all_done_wall_s": resume_wall, "resume_per_cell_ms": 1e3 * resume_wall / n, "resume_load_avg": la_resume,
        "json_file_put_per_cell_ms": 1e3 * ref_put, "json_file_bytes_per_cell": ref_bytes, "json_reference_cells": n_ref,
        "store_vs_json_put_speedup": ref_put / (put_s[0] / n), "store_vs_json_bytes_ratio": ref_bytes / (store_bytes / n),
        "put_normal_ms": 1e3 * sync_put["NORMAL"], "put_full_ms": 1e3 * sync_put["FULL"], "sync_cells": n_ref,
    }


def bench_speedup(tmp: Path, repeats: int) -> dict:
    from distributed import Client, LocalCluster

    cfg = parse_config(CPU_BOUND)
    warm = parse_config({**CPU_BOUND, "n_prompts": 20, "grid": {**CPU_BOUND["grid"], "N": [4, 6, 8, 10]}})
    run_matrix(warm, progress=False)  # imports (scipy, plugins) and caches, as the workers get below
    local, dask_cold, dask_warm, loads = [], [], [], []
    in_flight = {"local": [], "dask running cluster": []}  # sum of the cells' elapsed_s / wall

    for r in range(repeats):
        table, t, la = timed(lambda: run_matrix(cfg, progress=False))
        local.append(t), loads.append(("local", la)), in_flight["local"].append(table.elapsed_s.sum() / t)
        _, t, la = timed(lambda: run_matrix(cfg, progress=False, executor=Executor(kind="dask", n_workers=2)))
        dask_cold.append(t), loads.append(("dask incl. cluster start", la))
    import dask

    with dask.config.set({"distributed.worker.profile.enabled": False}):  # as bench/executors.py starts one
        lc = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None)
    client = Client(lc)
    client.run(lambda: __import__("icl_bench.bench.runner"))
    run_matrix(warm, progress=False, executor=Executor(kind="dask", scheduler=lc.scheduler_address))  # both workers
    try:
        for r in range(repeats):
            table, t, la = timed(lambda: run_matrix(cfg, progress=False,
                                                    executor=Executor(kind="dask", scheduler=lc.scheduler_address)))
            dask_warm.append(t), loads.append(("dask running cluster", la))
            in_flight["dask running cluster"].append(table.elapsed_s.sum() / t)
    finally:
        client.close(), lc.close()
    med = statistics.median
    return {"cells": len(expand_cells(cfg)), "local_s": local, "dask_with_cluster_start_s": dask_cold,
            "dask_running_cluster_s": dask_warm, "load_avg": loads, "cells_in_flight": in_flight,
            "speedup_running_cluster": med(local) / med(dask_warm),
            "speedup_with_cluster_start": med(local) / med(dask_cold)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", type=int, default=100_000)
    p.add_argument("--repeats", type=int, default=3, help="repeats of the speed-up measurement (median)")
    p.add_argument("--out", default=str(ROOT / "results" / "scale_out"), help="writes OUT.md and OUT.json")
    p.add_argument("--only", choices=("overhead", "speedup"), help="re-measure one part; the other is kept from OUT.json")
    p.add_argument("--render", action="store_true", help="measure nothing: rewrite OUT.md from OUT.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    result = json.loads(out.with_suffix(".json").read_text()) if args.only or args.render else {}
    tmp = Path(tempfile.mkdtemp(prefix="icl-scale-"))
    try:
        info = {"machine": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                "torch": torch.__version__}
        now = lambda: time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())  # noqa: E731
        if args.only in (None, "overhead") and not args.render:  # each part records its machine: --only keeps
            result["store_and_overhead"] = {"started": now(), "info": info, **bench_store_and_overhead(args.cells, tmp)}
        if args.only in (None, "speedup") and not args.render:  # the other part's, measured elsewhere maybe
            result["speedup"] = {"started": now(), "info": info, **bench_speedup(tmp, args.repeats)}
        result.pop("info", None)  # (an older file's one machine line for both parts: each part has its own now)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(report(result))
    print(report(result))


def _sync_row(s: dict) -> str:
    """The table row of an fsync at every commit, for results measured since it was added."""
    if "put_full_ms" not in s:
        return ""
    return (f"| store put alone, {s['sync_cells']} rows: synchronous = NORMAL (the store) / FULL (an fsync per commit) | "
            f"{s['put_normal_ms']:.3f} ms / {s['put_full_ms']:.3f} ms | |\n")


def _on(part: dict) -> str:
    """" on MACHINE (N CPUs, Python V, torch V)" of a part that records where it was measured."""
    i = part.get("info")
    return f" on {i['machine']} ({i['cpus']} CPUs, Python {i['python']}, torch {i['torch']})" if i else ""


def report(r: dict) -> str:
    s, d = r["store_and_overhead"], r["speedup"]
    ok = lambda good: "meets the goal" if good else "MISSES the goal"  # noqa: E731
    return f"""# Scale-out benchmark

`python -m benchmarks.experiments.scale_out` (`--only overhead|speedup` re-measures one part and keeps
the other, so the two parts may come from different runs and machines: each names its own). The
1-minute load average before / after each measurement is given: these machines are shared, and a
load above the number of CPUs means other processes took CPU time from these numbers.

## Runner overhead and store, local executor, trivial solver ({s['cells']} cells, 8 prompts each)

Measured {s.get('started', '?')}{_on(s)}.

| what | per cell | goal |
|---|---|---|
| whole run (expand, run, store, tables), wall clock | {s['per_cell_ms']:.3f} ms | <= 1 ms: {ok(s['per_cell_ms'] <= 1)} |
| the same, CPU time of the process (less sensitive to load) | {s['cpu_per_cell_ms']:.3f} ms | <= 1 ms: {ok(s['cpu_per_cell_ms'] <= 1)} |
| of which run_cell (prompts, solver, timing, metrics, host load) | {s['run_cell_per_cell_ms']:.3f} ms ({s['run_cell_cpu_per_cell_ms']:.3f} ms CPU) | |
| of which store put (one SQLite transaction) | {s['store_put_per_cell_ms']:.3f} ms | |
| of which the rest (runner loop, table, parquet + csv) | {s['runner_rest_per_cell_ms']:.3f} ms | |
| store size (cells.sqlite) | {s['store_bytes_per_cell']:.0f} bytes | <= 1 KB: {ok(s['store_bytes_per_cell'] <= 1024)} |
| --resume of the finished run (load + tables) | {s['resume_per_cell_ms']:.3f} ms | |
| reference, same run: one JSON file per cell (fsync + rename) | {s['json_file_put_per_cell_ms']:.3f} ms, {s['json_file_bytes_per_cell']:.0f} bytes on disk | |
{_sync_row(s)}
Store vs one file per cell: {s['store_vs_json_put_speedup']:.1f}x faster per put, {s['store_vs_json_bytes_ratio']:.1f}x
smaller. Load average: run {tuple(s['load_avg'])}, resume {tuple(s['resume_load_avg'])}.

## Speed-up of a 2-worker Dask LocalCluster over local ({d['cells']} CPU-bound cells, scipy-lstsq, 1 thread)

Measured {d.get('started', '?')}{_on(d)}.

| executor | seconds (each repeat) |
|---|---|
| local | {', '.join(f'{t:.2f}' for t in d['local_s'])} |
| dask, LocalCluster started by the run | {', '.join(f'{t:.2f}' for t in d['dask_with_cluster_start_s'])} |
| dask, cluster already running | {', '.join(f'{t:.2f}' for t in d['dask_running_cluster_s'])} |

Speed-up (ratio of medians): {d['speedup_running_cluster']:.2f}x on a running cluster
(goal >= 1.6x: {ok(d['speedup_running_cluster'] >= 1.6)}), {d['speedup_with_cluster_start']:.2f}x including the
cluster's start. Cells in flight on average (sum of the cells' elapsed_s / wall; 2 = both workers
always busy): {'; '.join(f"{k} {', '.join(f'{v:.2f}' for v in vs)}" for k, vs in d['cells_in_flight'].items())}.
Load average (before, after): {'; '.join(f'{k} {v}' for k, v in d['load_avg'])}.
"""


if __name__ == "__main__":
    main()
