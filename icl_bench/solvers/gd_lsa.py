"""`gd-lsa`: a linear self-attention transformer whose K layers run K steps of gradient descent.

Reference: von Oswald et al. 2023, "Transformers learn in-context by gradient descent" (ICML),
Proposition 1 (one LSA layer = one GD step on the in-context squared loss); here extended with an
intercept as in docs/design.md §6. Derivation and the learning-rate sweep: docs/gd-lsa.md.

Per prompt, with features phi_j = (1, x_j) and parameters w = (a, b), GD on

    L(w) = 1/(2M) sum_{j in keys} (w . phi_j - y_j)^2,    w_0 = 0,
    w_{k+1} = w_k + (lr/M) sum_{j in keys} t_j phi_j,      t_j = y_j - w_k . phi_j.

The construction keeps the residual t_j of every token in the stream, never w itself. A step
changes every token's residual by the same bilinear form:

    t_i <- t_i - (lr/M) sum_{j in keys} (phi_i . phi_j) t_j                       (*)

which is exactly one LSA head with query phi_i, key phi_j, value t_j and output -lr. The query
token starts at t = 0 = 0 - w_0 . phi_u, so after K layers it holds -w_K . phi_u = -y_hat_K.

Residual stream (d_model slots; the shared module's d_model = 4, slot 3 unused and left at 0):

    s0 = x_i (never written)   s1 = t_i (y_i at the start; 0 for the query)   s2 = 1   s3 = 0

Weights (every layer identical; one head; shapes as in icl_bench/transformer.py):

    embed.weight  (d_model, 3):  [0,0] = 1 (x -> s0), [1,1] = 1 (y -> s1), [2,2] = 1/R (R -> 1)
    W_Q, W_K      (1, d, d):     [0,0,0] = 1, [0,2,2] = 1    -> q_i = k_i = (x_i, 0, 1, 0) = phi_i
    W_V           (1, d, d):     [0,1,1] = 1                 -> v_j = t_j e_1
    W_O           (1, d, d):     [0,1,1] = -lr               -> writes (*) into s1
    readout       (1, d):        [0,1] = -1                  -> y_hat = -s1 at the query token

Key sets (`variant`): "masked" = the N context tokens (M = N), plain GD on the context.
"query-in-context" = all N+1 tokens (M = N+1): the query token's residual t_q = 0 - w . phi_u
enters the sum, i.e. GD on the context plus the extra example (u, 0). The `gd` baseline runs
the same two key sets (icl_bench_baselines/gd.py), and the two agree to ~1e-15 in float64 (tests).
"""
from __future__ import annotations

from functools import partial

import torch

from icl_bench.prompts.generator import PromptBatch, resolve_dtype
from icl_bench.solvers.registry import register_solver
from icl_bench.solvers.base import Param, Solver, nan_if_ill_posed
from icl_bench.solvers.gd_mv import build_gd_lsa_mv
from icl_bench.solvers.transformer import KEY_SETS, Transformer

DEFAULT_STEPS = 16  # K: MSE vs OLS ~ 1e-4 at N = 30 with the default lr (results/gd_lr_sweep.md)
MAX_STEPS = 4096  # K above this would build a 4096-layer model: refused as a config error
DEFAULT_LR = 0.4  # eta: chosen by benchmarks/experiments/gd_lr_sweep.py (criterion in docs/gd-lsa.md)
DEFAULT_R = 100.0  # R used by weights() before any batch is seen (PromptSpec's default)


def build_gd_construction(steps: int, lr: float, R: float, variant: str = "masked", *,
                          dtype="float64", device="cpu", d_model: int = 4) -> Transformer:
    """The K-layer, one-head, LayerNorm-free LSA transformer that runs K GD steps.

    Args:
        steps: K >= 1, the number of layers (= GD steps).
        lr: the GD step size eta (finite, > 0); GD diverges on a prompt where eta * lambda_max >= 2.
        R: the constant in the token's third slot (finite, > 0); the embedding maps it to 1.
        variant: the key set, "masked" (context, M = N) or "query-in-context" (M = N + 1).
        dtype: "float32" / "float64" or the torch dtype; device: torch device.
        d_model: residual width >= 3 (slots beyond s2 stay 0); 4 matches the shared module.
    Returns:
        A Transformer (eval mode, no grad needed) with readout="query": forward(tokens (B, N+1, 3))
        -> (B,) predictions = w_K . (1, u). Weights as in the module docstring.
    Raises:
        ConfigError: any argument out of range (message names the field and accepted values).
    """
    return build_gd_lsa_mv(steps, lr, R, 1, variant, dtype=dtype, device=device, d_model=d_model)


@register_solver("gd-lsa")
class GDLSA(Solver):
    """K-layer linear self-attention (no LayerNorm) constructed to run K gradient-descent steps."""

    params = {
        "steps": Param(DEFAULT_STEPS, "K, the number of LSA layers = GD steps", min=1, max=MAX_STEPS),
        "lr": Param(DEFAULT_LR, "eta, the GD step size written in W_O (stable while eta < 2 / lambda_max)", gt=0.0),
        "variant": Param("masked", "key set: masked = context only; query-in-context = also the query token",
                         choices=KEY_SETS),
    }

    multivariate = True  # d > 1: d_model = d + 3 (icl_bench/solvers/gd_mv.py, build_gd_lsa_mv)

    def __init__(self, **values):
        super().__init__(**values)  # Param checks: steps in [1, MAX_STEPS], lr finite and > 0, variant
        self._models: dict[tuple, Transformer] = {}  # (R, dtype, device, d) -> construction
        self._last_R, self._last_d = DEFAULT_R, 1

    def model(self, R: float, dtype="float64", device="cpu", d: int = 1) -> Transformer:
        """The construction for embedding constant R and d regressors, cached per (R, dtype, device, d)."""
        key = (float(R), resolve_dtype(dtype), str(torch.device(device)), d)
        if key not in self._models:
            v = self.values
            build = build_gd_construction if d == 1 else partial(build_gd_lsa_mv, d=d)
            self._models[key] = build(v["steps"], v["lr"], float(R), variant=v["variant"], dtype=key[1], device=key[2])
        return self._models[key]

    def predict(self, batch: PromptBatch) -> torch.Tensor:
        """(B,) predictions w_K . (1, u) in batch.dtype on batch.device; NaN stays in its own prompt,
        and an ill-posed prompt (var(x) = 0, NaN / inf) gets NaN (see nan_if_ill_posed)."""
        self._last_R, self._last_d = batch.R, batch.d
        with torch.no_grad():
            model = self.model(batch.R, batch.dtype, batch.device, batch.d)
            pred, extremes = model.forward_extremes(batch.tokens)  # (B,), (B, 4) or None
        return nan_if_ill_posed(pred, batch, extremes=extremes)

    def weights(self) -> dict[str, torch.Tensor]:
        """The construction's weight matrices (float64) for the R of the last batch predicted
        (R = 100 before any): embed.weight, blocks.{k}.attn.W_{Q,K,V,O}, readout.weight."""
        return self.model(self._last_R, d=self._last_d).weight_matrices()

    def probe(self, batch: PromptBatch) -> dict[str, torch.Tensor]:
        """The residual stream per layer (see Transformer.probe): "layer{k}.resid"[:, :, 1] holds
        the residuals t after k+1 GD steps; at the query token it is -y_hat_{k+1}."""
        return self.model(batch.R, batch.dtype, batch.device, batch.d).probe(batch.tokens)
