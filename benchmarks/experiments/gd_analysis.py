"""Conditioning and convergence helpers for the GD experiments (gd_conditioning.py, gd_lr_sweep.py).

They measure the explicit GD baseline (icl_bench_baselines/gd.py, `gd_iterates` / `gd_trajectory`), which
gd-lsa reproduces layer by layer (docs/gd-lsa.md; von Oswald et al. 2023, eq. 1-2). GD on the
prompt's loss L(a, b) = 1/(2M) sum_j (a + b x_j - y_j)^2 has the Hessian
H = [[1, mean x], [mean x, mean x^2]]; it is stable iff lr * lambda_max(H) < 2, and the error along
the slow direction shrinks by |1 - lr * lambda_min(H)| per step (docs/gd-lsa.md, "Conditioning").
"""
from __future__ import annotations

import math

import torch

from icl_bench_baselines.gd import check_gd_params, gd_iterates, gd_trajectory
from icl_bench import PromptBatch


def _check(max_steps: int, lr: float, variant: str) -> None:
    """Raise ConfigError (a ValueError) on a bad step count, step size or key set (the baseline's check)."""
    check_gd_params(max_steps, lr, variant, where="gd_analysis")


def hessian_eigenvalues(xs: torch.Tensor) -> torch.Tensor:
    """Eigenvalues of the GD Hessian H = [[1, mean x], [mean x, mean x^2]] of each prompt.

    Args: xs (B, M), the key set's inputs. Returns: (B, 2) = (lambda_min, lambda_max), float64
    (closed form of a symmetric 2x2 eigenproblem: half the trace -/+ half the eigenvalue gap).
    """
    xs = xs.double()
    m1, m2 = xs.mean(dim=1), (xs * xs).mean(dim=1)  # (B,)
    mid = (1.0 + m2) / 2  # (B,) half the trace
    rad = torch.sqrt(((m2 - 1.0) / 2) ** 2 + m1 * m1)  # (B,) half the eigenvalue gap
    return torch.stack([mid - rad, mid + rad], dim=1)


def mse_by_step(batch: PromptBatch, steps: int, lr: float, variant: str = "masked") -> torch.Tensor:
    """MSE vs the OLS prediction after GD steps 0..K, (K+1,) float64, over prompts with finite OLS."""
    _check(steps, lr, variant)
    ok = torch.isfinite(batch.ols_prediction)  # (B,)
    traj = gd_trajectory(batch.x, batch.y, batch.x_query, steps, lr, variant).double()  # (K+1, B)
    return ((traj[:, ok] - batch.ols_prediction[ok]) ** 2).mean(dim=1)


def steps_to_reach(batch: PromptBatch, lr: float, target: float = 1e-3, max_steps: int = 10_000,
                   variant: str = "masked", blowup: float = 1e6) -> int | None:
    """The first K with MSE vs OLS <= target (over prompts with finite OLS), or None.

    Stops early: returns None once the MSE is non-finite or above `blowup` times its value at
    K = 0 (GD diverges: lr * lambda_max >= 2 on some prompt), or after `max_steps` steps.
    Computed in float64 whatever the batch dtype. Cost: O(K * B * N); iterates are not stored.
    Raises: ValueError on a bad max_steps, lr or variant.
    """
    _check(max_steps, lr, variant)
    ok = torch.isfinite(batch.ols_prediction)  # (B,)
    ref, u = batch.ols_prediction[ok].double(), batch.x_query[ok].double()  # (B',)
    mse0 = float((ref ** 2).mean())  # w_0 = 0 predicts 0
    if mse0 <= target:
        return 0
    it = gd_iterates(batch.x[ok].double(), batch.y[ok].double(), u, lr, variant)
    for k in range(1, max_steps + 1):
        a, b = next(it)  # (B',) each
        mse = float(((a + b * u - ref) ** 2).mean())
        if mse <= target:
            return k
        if not math.isfinite(mse) or mse > blowup * mse0:
            return None
    return None


def best_steps_to_reach(batch: PromptBatch, etas, target: float = 1e-3, max_steps: int = 10_000,
                        variant: str = "masked") -> tuple[float | None, int | None]:
    """(eta, K): the eta in `etas` that reaches MSE vs OLS <= target in the fewest steps, and
    that K; (None, None) if none does within max_steps. Each later eta is cut off at the best K
    so far, so a scan costs about the best K times the number of etas that beat it."""
    best_eta, best_k = None, None
    for eta in etas:
        k = steps_to_reach(batch, eta, target, max_steps if best_k is None else best_k - 1, variant)
        if k is not None:
            best_eta, best_k = eta, k
            if k == 0:
                break
    return best_eta, best_k
