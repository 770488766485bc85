"""`ols`: the batched closed-form least-squares prediction, in the batch's dtype and device.

On CPU tensors without gradients it runs the numba kernel of icl_bench/solvers/fused_ols.py (the OLS
reference's arithmetic; NaN exactly where the reference icl_bench/prompts/ols.py says so); elsewhere,
or without numba, the reference `ols_predict` itself.
"""
from __future__ import annotations

import torch

from icl_bench import PromptBatch, Solver
from icl_bench.solvers.fused_ols import fast_ols_predict


class OLS(Solver):
    """Batched closed-form least squares (NaN where var(x) = 0); a numba kernel on the CPU."""

    params = {}

    def predict(self, batch: PromptBatch) -> torch.Tensor:
        return fast_ols_predict(batch.x, batch.y, batch.x_query)  # (B,)
