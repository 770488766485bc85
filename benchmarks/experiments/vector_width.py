"""The fused kernels at LLVM's preferred vector width against 512 bits (icl_bench/solvers/fused_cpu.py).

numba's CPU features are fixed per process, so each measurement runs in a child process: "256"
with NUMBA_CPU_FEATURES set to the host's own features (what numba compiled before
fused_cpu.wide_vectors; `wide_vectors` leaves an explicit setting alone), "512" without it (the
default since then: the host's features plus -prefer-256-bit on an AVX-512 x86 CPU). On a CPU
whose LLVM tuning already prefers 512 bits, or that has no AVX-512, the two are the same code.

- asm: one child per setting compiles the dense d_model 4 / 2-head LayerNorm kernel (the
  trained-nol1 checkpoint's, float32) into a fresh kernel folder and counts, in the assembly of
  its key-value pass `bkeys_0`, the 512-bit (zmm) and 256-bit (ymm) register operands, the packed
  multiplications (vmulps) and the stack operands ((%rsp)).
- forward: --runs pairs of children, alternating 256 / 512; each times `fused.fused_forward`
  alone (one thread, N = 1000, 1048 prompts, R = 100) for six transformer solvers in float32 and
  float64, CALLS calls after one untimed call, and reports ns per token (best and median).

    python -m benchmarks.experiments.vector_width [--runs 3] [--out results/vector_width.md]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOLVERS = ("trained-nol1", "trained-lsa", "trained-l1-noaug", "trained-l1", "ln-closed-form", "gd-lsa")
N, B, R, CALLS = 1000, 1048, 100.0, 21


def _model(name: str, batch):
    """The solver's transformer for the batch (a trained checkpoint's, or a construction)."""
    from icl_bench import get_solver

    s = get_solver(name)
    return s.model_for(batch) if hasattr(s, "model_for") else s.model(R, dtype=batch.dtype)


def child_asm() -> dict:
    """Counts in the assembly of the dense kernel's key-value pass (float32), compiled here."""
    import torch

    from icl_bench import PromptSpec, sample_prompts
    from icl_bench.solvers import fused, fused_cpu

    batch = sample_prompts(PromptSpec(N=40, noise=0.1, R=R), 4, seed=0, dtype="float32")
    m = _model("trained-nol1", batch)
    with torch.no_grad():
        fused.fused_forward(m, batch.tokens)
    kern = fused._entry(m, torch.float32)["kernel"][1]
    asm = "\n".join(kern.py_func.__globals__["bkeys_0"].inspect_asm().values())
    count = lambda pattern: len(re.findall(pattern, asm))  # noqa: E731
    return {"setting": fused_cpu.describe(), "zmm": count(r"%zmm"), "ymm": count(r"%ymm"),
            "vmulps": count(r"\bvmulps\b"), "stack": count(r"\(%rsp\)")}


def child_forward() -> dict:
    """ns per token of fused_forward alone, (best, median) of CALLS calls, per solver and dtype."""
    import torch

    from icl_bench import PromptSpec, sample_prompts
    from icl_bench.solvers import fused, fused_cpu

    torch.set_num_threads(1)
    fused.THREADS = 1
    out = {}
    for dtype in ("float32", "float64"):
        batch = sample_prompts(PromptSpec(N=N, noise=0.1, R=R), B, seed=0, dtype=dtype)
        for name in SOLVERS:
            m = _model(name, batch)
            with torch.no_grad():
                assert fused.fused_forward(m, batch.tokens) is not None, f"{name}: the fused path did not run"
                times = []
                for _ in range(CALLS):
                    t0 = time.perf_counter()
                    fused.fused_forward(m, batch.tokens)
                    times.append(time.perf_counter() - t0)
            times.sort()
            per_token = lambda t: t / (B * (N + 1)) * 1e9  # noqa: E731
            out[f"{name} {dtype}"] = (per_token(times[0]), per_token(times[CALLS // 2]))
    return {"setting": fused_cpu.describe(), **out}


def run_child(mode: str, narrow: bool, host: str, kernel_dir: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CPU_FEATURES", "NUMBA_CPU_NAME")}
    if narrow:
        env["NUMBA_CPU_FEATURES"] = host
    if kernel_dir:
        env["ICL_BENCH_KERNEL_DIR"] = kernel_dir
    done = subprocess.run([sys.executable, "-m", "benchmarks.experiments.vector_width", "--child", mode],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(asm: dict, runs: list[dict], host_name: str, started: str, out: str) -> str:
    from icl_bench.provenance import cpu_model

    widths = ("256", "512")
    rows = ["# Vector width: the fused kernels at 256 and 512 bits\n",
            f"Written by `python -m benchmarks.experiments.vector_width --runs {len(runs)}"
            f"{f' --out {out}' if out else ''}` (started {started}; load average at the end "
            f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}). CPU: {cpu_model()} (LLVM `{host_name}`). "
            "256: NUMBA_CPU_FEATURES set to the host's own features; 512: the default (docs/throughput.md, "
            "\"Vector width\"). The children's own description of their setting: "
            + "; ".join(f"{w}: {asm[w]['setting']}" for w in widths) + " (asm), "
            + "; ".join(f"{w}: {', '.join(sorted({r[w]['setting'] for r in runs}))}" for w in widths) + " (forward).\n",
            "## Assembly of the dense kernel's key-value pass (`bkeys_0`, float32)\n",
            "| width | zmm operands | ymm operands | vmulps | stack operands |", "|---|---|---|---|---|"]
    rows += [f"| {w} | {asm[w]['zmm']} | {asm[w]['ymm']} | {asm[w]['vmulps']} | {asm[w]['stack']} |" for w in widths]
    rows += ["", f"## `fused_forward` alone, ns per token (N = {N}, {B} prompts, one thread; best of {CALLS} calls)\n",
             "Each run is a pair of processes, 256 then 512. \"512 faster\": in how many runs the 512-bit "
             "process's best call was the faster.\n",
             "| case | 256, best per run | 512, best per run | 512 faster | 256, median per run | 512, median per run |",
             "|---|---|---|---|---|---|"]
    for case in (k for k in runs[0]["256"] if k != "setting"):
        best = {w: [r[w][case][0] for r in runs] for w in widths}
        med = {w: [r[w][case][1] for r in runs] for w in widths}
        wins = sum(b5 < b2 for b2, b5 in zip(best["256"], best["512"]))
        fmt = lambda xs: " / ".join(f"{x:.2f}" for x in xs)  # noqa: E731
        rows.append(f"| {case} | {fmt(best['256'])} | {fmt(best['512'])} | {wins} of {len(runs)} | "
                    f"{fmt(med['256'])} | {fmt(med['512'])} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="pairs of forward processes, 256 then 512 (default 3)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "vector_width.md", help="the Markdown report")
    ap.add_argument("--child", choices=("asm", "forward"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child_asm() if args.child == "asm" else child_forward()))
        return
    if args.runs < 1:
        ap.error("--runs: must be an integer >= 1")
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    host = llvm.get_host_cpu_features().flatten()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    asm = {}
    for width, narrow in (("256", True), ("512", False)):
        with tempfile.TemporaryDirectory() as kernels:  # a fresh folder: compiled here, so inspect_asm has the code
            asm[width] = run_child("asm", narrow, host, kernels)
    runs = []
    for _ in range(args.runs):
        runs.append({w: run_child("forward", narrow, host) for w, narrow in (("256", True), ("512", False))})
    default = args.out.resolve() == (ROOT / "results" / "vector_width.md").resolve()
    text = report(asm, runs, llvm.get_host_cpu_name(), started, "" if default else os.path.relpath(args.out, ROOT))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
