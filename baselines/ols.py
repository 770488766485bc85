"""`ols`: the batched closed-form least-squares prediction, in the batch's dtype and device."""
from __future__ import annotations

import torch

from icl_bench import PromptBatch, Solver
from icl_bench.prompts.ols import ols_predict


class OLS(Solver):
    """Batched closed-form least squares in torch (NaN where var(x) = 0)."""

    params = {}

    def predict(self, batch: PromptBatch) -> torch.Tensor:
        return ols_predict(batch.x, batch.y, batch.x_query)  # (B,)
