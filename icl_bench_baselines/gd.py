"""`gd`: K explicit gradient-descent steps on the prompt's least-squares loss, batched in torch.

This is the ground truth for the `gd-lsa` construction (icl_bench/solvers/gd_lsa.py), which must produce
the same iterates with K linear self-attention (LSA) layers (von Oswald et al. 2023,
"Transformers learn in-context by gradient descent", section 2, eq. 1-2; the intercept is
handled as in docs/gd-lsa.md).

Model and loss, per prompt, over a key set of M examples (x_j, y_j):

    w = (a, b),   phi_j = (1, x_j),   L(w) = 1/(2M) sum_j (w . phi_j - y_j)^2
    w_0 = (0, 0),   w_{k+1} = w_k - lr * grad L(w_k) = w_k + (lr/M) sum_j r_j phi_j,
    r_j = y_j - w_k . phi_j   (the residual),     prediction y_hat_K(u) = w_K . (1, u)

Key sets (`variant`), identical to the transformer's:
    "masked":            the N context examples, M = N  (plain GD on the context).
    "query-in-context":  the context plus the query as an extra example (u, 0), M = N + 1: the
                         query's label is the 0 written in its token, so GD also pulls the fit
                         towards 0 at u. This is what an LSA layer whose keys include the query
                         token computes; it is *not* GD on the context, and its error vs OLS
                         carries an O(1/N) bias that does not vanish as K grows.

Convergence: GD on L is stable iff 0 < lr < 2 / lambda_max(H), H = [[1, x_bar], [x_bar, mean x^2]]
(the Hessian), and its speed is set by lambda_min(H) * lr; a large |x_bar| makes H
ill-conditioned (see docs/gd-lsa.md, section "Conditioning").
"""
from __future__ import annotations

import math

import torch

from icl_bench import Param, PromptBatch, Solver
from icl_bench.errors import ConfigError
from icl_bench.solvers.base import nan_if_ill_posed
from icl_bench.solvers.multivariate import gd_mv

VARIANTS = ("masked", "query-in-context")
# Defaults, stated here (not imported from gd-lsa, the construction this baseline checks); gd-lsa
# uses the same values so that `gd` and `gd-lsa` at their defaults are comparable (a test checks).
DEFAULT_STEPS = 16  # K
DEFAULT_LR = 0.4  # eta: the committed step-size sweep (results/gd_lr_sweep.md, docs/gd-lsa.md)
MAX_STEPS = 4096  # K above this is refused as a config error


def check_gd_params(steps, lr, variant, where: str) -> None:
    """Raise ConfigError (one line, naming `where`.field and the accepted values) on bad values."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigError(f"{where}.steps: must be an integer >= 0 (got {steps!r})")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ConfigError(f"{where}.lr: must be a finite number > 0 (got {lr!r})")
    if variant not in VARIANTS:
        raise ConfigError(f"{where}.variant: unknown value {variant!r}; accepted: {', '.join(VARIANTS)}")


def key_set(x: torch.Tensor, y: torch.Tensor, x_query: torch.Tensor, variant: str):
    """The examples GD fits: (x, y) itself (masked) or with (u, 0) appended (query-in-context).

    Args: x, y (B, N); x_query (B,). Returns: xs, ys of shape (B, M), M = N or N + 1.
    """
    if variant == "masked":
        return x, y
    return torch.cat([x, x_query[:, None]], dim=1), torch.cat([y, torch.zeros_like(x_query)[:, None]], dim=1)


def gd_iterates(x: torch.Tensor, y: torch.Tensor, x_query: torch.Tensor, lr: float, variant: str = "masked"):
    """Generator of the GD iterates (a_k, b_k), k = 1, 2, ... (endless; the caller stops it).

    Args: x, y (B, N); x_query (B,) (used only by the query-in-context key set); lr > 0;
    variant in VARIANTS. Yields: (a, b), each (B,) in x's dtype, after each step.
    """
    xs, ys = key_set(x, y, x_query, variant)  # (B, M)
    a = torch.zeros_like(x_query)  # (B,) intercept, w_0 = 0
    b = torch.zeros_like(x_query)  # (B,) slope
    while True:
        r = ys - a[:, None] - b[:, None] * xs  # (B, M) residuals y_j - w . phi_j
        a = a + lr * r.mean(dim=1)  # phi_j[0] = 1
        b = b + lr * (r * xs).mean(dim=1)  # phi_j[1] = x_j
        yield a, b


def gd_trajectory(x: torch.Tensor, y: torch.Tensor, x_query: torch.Tensor, steps: int, lr: float,
                  variant: str = "masked") -> torch.Tensor:
    """Predictions at the query after every GD step 0..K, computed explicitly.

    Args:
        x, y: (B, N) context, one floating dtype and device.
        x_query: (B,) query inputs u.
        steps: K >= 0; lr: the step size eta > 0; variant: one of VARIANTS (the key set).
    Returns:
        (K+1, B) tensor in x's dtype: row k = w_k . (1, u); row 0 is 0. A prompt with NaN/inf
        in its x, y or u gives NaN/inf in its own column only; a prompt with var(x) = 0 gives
        the finite GD iterate (GD from 0 stays in the span of (1, x), so at u = x it tends to y_bar).
    Raises:
        ConfigError: bad steps / lr / variant.
    """
    check_gd_params(steps, lr, variant, "solvers.gd")
    out = [torch.zeros_like(x_query)]  # w_0 . (1, u) = 0
    it = gd_iterates(x, y, x_query, lr, variant)
    for _ in range(steps):
        a, b = next(it)
        out.append(a + b * x_query)
    return torch.stack(out)  # (K+1, B)


def gd_predict(x, y, x_query, steps: int, lr: float, variant: str = "masked") -> torch.Tensor:
    """The K-step GD prediction w_K . (1, u), (B,); see gd_trajectory (same arguments)."""
    return gd_trajectory(x, y, x_query, steps, lr, variant)[-1]


class GD(Solver):
    """K explicit gradient-descent steps on the prompt's squared loss from (a, b) = (0, 0)."""

    params = {
        "steps": Param(DEFAULT_STEPS, "K, the number of GD steps", min=1, max=MAX_STEPS),
        "lr": Param(DEFAULT_LR, "eta, the GD step size (stable while eta < 2 / lambda_max)", gt=0.0),
        "variant": Param("masked", "key set: masked = context only; query-in-context = also (u, 0)",
                         choices=VARIANTS),
    }

    CHUNK_ELEMENTS = 1 << 16  # CPU: prompts per gd_predict call = this // N (keeps the residuals in cache)
    multivariate = True  # d > 1: phi = (1, x) in R^(d+1) (icl_bench/solvers/gd_mv.py)

    def predict(self, batch: PromptBatch) -> torch.Tensor:
        """(B,) w_K . (1, u). On the CPU the prompts go through in cache-sized chunks (each
        prompt's arithmetic is the same; the (chunk, N) residuals of every step stay in cache)."""
        v = self.values
        if batch.d > 1:
            return gd_mv(batch, v["steps"], v["lr"], v["variant"])
        step = max(batch.B, 1) if batch.device.type != "cpu" else max(1, self.CHUNK_ELEMENTS // batch.N)
        parts = [gd_predict(c.x, c.y, c.x_query, v["steps"], v["lr"], v["variant"])
                 for c in (batch.slice(i, i + step) for i in range(0, max(batch.B, 1), step))]  # B = 0: one empty chunk
        pred = parts[0] if len(parts) == 1 else torch.cat(parts)  # (B,)
        return nan_if_ill_posed(pred, batch)  # var(x) = 0: the GD iterate is finite but no answer
