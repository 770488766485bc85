"""`ols`: the batched closed-form least-squares prediction, in the batch's dtype and device.

On CPU tensors without gradients it runs the numba kernel of icl_bench/solvers/fused_ols.py (the OLS
reference's arithmetic; NaN exactly where the reference icl_bench/prompts/ols.py says so); elsewhere,
or without numba, the reference `ols_predict` itself.
"""
from __future__ import annotations

import torch

from icl_bench import PromptBatch, Solver
from icl_bench.solvers.fused_ols import fast_ols_predict
from icl_bench.solvers.multivariate import ols_mv


class OLS(Solver):
    """Batched closed-form least squares (NaN where var(x) = 0); a numba kernel on the CPU."""

    params = {}
    multivariate = True  # d > 1: QR least squares in the batch's dtype (icl_bench/prompts/ols_mv.py)

    def predict(self, batch: PromptBatch) -> torch.Tensor:
        if batch.d > 1:
            return ols_mv(batch)  # (B,)
        return fast_ols_predict(batch.x, batch.y, batch.x_query)  # (B,)
