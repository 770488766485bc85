"""Closed-form OLS predictions through a numba kernel (CPU): the arithmetic of the OLS reference.

The arithmetic is that of icl_bench/prompts/ols.py (the shifted one-pass sums of Chan, Golub & LeVeque
1983, eq. 1.7, shift = the mean of the first SHIFT_SAMPLES values): per prompt one pass over x
and y, the four sums in vector lanes (the only reassociated step), then the moments and the
prediction in program order. Prompts are split over `fused.num_threads()` threads. Used by the
`ols` solver (baselines/ols.py) and by ln-closed-form's ill-posedness test.

Which prompts are ill-posed (NaN) is decided by the reference alone: the kernel only answers a
prompt whose x has clear spread (Sxx > SCREEN * sum x^2, i.e. sd(x) above 10% of the root mean
square of x) and whose answer is finite; every other prompt (near-constant x, NaN / inf, an
overflow) is recomputed by `icl_bench.prompts.ols.ols_predict`, whose criterion (N * eps relative, or
whatever it becomes) flags far fewer prompts than this screen hands to it.
"""
from __future__ import annotations

import torch

from icl_bench.solvers import fused
from icl_bench.prompts.ols import SHIFT_SAMPLES, ols_predict

SCREEN = 1e-2  # the kernel answers prompts with Sxx > SCREEN * sum x^2; the reference the rest
_KERNEL: list = []  # [(sums, kernel)] once compiled


def _compile():
    """The two numba functions: `sums` (the reduction, reassociated into vector lanes) and
    `kernel` (per prompt: shift, sums, moments, prediction, in program order)."""
    if _KERNEL:
        return _KERNEL[0]
    nb = fused.numba  # imported by fused.available()

    @nb.njit(fastmath={"reassoc", "contract"}, error_model="numpy", nogil=True, cache=True)
    def sums(x, y, b, cx, cy):  # sum x', sum y', sum x'^2, sum x'y' over prompt b, x' = x - cx
        F = x.dtype.type
        sx = sy = sxx = sxy = F(0.0)
        for i in range(x.shape[1]):
            a = x[b, i] - cx
            c = y[b, i] - cy
            sx += a
            sy += c
            sxx += a * a
            sxy += a * c
        return sx, sy, sxx, sxy

    @nb.njit(error_model="numpy", nogil=True, cache=True)
    def kernel(x, y, u, out, redo, k, screen, b0, b1):
        F = x.dtype.type
        N = x.shape[1]
        fn, fk = F(N), F(k)
        for b in range(b0, b1):
            cx = cy = F(0.0)
            for i in range(k):
                cx += x[b, i]
                cy += y[b, i]
            cx, cy = cx / fk, cy / fk
            sx, sy, sxx, sxy = sums(x, y, b, cx, cy)
            ox, oy = sx / fn, sy / fn  # means of x', y'
            x_bar, y_bar = cx + ox, cy + oy
            Sxx, Sxy = sxx - sx * ox, sxy - sx * oy
            scale = Sxx + fn * x_bar * x_bar  # sum x^2
            pred = y_bar + (Sxy / Sxx) * (u[b] - x_bar)
            out[b] = pred
            redo[b] = not (Sxx > F(screen) * scale) or not (abs(pred) < F(float("inf")))

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
    args = (xs, ys, us, out.numpy(), redo.numpy(), min(SHIFT_SAMPLES, N), SCREEN)
    threads = max(1, min(fused.num_threads(), B // 256))
    if threads == 1:
        kernel(*args, 0, B)
    else:
        edges = [t * B // threads for t in range(threads + 1)]
        list(fused.pool(threads).map(lambda t: kernel(*args, edges[t], edges[t + 1]), range(threads)))
    if redo.any():
        idx = redo.nonzero().squeeze(1)
        out[idx] = ols_predict(x[idx], y[idx], u[idx])
    return out
