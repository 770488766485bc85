"""`ols`: the batched closed-form least-squares prediction, in the batch's dtype and device."""
from __future__ import annotations

import torch

from icl_bench import PromptBatch, Solver
from icl_bench.prompts.ols import ols_predict
from icl_bench.solvers.multivariate import ols_mv


class OLS(Solver):
    """Batched closed-form least squares in torch (NaN where var(x) = 0)."""

    params = {}
    multivariate = True  # d > 1: QR least squares in the batch's dtype (icl_bench/prompts/ols_mv.py)

    def predict(self, batch: PromptBatch) -> torch.Tensor:
        if batch.d > 1:
            return ols_mv(batch)  # (B,)
        return ols_predict(batch.x, batch.y, batch.x_query)  # (B,)
