"""Behavioural fingerprint with d >= 2 regressors: invariance under x -> A x + t.

Least squares with an intercept is equivariant under every invertible affine map of the regressors:
with x_i -> A x_i + t and u -> A u + t (A invertible, y unchanged), the fitted intercept and slope
map to a - beta^T A^-1 t and A^-T beta, so the prediction at the mapped query is *unchanged*
(Hastie, Tibshirani & Friedman, *Elements of Statistical Learning*, section 3.2: the fit depends on
X only through its column space, which [1, X] and [1, X A^T + 1 t^T] share). K-step GD from 0 is
not: its iterates depend on the Hessian mean phi phi^T, which A and t change (von Oswald et al.
2023; docs/gd-lsa.md, "Conditioning"). So a solver's errors on mapped prompts tell a closed form
from gradient descent without looking at its weights (the one-dimensional maps x -> s x + t are the
special case A = s).

Maps (MAPS; each applied to the same prompts): coordinate scalings diag(s) with s in {0.1, 10} on
one coordinate (anisotropic: changes the conditioning), a uniform scaling x 3, a rotation
(a fixed random orthogonal A, seed 0), a shear (A = I + 2 e_1 e_2^T), and shifts t = +-5 (1, ..., 1).
Score of a map: relative MSE vs OLS on the mapped prompts, mean (pred - ols)^2 / var(ols) over the
well-posed prompts (NaN / inf predictions: DIVERGED of analysis/fingerprint.py, whose thresholds and rule this module reuses).

Verdict (thresholds checked on known solvers by tests/test_fingerprint_mv.py):
    closed-form-like  every score, the identity's included, <= CLOSED_FORM_TOL;
    GD-like           else, if the profile of log10 scores (floored at FLOOR) is within GD_TOL on
                      average of K-step GD's (icl_bench/solvers/gd_mv.py, lr = GD_LR) for some K in GD_STEPS
                      (every K up to 128), with no single map more than GD_MAP_TOL decades away;
    neither           otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from icl_bench.analysis.fingerprint import CLOSED_FORM_TOL, GD_STEPS, classify, relative_mse
from icl_bench.prompts.generator import PromptBatch
from icl_bench.prompts.multivariate import make_batch_mv, n_regressors
from icl_bench.solvers.gd_lsa import DEFAULT_LR
from icl_bench.solvers.gd_mv import gd_trajectory_mv

GD_LR = DEFAULT_LR  # the gd / gd-lsa default step size (docs/gd-lsa.md)


@dataclass(frozen=True)
class AffineMap:
    """x -> A x + t on the context and the query; `kind` names A, `shift` the value of every t_k."""

    name: str
    kind: str = "identity"  # identity, scale1, scale, rotate, shear
    value: float = 1.0
    shift: float = 0.0

    def matrix(self, d: int) -> torch.Tensor:
        """A (d, d) float64, invertible."""
        A = torch.eye(d, dtype=torch.float64)
        if self.kind == "scale1":
            A[0, 0] = self.value
        elif self.kind == "scale":
            A = A * self.value
        elif self.kind == "rotate":
            g = torch.Generator().manual_seed(0)
            A, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
        elif self.kind == "shear":
            A[0, 1] = self.value
        return A

    def apply(self, batch: PromptBatch) -> PromptBatch:
        """The mapped prompts (same R and dtype; the reference recomputed on them). batch: d >= 2."""
        d = n_regressors(batch)
        A = self.matrix(d)
        x = batch.x.double().cpu() @ A.T + self.shift  # (B, N, d)
        u = batch.x_query.double().cpu() @ A.T + self.shift  # (B, d)
        return make_batch_mv(x, batch.y.double().cpu(), u, R=batch.R, dtype=batch.dtype, device=batch.device)


MAPS = (AffineMap("identity"), AffineMap("x1*0.1", "scale1", 0.1), AffineMap("x1*10", "scale1", 10.0),
        AffineMap("x*3", "scale", 3.0), AffineMap("rotate", "rotate"), AffineMap("shear", "shear", 2.0),
        AffineMap("x-5", shift=-5.0), AffineMap("x+5", shift=5.0))


def scores(predict: Callable[[PromptBatch], torch.Tensor], batch: PromptBatch, mapped=None) -> dict[str, float]:
    """Map name -> relative MSE of `predict` (a function PromptBatch -> (B,)) on the mapped prompts
    (`mapped`: the mapped batches in MAPS order, if already made)."""
    mapped = mapped or [m.apply(batch) for m in MAPS]
    return {m.name: relative_mse(predict(mb), mb) for m, mb in zip(MAPS, mapped)}


def gd_profiles(mapped) -> dict[int, dict[str, float]]:
    """K -> the scores of K-step GD (lr = GD_LR) on the mapped prompts, K in GD_STEPS (one trajectory per map)."""
    out = {K: {} for K in GD_STEPS}
    for m, mb in zip(MAPS, mapped):
        traj = gd_trajectory_mv(mb.x, mb.y, mb.x_query, max(GD_STEPS), GD_LR)  # (K_max + 1, B)
        for K in GD_STEPS:
            out[K][m.name] = relative_mse(traj[K], mb)
    return out


def fingerprint_mv(predict: Callable[[PromptBatch], torch.Tensor], batch: PromptBatch) -> dict:
    """Scores and verdict for a solver on prompts with d >= 2 regressors.

    Args:
        predict: PromptBatch -> (B,) predictions (e.g. a solver's bound `predict`).
        batch: prompts with x (B, N, d), d >= 2 (icl_bench.prompts.multivariate.sample_prompts_mv).
    Returns:
        {"scores": {map: score}, "verdict": "closed-form-like" | "GD-like" | "neither",
         "gd_steps": the best-matching K (GD-like only, else None), "gd_distance": its distance}.
    Raises:
        ValueError: a batch with d = 1 (use the one-dimensional fingerprint), or one with fewer
            than 2 well-posed prompts (fingerprint.relative_mse_rows).
    """
    if n_regressors(batch) < 2:
        raise ValueError("d: fingerprint_mv needs prompts with d >= 2 regressors")
    mapped = [m.apply(batch) for m in MAPS]
    s = scores(predict, batch, mapped)
    if max(s.values()) <= CLOSED_FORM_TOL:
        return {"scores": s, "verdict": "closed-form-like", "gd_steps": None, "gd_distance": None}
    fp = classify(s, gd_profiles(mapped))  # the one-dimensional fingerprint's rule and thresholds
    return {"scores": s, "verdict": fp.verdict, "gd_steps": fp.gd_steps if fp.verdict == "GD-like" else None,
            "gd_distance": fp.gd_distance}
