"""The screens of a fused solver call, applied in one numba pass over the kernel's extremes.

After the fused kernel (icl_bench/solvers/fused.py) a transformer solver turns its answers into
NaN where the prompt has no answer: `icl_bench.solvers.base.screens` (ill-posed prompts, and
prompts whose R is lost in rounding) from each prompt's (x_min, x_max, y_min, y_max), which the
kernel read on its way (icl_bench/solvers/fused_extremes.py), plus, in `nan_if_ill_posed`, a
non-finite OLS reference or an infinite answer. In torch that is about a dozen elementwise ops
on (B,) tensors, each paying a fixed cost and a pass (0.4 ms per call of 10485 prompts, ~40 ns
per prompt, against 0.09 ms here; docs/throughput.md, "The screens applied in one pass"). Same
tests, same answers: comparisons and t - t only, in the tokens' dtype, R rounded to that dtype
as torch rounds a Python scalar in a comparison.
"""
from __future__ import annotations

import numpy as np
import torch

from icl_bench.solvers import fused

_KERNEL: list = []  # [kernel] once compiled


def _compile():
    """The numba loop, compiled in memory once per process (about a second per dtype),
    never cached on disk: a run writes no files besides its own."""
    if _KERNEL:
        return _KERNEL[0]

    @fused.numba.njit(error_model="numpy", nogil=True)
    def kernel(pred, ext, u, R, eps, use_r, ols, use_ols, inf_is_nan, out):
        F = pred.dtype.type
        for b in range(pred.shape[0]):
            xlo, xhi, ylo, yhi, q = ext[b, 0], ext[b, 1], ext[b, 2], ext[b, 3], u[b]
            finite = (xlo - xlo == 0) & (xhi - xhi == 0) & (ylo - ylo == 0) & (yhi - yhi == 0) & (q - q == 0)
            bad = (not finite) or xlo == xhi  # base.ill_posed_context, and a non-finite query
            if use_r and not bad:  # base.screens with R: max |x|, |y|, |u| times eps reaches R
                big = max(max(xhi, -xlo), max(yhi, -ylo))
                bad = max(big, abs(q)) * eps >= R
            if use_ols:
                bad = bad or not (ols[b] - ols[b] == 0)
            p = pred[b]
            if inf_is_nan:
                bad = bad or not (p - p == 0)  # inf (and NaN, which stays NaN)
            out[b] = F(np.nan) if bad else p

    _KERNEL.append(kernel)
    return kernel


def apply_screens(pred: torch.Tensor, extremes: torch.Tensor, u: torch.Tensor, R: float | None = None,
                  ols: torch.Tensor | None = None, inf_is_nan: bool = False) -> torch.Tensor | None:
    """`pred` with NaN where the prompt is screened out, in one pass; None where this path does
    not apply (numba missing or the fused path disabled, a tensor not on the CPU or of another
    dtype; the caller then runs the torch screens).

    Args:
        pred: (B,) float32 / float64 answers, CPU.
        extremes: (B, 4) per-prompt (x_min, x_max, y_min, y_max) in pred's dtype (NaN where a
            context value is not finite), as `Transformer.forward_extremes` returns them.
        u: (B,) queries in pred's dtype.
        R: the embedding constant; given, prompts with `max(|x|, |y|, |u|) * eps >= R` (eps of
            the dtype) are screened too (base.screens with R, i.e. `r_lost`); None: not.
        ols: optional (B,) float64 OLS reference; where it is not finite the prompt is screened.
        inf_is_nan: also screen answers that are +-inf.
    Returns:
        A new (B,) tensor in pred's dtype: NaN exactly where `base.screens(*extremes.unbind(1), u,
        R)`, `~isfinite(ols)` or (inf_is_nan) `isinf(pred)` is True, pred elsewhere.
    Raises:
        ValueError: shapes that do not fit pred (B,): extremes not (B, 4), u or ols not (B,).
    """
    B = pred.shape[0] if pred.ndim == 1 else -1
    for name, t, shape in (("pred", pred, (B,)), ("extremes", extremes, (B, 4)), ("u", u, (B,)),
                           ("ols", ols, (B,))):
        if t is not None and tuple(t.shape) != shape:
            want = "1-D" if name == "pred" else str(shape)
            raise ValueError(f"apply_screens: {name} must be {want}, got shape {tuple(t.shape)}")
    dtype = pred.dtype
    if not fused.available() or dtype not in (torch.float32, torch.float64):
        return None
    if any(t.device.type != "cpu" for t in (pred, extremes, u)) or extremes.dtype != dtype or u.dtype != dtype:
        return None
    if ols is not None and (ols.device.type != "cpu" or ols.dtype != torch.float64):
        return None
    kernel = _compile()
    F = np.float32 if dtype == torch.float32 else np.float64
    out = torch.empty_like(pred)  # (B,)
    o = ols.detach().contiguous().numpy() if ols is not None else np.zeros(1)
    with np.errstate(over="ignore"):  # an R beyond float32's range rounds to inf, as in torch: no prompt trips
        r = F(R if R is not None else 0.0)
    kernel(pred.detach().contiguous().numpy(), extremes.detach().contiguous().numpy(), u.detach().contiguous().numpy(),
           r, F(torch.finfo(dtype).eps), R is not None, o, ols is not None, inf_is_nan, out.numpy())
    return out


__all__ = ["apply_screens"]
