"""Gradient descent with d regressors: explicit iterates (`gd`) and the LSA construction (`gd-lsa`).

von Oswald et al. 2023, "Transformers learn in-context by gradient descent" (ICML), Proposition 1,
is stated for d-dimensional inputs; here with an intercept as in docs/gd-lsa.md. Per prompt, with
features phi_j = (1, x_j) in R^(d+1) and parameters theta = (a, w):

    L(theta) = 1/(2M) sum_{j in keys} (theta . phi_j - y_j)^2,   theta_0 = 0,
    theta_{k+1} = theta_k + (lr/M) sum_j t_j phi_j,   t_j = y_j - theta_k . phi_j,
    and every token's residual moves by   t_i <- t_i - (lr/M) sum_j (phi_i . phi_j) t_j     (*)

(*) is one LSA head: query phi_i, key phi_j, value t_j, output -lr. The residual stream
(d_model = d + 3) holds

    s_0..s_{d-1} = x_i (never written)   s_d = t_i (y_i; 0 for the query)   s_{d+1} = 1   s_{d+2} = 0

For d = 1 this is exactly the layout and the weights of icl_bench/solvers/gd_lsa.py (x, t, 1, 0).
Weights (every layer identical, one head):
    embed (d+3, d+2):  [k, k] = 1 (x_k -> s_k), [d, d] = 1 (y -> s_d), [d+1, d+1] = 1/R (R -> 1)
    W_Q = W_K:         [0, k, k] = 1 (k < d), [0, d+1, d+1] = 1   -> q_i = k_i = phi_i (in slots)
    W_V:               [0, d, d] = 1      W_O: [0, d, d] = -lr    -> (*) in s_d
    readout (1, d+3):  [0, d] = -1        -> y_hat = -t_query = theta_K . (1, u)
Convergence: stable iff lr < 2 / lambda_max(H), H = mean phi phi^T ((d+1) x (d+1)); the slow
direction shrinks by |1 - lr lambda_min(H)| per step, so correlated x (a small lambda_min) needs
more steps (measured in results/multivariate/).
"""
from __future__ import annotations

import math

import torch

from icl_bench.errors import ConfigError
from icl_bench.prompts.generator import resolve_dtype
from icl_bench.solvers.transformer import KEY_SETS, Transformer, TransformerConfig


def _as3d(x: torch.Tensor, u: torch.Tensor):
    """x (B, N) / (B, N, d) -> (B, N, d); u (B,) / (B, d) -> (B, d)."""
    x = x[..., None] if x.ndim == 2 else x
    return x, u.reshape(x.shape[0], x.shape[2])


def key_set_mv(x: torch.Tensor, y: torch.Tensor, u: torch.Tensor, variant: str):
    """(xs (B, M, d), ys (B, M)): the context (masked, M = N), or it plus (u, 0) (M = N + 1)."""
    if variant == "masked":
        return x, y
    return torch.cat([x, u[:, None]], dim=1), torch.cat([y, torch.zeros_like(y[:, :1])], dim=1)


def gd_iterates_mv(x: torch.Tensor, y: torch.Tensor, x_query: torch.Tensor, lr: float, variant: str = "masked"):
    """Endless generator of the GD iterates (a_k, w_k), k = 1, 2, ...: a (B,), w (B, d), x's dtype.

    Args: x (B, N, d) or (B, N); y (B, N); x_query (B, d) or (B,); lr > 0, a number or a (B,)
    tensor (one step size per prompt); variant in KEY_SETS."""
    x, u = _as3d(x, x_query)
    xs, ys = key_set_mv(x, y, u, variant)  # (B, M, d), (B, M)
    a = torch.zeros_like(ys[:, 0])  # (B,)
    w = torch.zeros_like(xs[:, 0])  # (B, d)
    lr_w = lr[:, None] if torch.is_tensor(lr) else lr  # broadcast over w's d
    while True:
        r = ys - a[:, None] - torch.einsum("bmd,bd->bm", xs, w)  # (B, M) residuals
        a = a + lr * r.mean(dim=1)
        w = w + lr_w * torch.einsum("bm,bmd->bd", r, xs) / xs.shape[1]
        yield a, w


def gd_trajectory_mv(x, y, x_query, steps: int, lr: float, variant: str = "masked") -> torch.Tensor:
    """Predictions theta_k . (1, u) after steps 0..K: (K+1, B) in x's dtype (row 0 is 0).

    Args: as gd_iterates_mv (lr a number or a (B,) tensor), plus steps K >= 0.
    Raises: ConfigError on a bad steps / lr / variant."""
    _check(steps, lr, variant, min_steps=0)
    x3, u = _as3d(x, x_query)
    out = [torch.zeros_like(u[:, 0])]
    it = gd_iterates_mv(x3, y, u, lr, variant)
    for _ in range(steps):
        a, w = next(it)
        out.append(a + (w * u).sum(dim=1))
    return torch.stack(out)


def gd_trajectory_gram(x, y, x_query, steps: int, lr) -> torch.Tensor:
    """gd_trajectory_mv of the masked key set, from each prompt's Gram matrix: (K+1, B), x's dtype.

    The step of gd_iterates_mv, theta <- theta + (lr/N) sum_j (y_j - theta . phi_j) phi_j, is
    linear in theta: with H = mean_j phi_j phi_j^T ((d+1) x (d+1)) and g = mean_j y_j phi_j it is
    theta <- theta + lr (g - H theta), so a step costs (d+1)^2 multiply-adds per prompt instead of
    ~4 N (d+1). The same iterates up to rounding (the sums over the context are taken once, not
    per step; 1e-9 relative or closer where the iterates are finite): the fingerprint's
    reference, where scores below 1e-8 count as equal (icl_bench/analysis/fingerprint.py), runs
    14 maps x 25 step sizes x 128 steps on it; a test checks it against gd_trajectory_mv.

    H holds x^2: it overflows where x^2 does (|x| > ~1e19 in float32, ~1e154 in float64), and the
    iterates are then NaN where the token-level ones may stay finite (the fingerprint's prompts are
    x ~ N(0, 1) scaled by at most 10 or shifted by at most 20).

    Args: as gd_trajectory_mv, variant "masked" (the context alone; the query is not a key); x,
        y and x_query of one dtype (mixed, torch's promotion decides the result's).
    Raises: ConfigError on a bad steps / lr."""
    _check(steps, lr, "masked", min_steps=0)
    x3, u = _as3d(x, x_query)  # (B, N, d), (B, d)
    phi = torch.cat([torch.ones_like(x3[..., :1]), x3], dim=2)  # (B, N, d+1)
    H = (phi.transpose(1, 2) @ phi / x3.shape[1]).permute(1, 2, 0).contiguous()  # (d+1, d+1, B)
    g = (phi * y[..., None]).mean(dim=1).T.contiguous()  # (d+1, B)
    q = torch.cat([torch.ones_like(u[:, :1]), u], dim=1).T  # (d+1, B): the query's features
    D = range(g.shape[0])  # one (B,) vector per coordinate: ops on (B, 2, 2) ran 4-10x slower
    theta = [torch.zeros_like(g[0]) for _ in D]  # (a, w_1..w_d), each (B,)
    out = [torch.zeros_like(g[0])]
    for _ in range(steps):
        theta = [theta[i] + lr * (g[i] - sum(H[i, j] * theta[j] for j in D)) for i in D]
        out.append(sum(theta[i] * q[i] for i in D))
    return torch.stack(out)


def gd_predict_mv(x, y, x_query, steps: int, lr: float, variant: str = "masked") -> torch.Tensor:
    """theta_K . (1, u), (B,): the last row of gd_trajectory_mv (same arguments)."""
    return gd_trajectory_mv(x, y, x_query, steps, lr, variant)[-1]


def hessian_eigenvalues_mv(xs: torch.Tensor) -> torch.Tensor:
    """(B, d+1) eigenvalues, ascending, of H = mean_j phi_j phi_j^T, phi = (1, x); xs (B, M, d). float64."""
    xs = xs.double()
    phi = torch.cat([torch.ones_like(xs[..., :1]), xs], dim=2)  # (B, M, d+1)
    return torch.linalg.eigvalsh(phi.transpose(1, 2) @ phi / xs.shape[1])


def _check(steps, lr, variant, min_steps: int = 1) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < min_steps:
        raise ConfigError(f"steps: must be an integer >= {min_steps} (got {steps!r})")
    if torch.is_tensor(lr):  # one step size per prompt (gd_iterates_mv)
        if lr.ndim != 1 or not bool((torch.isfinite(lr) & (lr > 0)).all()):
            raise ConfigError("lr: a tensor of step sizes must be 1-D, finite and > 0")
    elif isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ConfigError(f"lr: must be a finite number > 0 (got {lr!r})")
    if variant not in KEY_SETS:
        raise ConfigError(f"variant: unknown value {variant!r}; accepted: {', '.join(KEY_SETS)}")


def build_gd_lsa_mv(steps: int, lr: float, R: float, d: int, variant: str = "masked", *,
                    dtype="float64", device="cpu", d_model: int | None = None) -> Transformer:
    """The K-layer, one-head, LayerNorm-free LSA transformer running K GD steps with d regressors.

    Args:
        steps: K >= 1 layers.  lr: eta > 0.  R: the tokens' constant (finite, > 0), mapped to 1.
        d: regressors >= 1.  variant: key set (KEY_SETS).  dtype, device: of the parameters.
        d_model: residual width, at least d + 2 (slots beyond d + 1 stay 0); None: d + 3.
    Returns:
        Transformer (eval, no grad): forward(tokens (B, N+1, d+2)) -> (B,) = theta_K . (1, u).
        For d = 1 this is icl_bench.solvers.gd_lsa.build_gd_construction.
    Raises:
        ConfigError: any argument out of range.
    """
    _check(steps, lr, variant)
    if isinstance(R, bool) or not isinstance(R, (int, float)) or not math.isfinite(R) or R <= 0:
        raise ConfigError(f"R: must be a finite number > 0 (got {R!r})")
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise ConfigError(f"d: must be an integer >= 1 (got {d!r})")
    d_model = d + 3 if d_model is None else d_model
    if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model < d + 2:
        raise ConfigError(f"d_model: must be an integer >= {d + 2} (got {d_model!r})")
    try:
        dt = resolve_dtype(dtype)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    cfg = TransformerConfig(d_in=d + 2, d_model=d_model, n_layers=steps, n_heads=1, layernorm=False,
                            keys=variant, readout="query")
    model = Transformer(cfg).to(device=device, dtype=dt)  # cast first: weights set in dt exactly
    with torch.no_grad():
        model.embed.weight.zero_()  # (d_model, d+2)
        for k in range(d):
            model.embed.weight[k, k] = 1.0
        model.embed.weight[d, d] = 1.0
        model.embed.weight[d + 1, d + 1] = 1.0 / R
        for block in model.blocks:
            attn = block.attn  # (1, d_model, d_model) each, zero-initialised
            for W in (attn.W_Q, attn.W_K):
                for k in range(d):
                    W[0, k, k] = 1.0
                W[0, d + 1, d + 1] = 1.0
            attn.W_V[0, d, d] = 1.0
            attn.W_O[0, d, d] = -lr
        model.readout.weight.zero_()
        model.readout.weight[0, d] = -1.0
    return model.eval().requires_grad_(False)
