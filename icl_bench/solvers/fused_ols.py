"""Closed-form OLS predictions through a numba kernel (CPU): the arithmetic of the OLS reference.

The arithmetic is that of the reference's one-pass path (icl_bench/prompts/ols.py: shifted sums,
Chan, Golub & LeVeque 1983, eq. 1.7; here the shift is the mean of the first SHIFT_SAMPLES values):
per prompt one pass over x and y, the five sums in vector lanes (the only reassociated step),
one more around c + mean(x', y') where the shift sits far from the mean (as the reference's
`_refined`), then the moments and the prediction in program order. Prompts are split (`fused.split`) over up
to `fused.num_threads()` threads, one per MIN_BYTES_PER_THREAD of x and y. Used by the `ols`
solver (icl_bench_baselines/ols.py).

Which prompts are ill-posed (NaN), and every prompt near the reference's limits, is left to the
reference: the kernel only answers a prompt whose x has clear spread (Sxx > SCREEN * sum x^2, i.e.
sd(x) above 10% of the root mean square of x), whose sums of squares lie in the reference's fast
range [1/r, r] (r = FAST_RANGE) and whose answer is finite; every other prompt (constant or
near-constant x or y, NaN / inf, extreme scales, an overflow) is recomputed by
`icl_bench.prompts.ols.ols_predict`, the shared criterion (`ill_posed`) included.
"""
from __future__ import annotations

import torch

from icl_bench.solvers import fused
from icl_bench.prompts.ols import FAST_RANGE, REFINE, REFINE_PASSES, SHIFT_SAMPLES, ols_predict

SCREEN = 1e-2  # the kernel answers prompts with Sxx > SCREEN * sum x^2; the reference the rest
MIN_BYTES_PER_THREAD = 3 * 2**20  # of x and y per thread; smaller shares lose to waking a thread: two
#   threads forced ran 0.69-0.94x one thread at 2-4 MiB of x and y in all, 1.10-1.55x at 8-64 MiB
#   (medians, lowest - highest of five runs, results/thread_ceiling.md); with 3 MiB, 2^20 float32
#   values (8 MiB less a few bytes) split, 4 MiB do not
_KERNEL: list = []  # [(sums, kernel)] once compiled


def _compile():
    """The two numba functions: `sums` (the reduction, reassociated into vector lanes) and
    `kernel` (per prompt: shift, sums, moments, prediction, in program order). Compiled in
    memory once per process (about a second), never cached on disk: a run writes no files
    besides its own (its crash-safety test counts the renames)."""
    if _KERNEL:
        return _KERNEL[0]
    nb = fused.numba  # imported by fused.available()

    @nb.njit(fastmath={"reassoc", "contract"}, error_model="numpy", nogil=True)
    def sums(x, y, b, cx, cy):  # sum x', sum y', sum x'^2, sum x'y', sum y'^2 over prompt b
        F = x.dtype.type
        sx = sy = sxx = sxy = syy = F(0.0)
        for i in range(x.shape[1]):
            a = x[b, i] - cx
            c = y[b, i] - cy
            sx += a
            sy += c
            sxx += a * a
            sxy += a * c
            syy += c * c
        return sx, sy, sxx, sxy, syy

    @nb.njit(error_model="numpy", nogil=True)
    def kernel(x, y, u, out, redo, k, screen, r, refine, passes, b0, b1):
        F = x.dtype.type
        N = x.shape[1]
        fn, fk = F(N), F(k)
        for b in range(b0, b1):
            cx = cy = F(0.0)
            for i in range(k):
                cx += x[b, i]
                cy += y[b, i]
            cx, cy = cx / fk, cy / fk
            sx, sy, sxx, sxy, syy = sums(x, y, b, cx, cy)
            ox, oy = sx / fn, sy / fn  # means of x', y'
            for _ in range(passes):  # a shift far from the mean: again around c + mean (the reference's `_refined`)
                if not (sxx > F(refine) * (sxx - sx * ox) or syy > F(refine) * (syy - sy * oy)):
                    break
                cx, cy = cx + ox, cy + oy
                sx, sy, sxx, sxy, syy = sums(x, y, b, cx, cy)
                ox, oy = sx / fn, sy / fn
            x_bar, y_bar = cx + ox, cy + oy
            Sxx, Sxy = sxx - sx * ox, sxy - sx * oy
            scale = Sxx + fn * x_bar * x_bar  # sum x^2
            pred = y_bar + (Sxy / Sxx) * ((u[b] - cx) - ox)  # u - x_bar in the reference's order (its shift differs)
            out[b] = pred
            lo, hi = F(1.0 / r), F(r)  # the reference's fast range for the sums of squares
            in_range = lo <= sxx <= hi and lo <= syy <= hi  # False for NaN
            redo[b] = not (in_range and Sxx > F(screen) * scale and abs(pred) < F(float("inf")))

    _KERNEL.append((sums, kernel))
    return _KERNEL[0]


def fast_ols_predict(x: torch.Tensor, y: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`icl_bench.prompts.ols.ols_predict(x, y, u)` through the numba kernel where it applies (CPU,
    float32 / float64, no gradient, numba present); the reference call otherwise.
    x, y (B, N); u (B,) -> (B,) in x's dtype, NaN exactly where the reference says so."""
    B, N = x.shape
    usable = (fused.available() and x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)
              and y.dtype == x.dtype and u.dtype == x.dtype and B > 0 and N > 0
              and not (torch.is_grad_enabled() and (x.requires_grad or y.requires_grad or u.requires_grad)))
    if not usable:
        return ols_predict(x, y, u)
    _, kernel = _compile()
    xs, ys, us = (t.detach().contiguous().numpy() for t in (x, y, u))
    out = torch.empty(B, dtype=x.dtype)
    redo = torch.empty(B, dtype=torch.bool)
    args = (xs, ys, us, out.numpy(), redo.numpy(), min(SHIFT_SAMPLES, N), SCREEN, float(FAST_RANGE[x.dtype]),
            REFINE, REFINE_PASSES)
    threads = max(1, min(fused.num_threads(), (xs.nbytes + ys.nbytes) // MIN_BYTES_PER_THREAD))
    fused.split(lambda b0, b1: kernel(*args, b0, b1), B, threads)
    if redo.any():
        idx = redo.nonzero().squeeze(1)
        out[idx] = ols_predict(x[idx], y[idx], u[idx])
    return out
