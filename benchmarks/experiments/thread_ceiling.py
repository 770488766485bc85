"""How much a second thread can give on this machine, next to what it gives the fused forward.

The throughput goal asks two threads for >= 1.8x one thread (docs/throughput.md). On a shared
virtual machine that depends on the machine as much as on the code, so this script measures the
machine's own ceiling with two controls before it measures the fused forward:

- compute: a numba loop of multiply-adds on a 16-value array (it stays in the first-level cache:
  no memory traffic), the same total work on one thread and split over two with `fused.split`;
- memory: a numba sum over a 64 MiB float32 array (out of cache), one thread vs two;
- split: the cost of `fused.split` itself with empty shares (waking the pool's worker);

then ln-closed-form (float32, B = 2^20 // N prompts, one torch thread) at N = 100 and 1000: its
fused kernel alone (`fused.fused_forward`) and the whole solver call (kernel + the ill-posed /
R-lost screens), one thread vs two; and its kernel on two threads with `fused.split` (the caller
takes the first share) against the split it replaced (every share handed to a pool of two while
the caller waits). Every pair is timed alternating call by call (ROUNDS rounds),
so both sides see the same load; medians and minima are reported, for each of --runs repeats of
the whole measurement and as the range over them.

    python -m benchmarks.experiments.thread_ceiling [--runs 5] [--rounds 60] [--out results/thread_ceiling.md]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from benchmarks.conftest import _cpu_arch
from icl_bench.provenance import cpu_model
from icl_bench import PromptSpec, get_solver, sample_prompts
from icl_bench.solvers import fused

ROOT = Path(__file__).resolve().parents[2]  # the repository root


def alternate(one, two, rounds: int) -> dict:
    """Time one() and two() alternately, `rounds` times each after a warm-up call of both:
    {"one": (median s, min s), "two": (...), "ratio": (median ratio, min ratio)} (ratio > 1: two is faster)."""
    one(), two()
    t = {"one": [], "two": []}
    for _ in range(rounds):
        for name, fn in (("one", one), ("two", two)):
            t0 = time.perf_counter()
            fn()
            t[name].append(time.perf_counter() - t0)
    out = {k: (statistics.median(v), min(v)) for k, v in t.items()}
    out["ratio"] = (out["one"][0] / out["two"][0], out["one"][1] / out["two"][1])
    return out


def controls(rounds: int) -> dict:
    """The machine's ceiling: compute-bound and memory-bound numba work on 1 vs 2 threads, and
    the cost of fused.split with empty shares (seconds)."""
    assert fused.available(), "numba is needed for the fused kernels and for these controls"
    nb = fused.numba

    @nb.njit(nogil=True)
    def compute(b0, b1):  # 16 independent chains of multiply-adds, 64 bytes: in L1
        acc = np.zeros(16, np.float32)
        for _ in range(b0, b1):
            for _ in range(2000):
                for j in range(16):
                    acc[j] = acc[j] * np.float32(0.999) + np.float32(0.001)
        return acc.sum()

    @nb.njit(nogil=True, fastmath={"reassoc"})
    def total(a, i0, i1):
        s = np.float32(0.0)
        for i in range(i0, i1):
            s += a[i]
        return s

    units = 512  # compute units of work per call (~5-10 ms on one core)
    a = np.ones(64 * 2**20 // 4, np.float32)  # 64 MiB: far beyond the caches
    out = {"compute": alternate(lambda: fused.split(compute, units, 1), lambda: fused.split(compute, units, 2), rounds),
           "memory": alternate(lambda: fused.split(lambda i0, i1: total(a, i0, i1), a.size, 1),
                               lambda: fused.split(lambda i0, i1: total(a, i0, i1), a.size, 2), rounds)}
    noop = lambda b0, b1: None  # noqa: E731
    costs = []
    for _ in range(1000):
        t0 = time.perf_counter()
        fused.split(noop, 2, 2)
        costs.append(time.perf_counter() - t0)
    out["split_cost"] = (statistics.median(costs), min(costs))
    return out


def ln_closed_form(N: int, rounds: int) -> dict:
    """ln-closed-form at N, float32, one torch thread: kernel alone and whole solver call, 1 vs 2 threads."""
    B = 2**20 // N
    solver = get_solver("ln-closed-form")
    batch = sample_prompts(PromptSpec(N=N, noise=0.1, R=100.0), B, seed=0, dtype="float32")
    model = solver.model(batch.R, batch.dtype, batch.device)
    tokens, _, _ = solver._inputs(batch)  # (B, N+1, 3): the tokens its predict feeds the kernel

    def with_threads(n, fn):
        return lambda: _threads(n, fn)

    kernel = lambda: fused.fused_forward(model, tokens)  # noqa: E731
    whole = lambda: solver.predict(batch.slice(0, B))  # noqa: E731 - as the throughput suite calls it
    pool = ThreadPoolExecutor(2)

    def all_pool_split(work, n, threads):  # the split before fused.split: the caller only waits
        edges = [t * n // threads for t in range(threads + 1)]
        list(pool.map(lambda t: work(edges[t], edges[t + 1]), range(threads)))

    def old_split():
        real, fused.split = fused.split, all_pool_split
        try:
            with_threads(2, kernel)()
        finally:
            fused.split = real

    with torch.no_grad():
        out = {"B": B, "kernel": alternate(with_threads(1, kernel), with_threads(2, kernel), rounds),
               "solver": alternate(with_threads(1, whole), with_threads(2, whole), rounds),
               "split": alternate(old_split, with_threads(2, kernel), rounds)}
    pool.shutdown()
    return out


def crossover(rounds: int) -> list[tuple[str, dict]]:
    """Where a second thread starts to pay: ln-closed-form (float32) at 2^12 ... 2^18 tokens per
    call and ols at 2^18 ... 2^22 context values, one thread vs two with the split forced
    (fused.MIN_WORK_PER_THREAD, fused_ols.MIN_BYTES_PER_THREAD set to 1): (case, timings) rows."""
    from icl_bench.solvers import fused_ols

    rows = []
    saved = fused.MIN_WORK_PER_THREAD, fused_ols.MIN_BYTES_PER_THREAD
    fused.MIN_WORK_PER_THREAD = fused_ols.MIN_BYTES_PER_THREAD = 1
    try:
        with torch.no_grad():
            for name, dtype, N, sizes, unit in (("ln-closed-form", "float32", 10, (12, 14, 16, 18), "tokens"),
                                                ("ln-closed-form", "float32", 100, (12, 14, 16, 18), "tokens"),
                                                ("ols", "float32", 100, (18, 20, 22), "values"),
                                                ("ols", "float64", 1000, (18, 20, 22), "values")):
                solver = get_solver(name)
                for k in sizes:
                    B = 2**k // (N + 1 if unit == "tokens" else N)
                    batch = sample_prompts(PromptSpec(N=N, noise=0.1, R=100.0), B, seed=0, dtype=dtype)
                    call = lambda n: lambda: _threads(n, lambda: solver.predict(batch.slice(0, B)))  # noqa: E731
                    mib = (batch.x.nbytes + batch.y.nbytes) / 2**20
                    rows.append((f"{name} {dtype} N = {N}, B = {B}: 2^{k} {unit}, x and y {mib:.1f} MiB",
                                 alternate(call(1), call(2), rounds)))
    finally:
        fused.MIN_WORK_PER_THREAD, fused_ols.MIN_BYTES_PER_THREAD = saved
    return rows


def _threads(n: int, fn) -> None:
    """fn() with the fused kernels on n threads (fused.THREADS), the earlier setting restored."""
    before, fused.THREADS = fused.THREADS, n
    try:
        fn()
    finally:
        fused.THREADS = before


def cases(c: dict, lcf: dict) -> list[tuple[str, str, dict]]:
    """(table, case name, timings) of one run: table "threads" (one thread vs two) or "split"
    (the all-pool split vs fused.split, both on two threads)."""
    out = [("threads", "control: compute-bound numba loop (16 values, in L1)", c["compute"]),
           ("threads", "control: memory-bound numba sum, 64 MiB", c["memory"])]
    for N, r in lcf.items():
        out += [("threads", f"ln-closed-form N = {N} (B = {r['B']}), fused kernel alone", r["kernel"]),
                ("threads", f"ln-closed-form N = {N} (B = {r['B']}), whole solver call", r["solver"])]
    out += [("split", f"ln-closed-form N = {N}, kernel on two threads", r["split"]) for N, r in lcf.items()]
    out += [("small", name, r) for name, r in c["crossover"]]
    return out


def report(runs: list[tuple[str, dict, dict]], rounds: int, out: str = "") -> str:
    """The Markdown report: the summary over runs, then every run's tables. runs: (start time, controls, lcf);
    out: the --out given, named in the command line it reports ("" for the default file)."""
    ms = lambda s: f"{s * 1e3:.3f}"  # noqa: E731
    la = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    rows = ["# Two threads against one: the machine's ceiling and the fused forward\n",
            f"Written by `python -m benchmarks.experiments.thread_ceiling --runs {len(runs)} --rounds {rounds}"
            f"{f' --out {out}' if out else ''}` "
            f"(runs started {runs[0][0]} … {runs[-1][0]}; load average at the end {la}). CPU: {cpu_model()} "
            f"({_cpu_arch()}), {os.cpu_count()} logical CPUs; torch {torch.__version__} with 1 thread; {rounds} "
            "alternating rounds per pair. Ratio = the first column's time / the second's (> 1: the second is "
            "faster): of the medians, and of the minima.\n",
            f"## Summary over the {len(runs)} runs\n",
            "| table | case | median ratio, lowest – highest run | minimum ratio, lowest – highest run |",
            "|---|---|---|---|"]
    per_run = [cases(c, lcf) for _, c, lcf in runs]
    for i, (table, name, _) in enumerate(per_run[0]):
        med = [run[i][2]["ratio"][0] for run in per_run]
        low = [run[i][2]["ratio"][1] for run in per_run]
        rows.append(f"| {table} | {name} | {min(med):.2f} – {max(med):.2f} | {min(low):.2f} – {max(low):.2f} |")
    costs = [c["split_cost"] for _, c, _ in runs]
    rows.append(f"\n`fused.split` with two empty shares (waking the pool's worker), per call: medians "
                f"{min(m for m, _ in costs) * 1e6:.1f} – {max(m for m, _ in costs) * 1e6:.1f} µs, minima "
                f"{min(n for _, n in costs) * 1e6:.1f} – {max(n for _, n in costs) * 1e6:.1f} µs.\n")
    for N in runs[0][2]:
        rest = {k: [lcf[N]["solver"][k][0] - lcf[N]["kernel"][k][0] for _, _, lcf in runs] for k in ("one", "two")}
        rows.append(f"ln-closed-form N = {N}, whole call minus kernel alone (medians; the screens and the solver's own "
                    f"steps): {min(rest['one']) * 1e3:.2f} – {max(rest['one']) * 1e3:.2f} ms on one thread, "
                    f"{min(rest['two']) * 1e3:.2f} – {max(rest['two']) * 1e3:.2f} ms on two.\n")
    rows.append("Table \"threads\": one thread vs two. Table \"split\": both on two threads, the split that "
                "fused.split replaced (every share handed to a pool of two while the caller waits) vs fused.split "
                "(the caller takes the first share). Table \"small\": one thread vs two at "
                "small to large calls, the split forced whatever the size (where the solvers' own thresholds, "
                "fused.MIN_WORK_PER_THREAD and fused_ols.MIN_BYTES_PER_THREAD, would keep one thread).\n")
    heads = {"threads": ("one thread", "two threads"), "split": ("all-pool split", "fused.split"),
             "small": ("one thread", "two threads, split forced")}
    for k, ((started, c, _), run) in enumerate(zip(runs, per_run), 1):
        rows.append(f"## Run {k} (started {started})\n")
        for table, (h1, h2) in heads.items():
            rows += [f"| {table}: case | {h1}, ms (median / min) | {h2}, ms (median / min) | ratio (median) | ratio (min) |",
                     "|---|---|---|---|---|"]
            rows += [f"| {name} | {ms(r['one'][0])} / {ms(r['one'][1])} | {ms(r['two'][0])} / {ms(r['two'][1])} "
                     f"| {r['ratio'][0]:.2f} | {r['ratio'][1]:.2f} |" for t, name, r in run if t == table]
            rows.append("")
        rows.append(f"`fused.split` with two empty shares: median {c['split_cost'][0] * 1e6:.1f} µs, "
                    f"min {c['split_cost'][1] * 1e6:.1f} µs per call.\n")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="repeats of the whole measurement (default 5)")
    ap.add_argument("--rounds", type=int, default=60, help="alternating rounds per pair (default 60)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "thread_ceiling.md", help="the Markdown report")
    args = ap.parse_args()
    for name in ("runs", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: must be an integer >= 1")
    torch.set_num_threads(1)
    runs = []
    for _ in range(args.runs):
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        c = controls(args.rounds)
        c["crossover"] = crossover(args.rounds)
        runs.append((started, c, {N: ln_closed_form(N, args.rounds) for N in (100, 1000)}))
    default = args.out.resolve() == (ROOT / "results" / "thread_ceiling.md").resolve()
    text = report(runs, args.rounds, "" if default else os.path.relpath(args.out, ROOT))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
