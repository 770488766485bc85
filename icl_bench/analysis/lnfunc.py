"""Functional LayerNorm tests: does a model's LayerNorm divide, and which one (docs/analysis.md,
section "Functional LayerNorm tests"; docs/design.md §9).

Weights can implement one function in many ways, so these tests look at what the LayerNorms
*do* on prompts, not at the weights:

    ln{i}.slope, ln{i}.r2   regress log(std of LayerNorm i's input at the query token) on log Cxx
                            (Cxx = the context's variance of x) over prompts. The construction
                            (icl_bench.solvers.ln_closed_form): slope 0 in layer 1 (std R/sqrt2), slope
                            1.000 with R^2 1.000 in layer 2 (std R Cxx/sqrt2): layer 2 divides by Cxx.
    ln{i}.r2_raw            R^2 of the same log std on log of the raw second moment mean(x^2). On
                            these prompts (x ~ N(0, 1), N = 20) log Cxx and log mean(x^2) correlate
                            at ~0.97, so slope and R^2 alone cannot tell a division by the centred
                            variance from one by the raw moment (regression through the origin):
                            the construction has r2 1.000 > r2_raw 0.946; the construction with
                            layer 1's centring switched off (its LN gain 0) r2 0.946 < r2_raw 1.000.
    ln{i}.freeze            relative MSE vs OLS after replacing LayerNorm i's std, at every token,
                            by its median over prompts (per token position): how much the model
                            relies on that division. The construction at N = 20, x ~ N(0, 1):
                            layer 1 ~ 2e-7, layer 2 ~ 0.06. The tests below use its increase over
                            rel_mse (freeze - rel_mse): an inaccurate model whose output ignores
                            the LayerNorm has freeze = rel_mse, which is no reliance at all.
    effective_R             |embedding column of the constant| * R / max(|column of x|, |column of y|):
                            how much the constant dominates the stream (the construction: R).

State (the thresholds are the success criterion of docs/mechanism.md; `state` names the first
that holds):
    layer-2 division          ln1 (layer 2): |slope - 1| <= 0.05, R^2 >= 0.9, R^2 > r2_raw,
                              freeze - rel_mse >= 0.03
    layer-1 division          ln0 (layer 1): the same tests on ln0
                              (a division by Cxx makes the std grow as Cxx^1: a slope of 1.3 is
                              another function of Cxx, however well it fits)
    layer-1 scale normaliser  ln0: |slope - 0.5| <= 0.15 with R^2 >= 0.5 (std ~ sqrt(Cxx)), and
                              layer 2 not dividing (a stuck state seen in training)
    neither                   otherwise (also: a model without LayerNorm)
The construction is the known positive of "layer-2 division"; no model, built or trained, is yet
known to reach "layer-1 division" or "layer-1 scale normaliser" (their tests are checked on numbers
only, tests/test_lnfunc.py), so those two states are unvalidated names.
The division probe of icl_bench.analysis.probes (b_hat (u - x_bar) decodable at the last LayerNorm) is
passed by every accurate model whatever it does, so it is not a mechanism test.
"""
from __future__ import annotations

import math

import torch

from icl_bench.prompts.generator import PromptSpec, sample_prompts
from icl_bench.solvers.transformer import Transformer

SLOPE_MIN, SLOPE_MAX, R2_MIN, FREEZE_MIN = 0.95, 1.05, 0.9, 0.03  # "divides" (the construction: 1.000, 1.000, 0.06)
NORMALISER_SLOPE, NORMALISER_TOL, NORMALISER_R2 = 0.5, 0.15, 0.5  # std ~ sqrt(Cxx) in layer 1
ANY_ACCURATE_MODEL = ("probe.division",)  # probes every accurate model passes (not mechanism tests)


@torch.no_grad()
def run_with_ln_std(model: Transformer, tokens: torch.Tensor, frozen: dict[int, torch.Tensor] | None = None):
    """The model's forward pass with LayerNorm written out, optionally with fixed stds.

    Args:
        model: a Transformer; tokens (B, T, 3) in the model's dtype.
        frozen: {layer i: (T,) std per token position} to use instead of layer i's own std.
    Returns:
        (pred (B,), stds {i: (B, T) the std each LayerNorm divided by, sqrt(var + eps)}).
    """
    frozen = frozen or {}
    h = model.embed(tokens)  # (B, T, d)
    stds = {}
    for i, block in enumerate(model.blocks):
        a = block.attn(h)  # (B, T, d)
        if block.ln is None:
            h = h + a
            continue
        c = a - a.mean(-1, keepdim=True)
        std = torch.sqrt(c.pow(2).mean(-1) + block.ln.eps)  # (B, T)
        stds[i] = std
        use = frozen[i].to(std).expand_as(std) if i in frozen else std
        h = h + c / use[..., None] * block.ln.weight + block.ln.bias
    feats = h.flatten(1) if model.cfg.readout == "flatten" else h[:, -1]
    return model.readout(feats).squeeze(-1), stds


def _fit(xs: torch.Tensor, ys: torch.Tensor) -> tuple[float, float]:
    """slope and R^2 of ys ~ xs (float64, finite rows only); NaN when xs or ys is constant."""
    ok = torch.isfinite(xs) & torch.isfinite(ys)
    x, y = xs[ok] - xs[ok].mean(), ys[ok] - ys[ok].mean()
    sxx, syy = float((x * x).sum()), float((y * y).sum())
    if sxx <= 0 or syy <= 1e-24 * len(y):
        return (0.0 if sxx > 0 else math.nan), math.nan
    slope = float((x * y).sum()) / sxx
    return slope, slope * slope * sxx / syy


def _rel_mse(pred: torch.Tensor, ols: torch.Tensor) -> float:
    err = (pred.double() - ols) ** 2
    return float(err.mean() / ols.var()) if bool(torch.isfinite(err).all()) else math.inf


def effective_R(model: Transformer, R: float) -> float:
    """|W_e[:, 2]| R / max(|W_e[:, 0]|, |W_e[:, 1]|) (column norms of the (d, 3) embedding)."""
    W = model.embed.weight.detach().double()
    top = float(torch.maximum(W[:, 0].norm(), W[:, 1].norm()))
    return float(W[:, 2].norm()) * R / top if top > 0 else math.inf


@torch.no_grad()
def ln_functional(model: Transformer, R: float, *, N: int | None = None, n_prompts: int = 4096,
                  noise: float = 0.1, seed: int = 0) -> dict:
    """Every number of the module docstring for `model` at embedding constant R.

    Args:
        model: a Transformer (analysed in a float64 copy; not modified).
        R: the prompts' constant; N: context length (default: the flatten readout's N, else 20).
        n_prompts, noise, seed: the analysis prompts (x, slope, intercept ~ N(0, 1)).
    Returns:
        {"rel_mse", "ln{i}.slope", "ln{i}.r2", "ln{i}.r2_raw", "ln{i}.freeze" per LayerNorm i (0-based: ln0 is
        layer 1), "effective_R", "state", "has_layernorm"}; the ln entries are absent when
        the model has no LayerNorm.
    """
    import copy

    m = copy.deepcopy(model).to(dtype=torch.float64, device="cpu").eval()
    N = N or (m.cfg.N if m.cfg.readout == "flatten" else 20)
    batch = sample_prompts(PromptSpec(N=N, noise=float(noise), R=float(R)), n_prompts, seed=seed, dtype="float64")
    ols = batch.ols_prediction  # (B,)
    log_cxx = torch.log(batch.x.var(1, unbiased=False))  # (B,)
    log_m2 = torch.log(batch.x.pow(2).mean(1))  # (B,) the raw (uncentred) second moment
    pred, stds = run_with_ln_std(m, batch.tokens)
    out = {"rel_mse": _rel_mse(pred, ols), "effective_R": effective_R(m, float(R)), "has_layernorm": bool(stds)}
    for i, std in stds.items():
        out[f"ln{i}.slope"], out[f"ln{i}.r2"] = _fit(log_cxx, torch.log(std[:, -1]))
        out[f"ln{i}.r2_raw"] = _fit(log_m2, torch.log(std[:, -1]))[1]
        frozen_pred, _ = run_with_ln_std(m, batch.tokens, {i: std.median(0).values})
        out[f"ln{i}.freeze"] = _rel_mse(frozen_pred, ols)
    out["state"] = state(out)
    return out


def _divides(r: dict, i: int) -> bool:
    """LayerNorm i divides by the centred variance Cxx (the thresholds of the module docstring)."""
    s, r2, f = r.get(f"ln{i}.slope", math.nan), r.get(f"ln{i}.r2", math.nan), r.get(f"ln{i}.freeze", math.nan)
    raw = r.get(f"ln{i}.r2_raw", math.nan)  # NaN (a constant std) never beats r2
    # the error freezing ADDS: an inaccurate model whose output ignores this LayerNorm (its gain 0, a
    # readout that skips its slot) had freeze = rel_mse >= FREEZE_MIN and read "divides" (a review)
    grew = f - r.get("rel_mse", math.nan)  # NaN (a model answering NaN or inf) is no evidence
    return SLOPE_MIN <= s <= SLOPE_MAX and r2 >= R2_MIN and not raw >= r2 and grew >= FREEZE_MIN


def state(r: dict) -> str:
    """The state name of the module docstring from ln_functional's numbers."""
    if not r.get("has_layernorm", True):
        return "neither"
    last = max((int(k[2:].split(".")[0]) for k in r if k.startswith("ln") and k.endswith(".slope")), default=-1)
    if last >= 1 and _divides(r, last):
        return "layer-2 division" if last == 1 else f"layer-{last + 1} division"
    if _divides(r, 0):
        return "layer-1 division"
    s0, r2 = r.get("ln0.slope", math.nan), r.get("ln0.r2", math.nan)
    if abs(s0 - NORMALISER_SLOPE) <= NORMALISER_TOL and r2 >= NORMALISER_R2:
        return "layer-1 scale normaliser"
    return "neither"
