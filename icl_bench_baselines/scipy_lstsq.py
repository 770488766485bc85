"""`scipy-lstsq`: per-prompt scipy.linalg.lstsq on the design [1, x], the faithful reference.

Deliberately slow (a Python loop over prompts); it exists to check the batched solvers.

Ill-posed prompts (all x exactly equal, a NaN / inf: `icl_bench.prompts.ols.ill_posed`, the criterion
every least-squares solver shares) and prompts whose float64 reference is not finite (an answer
beyond float64) are NaN without calling lstsq: its numerical rank of [1, x]
is 2 for a constant x that is not a power of two (the column x is not an exact multiple of the
ones column after rounding), and the fit it then returns is noise (-7e14 on x = 1.1 * 100 values).
Before lstsq each prompt is shifted by its mean and x, y are scaled by powers of two (exact), the
centred x once more to a largest |value| in [1/2, 1), so the design is well conditioned and nothing
underflows at any data scale (docs/accuracy.md): without that last scaling, x a few ulps apart
(1 and 1 + 2^-52) left a centred column of 1e-16 beside the ones, which lstsq's cutoff called rank 1.
y is shifted by one of its own values, so a constant y fits a slope of exactly 0.
OLS is equivariant under these maps, so the answer is the same.
"""
from __future__ import annotations

import numpy as np
import scipy.linalg
import torch

from icl_bench import PromptBatch, Solver
from icl_bench.prompts.ols import SHIFT_SAMPLES, ill_posed
from icl_bench.solvers.multivariate import scipy_lstsq_mv


class ScipyLstsq(Solver):
    """Per-prompt scipy.linalg.lstsq on [1, x] (slow on purpose: the faithful reference)."""

    params = {}

    multivariate = True  # d > 1: lstsq on [1, X], scaled and centred per column, NaN where the reference is (solvers/multivariate.py)

    def predict(self, batch: PromptBatch) -> torch.Tensor:
        if batch.d > 1:
            return scipy_lstsq_mv(batch)
        x = batch.x.detach().cpu().double().numpy()  # (B, N)
        y = batch.y.detach().cpu().double().numpy()  # (B, N)
        u = batch.x_query.detach().cpu().double().numpy()  # (B,)
        bad = (ill_posed(batch.x, batch.y, batch.x_query) | ~torch.isfinite(batch.ols_prediction)).cpu().numpy()  # (B,)
        out = np.full(x.shape[0], np.nan)
        for i in np.flatnonzero(~bad):
            kx, ky = np.frexp(np.abs(x[i]).max())[1], np.frexp(np.abs(y[i]).max())[1]
            with np.errstate(over="ignore"):  # u far beyond tiny data: inf, answered below as intercept + slope u
                xs, ys, us = np.ldexp(x[i], -kx), np.ldexp(y[i], -ky), np.ldexp(u[i], -kx)  # exact scaling
            c = xs.mean()
            xc = xs - c  # (N,) centred
            cy = np.sort(ys[:SHIFT_SAMPLES])[(min(len(ys), SHIFT_SAMPLES) - 1) // 2]  # a value of y (the reference's lower median):
            ys = ys - cy  # exact for a constant y, whose slope is then exactly 0 (not 1e-17 times a far query)
            kc = np.frexp(np.abs(xc).max())[1]  # the centred column scaled to max |.| in [1/2, 1): x a few
            design = np.column_stack([np.ones_like(xs), np.ldexp(xc, -kc)])  # ulps apart is rank 2 too; (N, 2)
            coef, _, rank, _ = scipy.linalg.lstsq(design, ys)
            if rank == 2:  # the centred, scaled design of a non-constant x has full rank
                with np.errstate(over="ignore", invalid="ignore"):  # an answer beyond float64: inf, made NaN below
                    out[i] = np.ldexp(cy + coef[0] + coef[1] * np.ldexp(us - c, -kc), ky)
                    if not np.isfinite(out[i]):  # the scaled query overflowed: the fit in unscaled units
                        out[i] = np.ldexp(cy + coef[0] - coef[1] * np.ldexp(c, -kc), ky) + np.ldexp(coef[1], ky - kx - kc) * u[i]
        pred = torch.from_numpy(out).to(device=batch.device, dtype=batch.dtype)  # (B,)
        return pred.masked_fill(~torch.isfinite(pred), float("nan"))  # an overflow is no answer: NaN, not inf
