"""Throughput of every registered solver and of the references, in one pytest-benchmark run.

    python -m pytest benchmarks/ --benchmark-only [--benchmark-json=PATH]
    python -m benchmarks.experiments.summarize [PATH]   # the ratio table (results/throughput.md, .csv)

Cases: every name the registry knows (built-ins and plugins, never a fixed list) x N in NS x
float32 / float64 x cpu / cuda, plus the references of throughput_cases.py; "eager:<name>" is a
transformer solver with its fused CPU forward off (icl_bench.solvers.fused.ENABLED = False; skipped for
solvers that run no fused forward), "threads:<name>" a solver whose fused kernels run on
THREADS[name] threads. A solver that is
unavailable (fails to load, needs what this machine lacks) or raises SkipCell is skipped with the
reason; cuda cases are skipped without CUDA. All cases of one (N, dtype, device) run back to
back. Each benchmark times one predict() (or reference)
call on a batch under torch.no_grad(), synchronising CUDA inside the timed call, after a warm-up
call; extra_info records kind, name, N, dtype, device and batch_size, so figures are compared
per prompt. A call moves the same number of context values at every N (B = --bench-values // N,
fewer where a call would exceed --bench-budget seconds). Nothing is asserted about speed here: benchmarks/experiments/summarize.py reports the ratios.
"""
from __future__ import annotations

import pytest
import torch

from benchmarks.throughput_cases import (DEVICES, DTYPES, NS, fit_batch, linregress_loop, numpy_ols, prompts,
                                         quadratic_batch_cap, reference_transformer, require_device, torch_lstsq)
from icl_bench.bench.timing import sync
from icl_bench.solvers import fused
from icl_bench.solvers.base import SkipCell
from icl_bench.solvers.registry import get_solver, known_names

REFERENCES = ("numpy-ols", "torch-lstsq", "linregress-loop", "quadratic-attention", "transformer-forward",
              "transformer-eager")
THREADS = {"ln-closed-form": 2, "ols": 2}  # solver -> threads of the fused kernels in its "threads" case
CASES = ([f"solver:{name}" for name in known_names()] + [f"eager:{name}" for name in known_names()]
         + [f"threads:{name}" for name in THREADS] + [f"reference:{name}" for name in REFERENCES])


def _run(benchmark, kind: str, name: str, N: int, dtype: str, device: str, B: int, call, **info) -> None:
    """Warm up call(B) once more, then hand it to pytest-benchmark with the case's extra_info."""

    def timed():
        with torch.no_grad():
            out = call(B)
        sync(device)
        return out

    timed()
    if kind == "threads":  # the threads the kernels took (fewer than asked for on a small batch)
        info["threads_used"] = fused.last_shares
    benchmark.extra_info.update(kind=kind, name=name, N=N, dtype=dtype, device=device, batch_size=B, **info)
    benchmark(timed)


# the first parameter varies fastest: all cases of one (N, dtype, device) run back to back, so the
# ratios between them compare measurements taken seconds apart (the machine's load drifts)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("N", NS, ids=[f"N{n}" for n in NS])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("device", DEVICES)
def test_throughput(benchmark, bench_opts, case, N, dtype, device):
    kind, name = case.split(":", 1)
    if kind == "solver":
        return _solver(benchmark, bench_opts, name, N, dtype, device)
    if kind == "eager":
        return _eager(benchmark, bench_opts, name, N, dtype, device)
    if kind == "threads":
        return _threads(benchmark, bench_opts, name, N, dtype, device)
    return REFERENCE_CASES[name](benchmark, bench_opts, N, dtype, device)


def _eager(benchmark, bench_opts, name, N, dtype, device):
    """A transformer solver with the fused CPU forward switched off (icl_bench.solvers.fused.ENABLED):
    its eager torch forward, the baseline of the fused one."""
    if device != "cpu":
        pytest.skip(f"{name}: the fused forward is CPU-only; on {device} the solver case is the eager one")
    before = fused.calls
    try:
        solver = get_solver(name)
        batch = prompts(N, dtype, device, bench_opts.batch(N))
        solver.check_batch(batch)
        with torch.no_grad():
            solver.predict(batch.slice(0, 2))
    except SkipCell as exc:
        pytest.skip(f"{name}: {exc}")
    except Exception as exc:  # noqa: BLE001 - reported as the reason of the skip
        pytest.skip(f"{name}: unavailable: {type(exc).__name__}: {exc}")
    if fused.calls == before:
        pytest.skip(f"{name}: not a transformer solver (no fused forward ran)")
    fused.ENABLED = False
    try:
        with torch.no_grad():
            B = fit_batch(lambda b: solver.predict(batch.slice(0, b)), batch.B, bench_opts.budget, device)
        _run(benchmark, "eager", name, N, dtype, device, B, lambda b: solver.predict(batch.slice(0, b)),
             params=solver.params_json)
    finally:
        fused.ENABLED = True


def _threads(benchmark, bench_opts, name, N, dtype, device):
    """The solver with its fused CPU kernels on THREADS[name] threads (icl_bench.solvers.fused.THREADS;
    torch's own ops keep --torch-threads: its pool would spin against the kernel's threads)."""
    require_device(device)
    if device != "cpu":
        pytest.skip("threads cases: CPU only")
    fused.THREADS = THREADS[name]
    try:
        _solver(benchmark, bench_opts, name, N, dtype, device, kind="threads", threads=THREADS[name])
    finally:
        fused.THREADS = None


def _solver(benchmark, bench_opts, name, N, dtype, device, kind="solver", **info):
    require_device(device)
    try:
        solver = get_solver(name)
    except Exception as exc:  # not installed, broken plugin, needs parameters: skip, with why
        pytest.skip(f"{name}: unavailable: {type(exc).__name__}: {exc}")
    batch = prompts(N, dtype, device, bench_opts.batch(N))
    try:
        solver.check_batch(batch)
        with torch.no_grad():
            B = fit_batch(lambda b: solver.predict(batch.slice(0, b)), batch.B, bench_opts.budget, device)
    except SkipCell as exc:
        pytest.skip(f"{name}: {exc}")
    weighted = bool(solver.weights())  # a transformer solver (its weights): the GPU goal's 1e7 prompts/s
    _run(benchmark, kind, name, N, dtype, device, B, lambda b: solver.predict(batch.slice(0, b)),
         params=solver.params_json, transformer=weighted, **info)


def _numpy_ols(benchmark, bench_opts, N, dtype, device):
    if device != "cpu":
        pytest.skip("numpy-ols: numpy runs on the CPU only")
    batch = prompts(N, dtype, device, bench_opts.batch(N))
    x, y, u = batch.x.numpy(), batch.y.numpy(), batch.x_query.numpy()  # views, no copy
    assert abs(numpy_ols(x, y, u) - batch.ols_prediction.numpy()).max() < 1e-3  # it computes OLS
    _run(benchmark, "reference", "numpy-ols", N, dtype, device, batch.B, lambda b: numpy_ols(x[:b], y[:b], u[:b]))


def _linregress_loop(benchmark, bench_opts, N, dtype, device):
    if device != "cpu":
        pytest.skip("linregress-loop: scipy runs on the CPU only")
    batch = prompts(N, dtype, device, bench_opts.batch(N))
    x, y, u = batch.x.numpy(), batch.y.numpy(), batch.x_query.numpy()
    call = lambda b: linregress_loop(x[:b], y[:b], u[:b])  # noqa: E731
    B = fit_batch(call, batch.B, bench_opts.budget, device)
    _run(benchmark, "reference", "linregress-loop", N, dtype, device, B, call)


def _quadratic_attention(benchmark, bench_opts, N, dtype, device):
    require_device(device)
    batch = prompts(N, dtype, device, bench_opts.batch(N))
    module, what = reference_transformer(dtype, device)
    call = lambda b: module.forward_quadratic(batch.tokens[:b])  # noqa: E731
    with torch.no_grad():
        B = fit_batch(call, min(batch.B, quadratic_batch_cap(module, N, dtype)), bench_opts.budget, device)
    _run(benchmark, "reference", "quadratic-attention", N, dtype, device, B, call, transformer=what)


def _transformer_forward(benchmark, bench_opts, N, dtype, device, eager=False):
    require_device(device)
    batch = prompts(N, dtype, device, bench_opts.batch(N))
    module, what = reference_transformer(dtype, device)
    forward = module.forward_eager if eager else module
    call = lambda b: forward(batch.tokens[:b])  # noqa: E731
    with torch.no_grad():
        B = fit_batch(call, batch.B, bench_opts.budget, device)
    name = "transformer-eager" if eager else "transformer-forward"
    _run(benchmark, "reference", name, N, dtype, device, B, call, transformer=what)


def _torch_lstsq(benchmark, bench_opts, N, dtype, device):
    require_device(device)
    batch = prompts(N, dtype, device, bench_opts.batch(N))
    call = lambda b: torch_lstsq(batch.x[:b], batch.y[:b], batch.x_query[:b])  # noqa: E731
    ok = torch.isfinite(batch.ols_prediction[:64])
    assert (call(64).double()[ok] - batch.ols_prediction[:64][ok]).abs().max() < 1e-2  # it computes OLS
    with torch.no_grad():
        B = fit_batch(call, batch.B, bench_opts.budget, device)
    _run(benchmark, "reference", "torch-lstsq", N, dtype, device, B, call)


REFERENCE_CASES = {"numpy-ols": _numpy_ols, "linregress-loop": _linregress_loop, "torch-lstsq": _torch_lstsq,
                   "quadratic-attention": _quadratic_attention, "transformer-forward": _transformer_forward,
                   "transformer-eager": lambda *a: _transformer_forward(*a, eager=True)}
