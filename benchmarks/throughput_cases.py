"""What the throughput suite times, besides the registered solvers: the references and helpers.

References (each measured in the same pytest-benchmark run as the solvers):
    numpy-ols             closed-form OLS in vectorised numpy, the textbook two-pass formula
                          (means, centred values, two sums of products): the classical baseline.
    torch-lstsq           batched torch.linalg.lstsq on the design [1, x], as peer research code
                          computes its OLS baseline.
    linregress-loop       scipy.stats.linregress called once per prompt (a Python loop, as a user
                          with one regression routine would write it); slow, so its batch is small.
    quadratic-attention   the transformer's forward through the explicit (N+1) x N score matrix
                          per head (Transformer.forward_quadratic), the O(N^2) way published code
                          computes linear attention; the batch is capped by memory and time.
    transformer-forward   the same module's forward (Transformer.forward: the fused kernel of
                          icl_bench/solvers/fused.py on the CPU), without a solver's wrapper.
    transformer-eager     the same module's eager torch forward (Transformer.forward_eager).
"the same transformer" is the ln-closed-form construction (2 layers, 2 heads, d_model 4, LN) when
that solver is available, else a TransformerConfig() module (the same shape) with random weights.

Prompts: PromptSpec(N, noise=NOISE, R=R), seed SEED; every case of one (N, dtype, device) reads the
same prompts. Batch sizes: B = values // N by default (conftest.py), then `fit_batch` shrinks a
case's batch until one call takes about `budget` seconds (per-prompt loops, quadratic attention,
gd-lsa at large N); figures are compared per prompt.
"""
from __future__ import annotations

import time
from functools import lru_cache

import numpy as np
import scipy.stats
import torch

from icl_bench import PromptSpec, get_solver, sample_prompts
from icl_bench.bench.timing import sync
from icl_bench.solvers.transformer import Transformer, TransformerConfig

NS = (100, 1000, 4000)  # context lengths N
DTYPES = ("float32", "float64")
DEVICES = ("cpu", "cuda")
R = 100.0  # embedding constant of the prompts
NOISE = 0.1
SEED = 0
PROBE = 128  # prompts used to estimate a case's cost per prompt (16 read the fixed cost of a call as per-prompt)
PROBE_CALLS = 3  # timed probe calls; the fastest is the estimate (one slow call shrank fast cases at random)
GROW_CALLS = 4  # calls of the estimated batch that refine the estimate (fit_batch: a call's fixed cost)
QUADRATIC_BYTES = 256 * 2**20  # cap on one call's score matrices (all heads of one layer)


def require_device(device: str) -> None:
    """Skip the calling test when `device` is not usable here (the reason names what is missing)."""
    import pytest

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA is not available on this machine (torch.cuda.is_available() is False; no GPU lent)")


@lru_cache(maxsize=4)
def prompts(N: int, dtype: str, device: str, B: int):
    """The shared prompt batch of one (N, dtype, device): B prompts."""
    return sample_prompts(PromptSpec(N=N, noise=NOISE, R=R), B, seed=SEED, dtype=dtype, device=device)


def numpy_ols(x: np.ndarray, y: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Textbook closed-form OLS prediction in numpy. x, y (B, N); u (B,) -> (B,), dtype of x."""
    x_bar = x.mean(axis=1)  # (B,)
    y_bar = y.mean(axis=1)
    xc = x - x_bar[:, None]  # (B, N)
    yc = y - y_bar[:, None]
    slope = (xc * yc).sum(axis=1) / (xc * xc).sum(axis=1)
    return y_bar + slope * (u - x_bar)


def torch_lstsq(x: torch.Tensor, y: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Batched torch.linalg.lstsq on the design [1, x] (how peer research code computes its OLS
    baseline). x, y (B, N); u (B,) -> (B,) in x's dtype."""
    design = torch.stack([torch.ones_like(x), x], dim=2)  # (B, N, 2)
    coef = torch.linalg.lstsq(design, y.unsqueeze(2)).solution  # (B, 2, 1)
    return coef[:, 0, 0] + coef[:, 1, 0] * u


def linregress_loop(x: np.ndarray, y: np.ndarray, u: np.ndarray) -> np.ndarray:
    """scipy.stats.linregress per prompt. x, y (B, N); u (B,) -> (B,) float64."""
    out = np.empty(x.shape[0])
    for i in range(x.shape[0]):
        fit = scipy.stats.linregress(x[i], y[i])
        out[i] = fit.intercept + fit.slope * u[i]
    return out


def reference_transformer(dtype: str, device: str) -> tuple[Transformer, str]:
    """(module in eval mode, description): the ln-closed-form construction for R if available."""
    dt = getattr(torch, dtype)
    try:
        return get_solver("ln-closed-form").model(R, dt, device), "ln-closed-form construction"
    except Exception as exc:  # the solver may be absent or broken: keep the reference honest
        torch.manual_seed(SEED)
        module = Transformer(TransformerConfig()).to(device=device, dtype=dt).eval()
        return module, f"TransformerConfig() with random weights (ln-closed-form unavailable: {type(exc).__name__})"


def quadratic_batch_cap(module: Transformer, N: int, dtype: str) -> int:
    """Most prompts whose (N+1) x N score matrices (all heads of one layer) fit QUADRATIC_BYTES."""
    per_prompt = module.cfg.n_heads * (N + 1) * (N + 1) * torch.finfo(getattr(torch, dtype)).bits // 8
    return max(1, QUADRATIC_BYTES // per_prompt)


def fit_batch(call, B_max: int, budget: float, device: str) -> int:
    """Largest batch <= B_max whose call is estimated to take <= `budget` seconds (>= 1 prompt).

    call(b) runs the case on the first b prompts; it is warmed up, then timed PROBE_CALLS times at
    b = min(PROBE, B_max), the fastest call giving seconds per prompt (an estimate: only the batch
    is chosen by it). A single call of 16 prompts had counted a call's fixed cost and the machine's
    noise as per-prompt cost, and shrank cases whose whole batch took a tenth of the budget.
    The estimate still carries the call's fixed cost (t / b >= the cost per prompt), so it can only
    under-size the batch: a call of the estimated size is timed and the estimate redone from it, up
    to GROW_CALLS times, while the batch grows. On a GPU a call's launches and synchronisation
    (about 1 ms for a multi-kernel forward) had cut 2^24-value batches to a few thousand prompts,
    whose figures were mostly that fixed cost (a review).
    """
    b = min(PROBE, B_max)
    call(b)
    sync(device)
    times = []
    for _ in range(PROBE_CALLS):
        times.append(_seconds(call, b, device))
    per_prompt = min(times) / b
    for _ in range(GROW_CALLS):
        if per_prompt * B_max <= budget:
            return B_max
        grown = max(1, min(B_max, int(budget / per_prompt)))
        if grown < 1.2 * b:  # settled: the fixed cost is amortised at b already
            return grown
        b = grown
        per_prompt = _seconds(call, b, device) / b
    return B_max if per_prompt * B_max <= budget else max(1, min(B_max, int(budget / per_prompt)))


def _seconds(call, b: int, device: str) -> float:
    """Seconds of one synchronised call(b)."""
    t0 = time.perf_counter()
    call(b)
    sync(device)
    return time.perf_counter() - t0
