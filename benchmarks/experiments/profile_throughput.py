"""Where the time goes: cProfile of the goal cases at N=1000, float32, batch 1048, one torch thread.

Cases: ols, numpy-ols, ln-closed-form, gd-lsa, the transformer's associative forward
(Transformer.forward, the fast path) and its token-major reference path (Transformer._run with
nn.LayerNorm, what forward was before the associative fast path, docs/throughput.md).

    python -m benchmarks.experiments.profile_throughput [--out results/throughput_profile.md] [--update-docs]

For each case (ols, numpy-ols, ln-closed-form, the associative transformer forward, gd-lsa) the
script warms up, then runs the call under cProfile for about --seconds and reports the wall time
per call and the functions and torch built-ins with the most own time (tottime), as a share of
the profiled time. cProfile's per-call overhead is small next to these multi-millisecond calls;
torch.profiler was tried and inflates small batched matmuls several-fold, so it is not used.
It also times each case (no profiler) with 1 torch thread and with all logical CPUs, alternating
call by call, which shows what torch's thread pool does on this machine at the current load.
--update-docs rewrites the marked profile block of docs/throughput.md.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks.throughput_cases import numpy_ols, prompts, reference_transformer
from icl_bench import get_solver

ROOT = Path(__file__).resolve().parents[2]  # the repository root
MARK = ("<!-- profile:begin (written by python -m benchmarks.experiments.profile_throughput --update-docs) -->", "<!-- profile:end -->")


def cases(N: int, dtype: str, B: int) -> dict:
    batch = prompts(N, dtype, "cpu", B)
    x, y, u = batch.x.numpy(), batch.y.numpy(), batch.x_query.numpy()
    module, _ = reference_transformer(dtype, "cpu")
    out = {"ols": lambda: get_solver("ols").predict(batch), "numpy-ols": lambda: numpy_ols(x, y, u)}
    for name in ("ln-closed-form", "gd-lsa"):
        try:
            solver = get_solver(name)
            out[name] = (lambda s: lambda: s.predict(batch))(solver)
        except Exception as exc:  # absent solver: say so in the report
            print(f"# {name}: unavailable ({type(exc).__name__}: {exc})", file=sys.stderr)
    out["transformer-forward"] = lambda: module(batch.tokens)
    out["transformer-token-major"] = lambda: module._run(batch.tokens, quadratic=False, keep=False)[0]
    return out


def profile(call, seconds: float) -> tuple[float, int, str]:
    """(median-free mean wall seconds per call, calls, top of the cProfile table by tottime)."""
    with torch.no_grad():
        call()
        t0 = time.perf_counter()
        call()
        per = time.perf_counter() - t0
        n = max(3, int(seconds / max(per, 1e-6)))
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(n):
            call()
        prof.disable()
        wall = (time.perf_counter() - t0) / n
    stats = pstats.Stats(prof)
    total = sum(v[2] for v in stats.stats.values())  # own time of everything profiled
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:12]
    lines = [f"{'share':>6} {'own ms/call':>11} {'calls/call':>10}  function"]
    for (file, line, func), (cc, nc, tt, ct, _) in rows:
        where = func if file == "~" else f"{Path(file).name}:{line} {func}"
        lines.append(f"{tt / total:6.1%} {tt / n * 1e3:11.3f} {nc / n:10.1f}  {where}")
    return wall, n, "\n".join(lines)


def thread_times(call, counts: tuple[int, ...], repeats: int) -> dict[int, list[float]]:
    """Seconds per call for each torch thread count, the counts alternating call by call (so
    both see the same load), after one warm-up call each."""
    old = torch.get_num_threads()
    out: dict[int, list[float]] = {n: [] for n in counts}
    try:
        with torch.no_grad():
            for n in counts:
                torch.set_num_threads(n)
                call()
            for _ in range(repeats):
                for n in counts:
                    torch.set_num_threads(n)
                    t0 = time.perf_counter()
                    call()
                    out[n].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(old)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--N", type=int, default=1000)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=0, help="prompts per call (default: 2**20 // N, as the suite)")
    ap.add_argument("--seconds", type=float, default=1.5, help="profiled time per case")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the suite's default is 1)")
    ap.add_argument("--repeats", type=int, default=9, help="calls per thread count in the thread comparison")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "throughput_profile.md")
    ap.add_argument("--update-docs", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.batch = args.batch or max(1, 2**20 // args.N)
    import os

    head = (f"Profile: N={args.N}, {args.dtype}, batch {args.batch}, {args.threads} torch thread(s), "
            f"torch {torch.__version__}; {datetime.now(timezone.utc).isoformat(timespec='seconds')}; "
            f"load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}. Share = own time / all profiled time.")
    parts = [head]
    all_cpus = os.cpu_count() or 1
    rows = ["| case | 1 thread: best / median ms | " + f"{all_cpus} threads: best / median ms | median ratio |", "|---|---|---|---|"]
    todo = cases(args.N, args.dtype, args.batch)
    for name, call in todo.items():
        t = thread_times(call, (1, all_cpus), args.repeats)
        one, many = sorted(t[1]), sorted(t[all_cpus])
        med1, medn = one[len(one) // 2], many[len(many) // 2]
        rows.append(f"| `{name}` | {one[0] * 1e3:.2f} / {med1 * 1e3:.2f} | {many[0] * 1e3:.2f} / {medn * 1e3:.2f} | {medn / med1:.2f} |")
    parts.append(f"Thread counts alternating call by call, {args.repeats} calls each (no profiler):\n\n" + "\n".join(rows))
    for name, call in todo.items():
        wall, n, table = profile(call, args.seconds)
        parts.append(f"#### `{name}`: {wall * 1e3:.2f} ms per call ({n} calls profiled)\n\n```\n{table}\n```")
    text = "\n\n".join(parts)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("# Throughput profile\n\n" + text + "\n")
    if args.update_docs:
        doc = ROOT / "docs" / "throughput.md"
        src = doc.read_text()
        head_, rest = src.split(MARK[0], 1)
        _, tail = rest.split(MARK[1], 1)
        doc.write_text(f"{head_}{MARK[0]}\n{text}\n{MARK[1]}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
