"""`scipy-lstsq`: per-prompt scipy.linalg.lstsq on the design [1, x], the faithful reference.

Deliberately slow (a Python loop over prompts); it exists to check the batched solvers.
"""
from __future__ import annotations

import numpy as np
import scipy.linalg
import torch

from icl_bench import PromptBatch, Solver
from icl_bench.solvers.multivariate import scipy_lstsq_mv


class ScipyLstsq(Solver):
    """Per-prompt scipy.linalg.lstsq on [1, x] (slow on purpose: the faithful reference)."""

    params = {}

    multivariate = True  # d > 1: lstsq on [1, X] per prompt, NaN where the reference is (solvers/multivariate.py)

    def predict(self, batch: PromptBatch) -> torch.Tensor:
        if batch.d > 1:
            return scipy_lstsq_mv(batch)
        x = batch.x.detach().cpu().double().numpy()  # (B, N)
        y = batch.y.detach().cpu().double().numpy()  # (B, N)
        u = batch.x_query.detach().cpu().double().numpy()  # (B,)
        out = np.full(x.shape[0], np.nan)
        for i in range(x.shape[0]):
            if not (np.isfinite(x[i]).all() and np.isfinite(y[i]).all() and np.isfinite(u[i])):
                continue
            design = np.column_stack([np.ones_like(x[i]), x[i]])  # (N, 2)
            coef, _, rank, _ = scipy.linalg.lstsq(design, y[i])
            if rank == 2:  # rank 1 <=> all x equal: no unique slope
                out[i] = coef[0] + coef[1] * u[i]
        pred = torch.from_numpy(out).to(device=batch.device, dtype=batch.dtype)  # (B,)
        return pred.masked_fill(~torch.isfinite(pred), float("nan"))  # an overflow is no answer: NaN, not inf
