"""`ln-closed-form` for d regressors: Modified Gram-Schmidt with LayerNorm as the divider.

Least squares with d regressors and an intercept is Modified Gram-Schmidt (MGS) on the columns
(1, x_1, ..., x_d, y): project out the constant (centring), then each regressor in turn from the
columns after it; what is left of y at the query is -(the OLS prediction) (Golub & Van Loan,
*Matrix Computations*, 4th ed., section 5.2.8, MGS for least squares; Bjorck 1967). One MGS step
on the current residual columns r is

    r_m <- r_m - (S_km / S_kk) r_k   for every column m after k,   S_km = mean_j r_kj r_mj,

products and means (linear self-attention) and one division by the pivot S_kk, which LayerNorm
does: the block's LN input is dominated by a known pair +-R S_kk, so LN's standard deviation is
that pivot times a constant. Layer 1 centres every column (pivot R, the constant), layer 1 + k
eliminates regressor k. The derivation, the error terms and the measured tables are in
docs/ln-closed-form-multivariate.md; the one-dimensional construction (a different, 2-layer
layout) is icl_bench/solvers/ln_closed_form.py and docs/ln-closed-form.md.

Residual slots (D = d_model = d + 3), in this order so that LayerNorm's sum over slots meets the
big pair first (see `build_ln_construction_mv`, float32):

    s_R = 0: R (never changes)   s_Z = 1: 0 (never changes)   s_x(k) = 1 + k: x_k (k = 1..d)   s_y = d + 2: y
"""
from __future__ import annotations

import math

import torch

from icl_bench.errors import ConfigError
from icl_bench.prompts.multivariate import make_tokens_mv
from icl_bench.solvers.transformer import KEY_SETS, Transformer, TransformerConfig

BALANCES = ("written", "big-pair")  # where the term that makes the LN input's mean 0 goes (docs)


def slots(d: int) -> dict[str, int]:
    """Slot indices of the residual stream: {"R": 0, "Z": 1, "x1": 2, ..., "xd": d + 1, "y": d + 2}."""
    return {"R": 0, "Z": 1, **{f"x{k}": 1 + k for k in range(1, d + 1)}, "y": d + 2}


def _check(R, d, variant, balance, amplify=1.0) -> float:
    if isinstance(amplify, bool) or not isinstance(amplify, (int, float)) or not math.isfinite(amplify) or amplify <= 0:
        raise ConfigError(f"amplify: must be a finite number > 0 (got {amplify!r})")
    if isinstance(R, bool) or not isinstance(R, (int, float)) or not math.isfinite(R) or R <= 0:
        raise ConfigError(f"R: must be a finite number > 0 (got {R!r})")
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise ConfigError(f"d: must be an integer >= 1 (got {d!r})")
    if variant not in KEY_SETS:
        raise ConfigError(f"variant: unknown value {variant!r}; accepted: {', '.join(KEY_SETS)}")
    if balance not in BALANCES:
        raise ConfigError(f"balance: unknown value {balance!r}; accepted: {', '.join(BALANCES)}")
    return float(R)


@torch.no_grad()
def build_ln_construction_mv(R: float, d: int, variant: str = "masked", *, balance: str = "written",
                             amplify: float = 1.0, dtype: torch.dtype = torch.float64, device="cpu",
                             ln_eps: float = 1e-5, ln_sum: str = "slots") -> Transformer:
    """The (d + 1)-layer, 2-head, d_model = d + 3 LayerNorm transformer that computes OLS with d regressors.

    Tokens (d_in = d + 2): (x_1, ..., x_d, y, R), the query (u_1, ..., u_d, 0, R). W[h][out, in] of head
    h acts as v -> W v; every weight not listed is 0, every LN bias is 0. D = d + 3, g = R sqrt(2/D).

    embed (D, d + 2): x_k -> s_x(k), y -> s_y, R -> s_R.
    layer 1 (centring; head 0 only):
        W_Q[s_R, s_R] = W_K[s_R, s_R] = 1/R: every score is 1, the head returns W_O W_V (key mean)
            = W_O W_V (R, 0, x_bar_1, ..., x_bar_d, y_bar).
        W_O = I. W_V[s_R, s_R] = c, W_V[s_Z, s_R] = -c (the big pair +cR, -cR), and for the written
            slots w, w' in {s_x(1..d), s_y} (n = d + 1 of them):
            "written":  W_V[w, w'] = -(delta_ww' + 1/2)   -> a_w = -mean_w - (1/2) sum_w' mean_w'
            "big-pair": W_V[w, w'] = -delta_ww'; W_V[s_R, w'] = W_V[s_Z, w'] = 1/2
        Either way the attention output sums to LN's mean exactly so LN's centring returns -mean_w in
        every written slot; LN's std is c R sqrt(2/D) (1 + O(mean^2 / (cR)^2)); LN gain g on the written
        slots, 0 on s_R, s_Z. After the skip: context (R, 0, x~, y~), query (R, 0, u - x_bar, -y_bar).
    layer 1 + k (k = 1..d; eliminate regressor k; p = s_x(k), W_k = {s_x(k+1..d), s_y}, n = d - k + 1):
        head 0: W_Q[p, p] = W_K[p, p] = 1 (score r_pi r_pj); W_V[w, w] = 1 (w in W_k)
            -> head value r_pi S_pw for each w, S_pw = mean_j r_pj r_wj.
            "written":  W_O[w, w'] = -(delta_ww' + 1/(k + 2))   (w, w' in W_k)
            "big-pair": W_O[w, w'] = -delta_ww'; W_O[s_R, w'] = W_O[s_Z, w'] = 1/2
        head 1: W_Q[p, s_R] = c (query reads R), W_K[p, p] = W_V[p, p] = 1 -> c R S_pp;
            W_O[s_R, p] = 1, W_O[s_Z, p] = -1: the big pair (+c R S_pp, -c R S_pp).
        LN: mean removes the balancing term exactly; std = c R S_pp sqrt(2/D) (1 + O((r_p S_pw / (c R S_pp))^2));
            gain g on W_k, 0 elsewhere -> slot w += -r_p S_pw / S_pp (one MGS step, every remaining column).
    readout ("query", D -> 1): -1 on s_y: y_hat = -(query's y slot) = y_bar + (u - x_bar) . beta_hat.

    "written" (the default) keeps the big pair exactly +-R S_pp, so when LayerNorm sums the slots in
    order (s_R, s_Z first, as the channels-first forward does) the pair cancels without rounding and
    float32 error stops growing with R; "big-pair" adds the balance to the pair (the layout first
    tried; its mean carries a rounding of size eps * R). Measured in docs/ln-closed-form-multivariate.md.

    Args:
        R: the tokens' embedding constant (finite, > 0).  d: number of regressors >= 1.
        variant: key set, "masked" (the N context tokens; error O(1/R^2)) or "query-in-context" (O(1/N)).
        balance: one of BALANCES.  amplify: c > 0 (above).  dtype, device: of the parameters.  ln_eps: LayerNorm epsilon.
        ln_sum: LayerNorm's sum order in forward ("slots", the default here; "torch" = torch's own
            reduction, which does not meet the pair first for every shape: the float32 control).
    Returns:
        Transformer (eval mode): forward(tokens (B, N+1, d+2)) -> (B,) approximate OLS predictions.
    Raises:
        ConfigError: R, d, variant or balance out of range.
    """
    R = _check(R, d, variant, balance, amplify)
    c = float(amplify)
    D = d + 3
    s = slots(d)
    sR, sZ, sy = s["R"], s["Z"], s["y"]
    sx = [s[f"x{k}"] for k in range(1, d + 1)]
    cfg = TransformerConfig(d_in=d + 2, d_model=D, n_layers=d + 1, n_heads=2, layernorm=True, keys=variant,
                            readout="query", ln_eps=ln_eps, ln_sum=ln_sum)
    model = Transformer(cfg).double()  # weights set in float64, rounded once to dtype at the end
    for prm in model.parameters():
        prm.zero_()
    g = c * R * math.sqrt(2.0 / D)
    for k in range(d):
        model.embed.weight[sx[k], k] = 1.0
    model.embed.weight[sy, d] = 1.0
    model.embed.weight[sR, d + 1] = 1.0

    a1, ln1 = model.blocks[0].attn, model.blocks[0].ln  # layer 1: centring
    a1.W_Q[0, sR, sR] = a1.W_K[0, sR, sR] = 1.0 / R
    a1.W_O[0] = torch.eye(D, dtype=torch.float64)
    a1.W_V[0, sR, sR], a1.W_V[0, sZ, sR] = c, -c
    written = sx + [sy]
    for w in written:
        for w2 in written:
            a1.W_V[0, w, w2] = -(float(w == w2) + (0.5 if balance == "written" else 0.0))
        if balance == "big-pair":
            a1.W_V[0, sR, w] = a1.W_V[0, sZ, w] = 0.5
    ln1.weight[written] = g

    for k in range(1, d + 1):  # layer 1 + k: eliminate regressor k
        attn, ln = model.blocks[k].attn, model.blocks[k].ln
        p = sx[k - 1]
        rest = sx[k:] + [sy]  # W_k
        attn.W_Q[0, p, p] = attn.W_K[0, p, p] = 1.0  # head 0: scores r_pi r_pj
        for w in rest:
            attn.W_V[0, w, w] = 1.0
            for w2 in rest:
                attn.W_O[0, w, w2] = -(float(w == w2) + (1.0 / (k + 2) if balance == "written" else 0.0))
            if balance == "big-pair":
                attn.W_O[0, sR, w] = attn.W_O[0, sZ, w] = 0.5
        attn.W_Q[1, p, sR] = c  # head 1: query reads R
        attn.W_K[1, p, p] = attn.W_V[1, p, p] = 1.0  # -> R S_pp
        attn.W_O[1, sR, p], attn.W_O[1, sZ, p] = 1.0, -1.0  # the big pair
        ln.weight[rest] = g

    model.readout.weight[0, sy] = -1.0
    return model.to(dtype=dtype, device=device).eval()


@torch.no_grad()
def ln_closed_form_mv_predict(x: torch.Tensor, y: torch.Tensor, x_query: torch.Tensor, R: float,
                              variant: str = "masked", balance: str = "written", amplify: float = 1.0,
                              ln_eps: float = 1e-5, ln_sum: str = "slots") -> torch.Tensor:
    """Run the construction on raw arrays: x (B, N, d), y (B, N), x_query (B, d) -> (B,) in x's dtype.

    The tokens are built with icl_bench.prompts.multivariate.make_tokens_mv (row i = (x_i, y_i, R)). No NaN
    rule is applied here (the solver applies the reference's). Raises ConfigError as the builder."""
    d = 1 if x.ndim == 2 else x.shape[2]
    model = build_ln_construction_mv(R, d, variant, balance=balance, amplify=amplify, dtype=x.dtype, device=x.device,
                                     ln_eps=ln_eps, ln_sum=ln_sum)
    return model(make_tokens_mv(x, y, x_query, R))
