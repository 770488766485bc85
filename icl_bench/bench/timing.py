"""How the suite times a solver: the policy behind the runner's `prompts_per_s`.

    only predict() is inside the timer: prompts are drawn and cut into batches before it starts;
    warm-up outside the timer: one predict on the first batch, and on the last one if its size
        differs (lazy model construction, caches, kernel choice, allocator growth);
    CUDA: torch.cuda.synchronize(device) before every clock read, so queued kernels are counted;
    a *sample* is one or more full passes over the prompts: a pass shorter than MIN_SAMPLE_S is
        repeated inside one sample (as timeit does), so clock resolution and per-call jitter stay
        small next to what is measured;
    between 1 and `repeats` samples, stopping early once `max_seconds` went into timing;
    the median seconds per pass is reported; Python's garbage collector is paused meanwhile.

The benchmark suite (benchmarks/, pytest-benchmark) times the same predict() calls with the same
warm-up and synchronisation, so the two agree (checked by benchmarks/test_runner_agreement.py).
"""
from __future__ import annotations

import gc
import math
import statistics
import time
from typing import Any, Callable

import torch

MIN_SAMPLE_S = 0.005  # seconds: shorter passes are grouped into one sample
MAX_PASSES_PER_SAMPLE = 1000
_clock = time.perf_counter  # seconds, monotonic (a module attribute so tests can swap it)


def sync(device: str | torch.device) -> None:
    """Wait for the device's queued work (no-op on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_passes(run_pass: Callable[[], Any], device: str | torch.device, *, repeats: int = 3,
                max_seconds: float = 1.0, min_sample_s: float = MIN_SAMPLE_S) -> tuple[Any, float, int, int]:
    """Time `run_pass` (one full pass over the prompts, already warmed up) by the policy above.

    Args:
        run_pass: callable doing one pass; its return value of the last call is handed back.
        device: where the work runs (CUDA is synchronised before each clock read).
        repeats: most samples (>= 1); max_seconds: stop taking samples after this much timing.
        min_sample_s: passes faster than this are repeated within one sample.
    Returns:
        (last result, median seconds per pass, number of samples, passes per sample).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        t0 = _clock()
        result = run_pass()  # the first pass also sizes the samples
        sync(device)
        first = _clock() - t0
        inner = 1 if first >= min_sample_s else min(MAX_PASSES_PER_SAMPLE, math.ceil(min_sample_s / max(first, 1e-9)))
        per_pass = [first] if inner == 1 else []
        spent = first
        while len(per_pass) < max(1, repeats) and spent < max_seconds:
            t0 = _clock()
            for _ in range(inner):
                result = run_pass()
            sync(device)
            elapsed = _clock() - t0
            per_pass.append(elapsed / inner)
            spent += elapsed
        if not per_pass:  # the first pass alone used up max_seconds
            per_pass, inner = [first], 1
    finally:
        if enabled:
            gc.enable()
    return result, statistics.median(per_pass), len(per_pass), inner
