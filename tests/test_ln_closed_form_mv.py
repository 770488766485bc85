"""The LayerNorm Modified Gram-Schmidt construction for d regressors against the float64 OLS reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from icl_bench.errors import ConfigError
from icl_bench.solvers.ln_closed_form import build_construction
from icl_bench.solvers.ln_closed_form_mv import build_ln_construction_mv, ln_closed_form_mv_predict, slots
from icl_bench.prompts.generator import PromptSpec, sample_prompts
from icl_bench.prompts.multivariate import sample_prompts_mv

RS = (100.0, 1e3, 1e4)


def mse(d, R, *, B=400, seed=0, x_corr=0.0, dtype="float64", N=100, **kw) -> float:
    b = sample_prompts_mv(PromptSpec(N=N, noise=0.1, R=R), B, d=d, x_corr=x_corr, seed=seed, dtype=dtype)
    pred = ln_closed_form_mv_predict(b.x, b.y, b.x_query, R, **kw)
    return float(((pred.double() - b.ols_prediction) ** 2).mean())


@pytest.mark.parametrize("d", [2, 3])
def test_acceptance_iid_float64(d):
    """float64, N = 100, x iid N(0, I): MSE vs OLS <= 1e-9 at R = 1e3; exponent in R within -4 +- 0.2."""
    m = [mse(d, R) for R in RS]
    assert m[1] <= 1e-9
    slope = np.polyfit(np.log(RS), np.log(m), 1)[0]
    assert -4.2 <= slope <= -3.8, (slope, m)


@pytest.mark.parametrize("d,rho", [(2, 0.9), (3, 18 / 21)])  # equicorrelated x, condition number 19
def test_acceptance_correlated_within_2x_of_iid(d, rho):
    """Pooled over seeds 0-3 x 4000 prompts (the MSE is heavy-tailed: a few far queries dominate it,
    and one seed's ratio ranges 0.9-2.1 at 8000 prompts, docs/ln-closed-form-multivariate.md), the
    correlated MSE is within 2x of the iid MSE on the same underlying draws; the median within 1.5x."""
    errs = {0.0: [], rho: []}
    for seed in range(4):
        for r in errs:
            b = sample_prompts_mv(PromptSpec(N=100, noise=0.1, R=1e3), 4000, d=d, x_corr=r, seed=seed, dtype="float64")
            errs[r].append((ln_closed_form_mv_predict(b.x, b.y, b.x_query, 1e3) - b.ols_prediction) ** 2)
    iid, cor = torch.cat(errs[0.0]), torch.cat(errs[rho])
    ratio, med = float(cor.mean() / iid.mean()), float(cor.median() / iid.median())
    assert 0.5 <= ratio <= 2.0, ratio
    assert 1 / 1.5 <= med <= 1.5, med


def test_structure_and_three_forward_paths_agree():
    for d in (1, 2, 4):
        model = build_ln_construction_mv(100.0, d)
        cfg = model.cfg
        assert (cfg.d_model, cfg.d_in, cfg.n_layers, cfg.n_heads) == (d + 3, d + 2, d + 1, 2)
        b = sample_prompts_mv(PromptSpec(N=20, R=100.0), 50, d=d, seed=d, dtype="float64")
        fast, ref, quad = model(b.tokens), model._run(b.tokens, False, False)[0], model.forward_quadratic(b.tokens)
        assert (fast - ref).abs().max() <= 1e-12 and (fast - quad).abs().max() <= 1e-12
        assert slots(d)["y"] == d + 2 and slots(d)["R"] == 0


def test_residual_stream_holds_the_gram_schmidt_residuals():
    """After layer 1 + k the context tokens' slots hold the MGS residual columns (to O(1/R^2))."""
    R, d = 1e4, 3
    b = sample_prompts_mv(PromptSpec(N=30, noise=0.1, R=R), 20, d=d, seed=5, dtype="float64")
    trace = build_ln_construction_mv(R, d).probe(b.tokens)
    X = torch.cat([b.x, b.y[..., None]], dim=2)  # (B, N, d+1) columns x_1..x_d, y
    X = X - X.mean(dim=1, keepdim=True)  # layer 1: centring
    s = slots(d)
    cols = [s[f"x{k}"] for k in range(1, d + 1)] + [s["y"]]
    assert (trace["layer0.resid"][:, :-1, cols] - X).abs().max() < 1e-6
    for k in range(d):  # one MGS step per layer
        p = X[:, :, k:k + 1]
        X = X.clone()
        X[:, :, k + 1:] -= p * (p * X[:, :, k + 1:]).sum(1, keepdim=True) / (p * p).sum(1, keepdim=True)
        assert (trace[f"layer{k + 1}.resid"][:, :-1, cols] - X).abs().max() < 1e-6, k
    assert (trace["layer0.resid"][..., s["R"]] == R).all() and (trace[f"layer{d}.resid"][..., s["Z"]] == 0).all()


def test_amplify_buys_accuracy_without_a_larger_R():
    m1, m6 = mse(2, 100.0), mse(2, 100.0, amplify=1e6)
    assert m1 > 1e-8 and m6 < 1e-26
    assert abs(mse(2, 100.0, amplify=10.0) / mse(2, 1e3) - 1) < 0.05  # the error depends on c R only


def test_float32_slot_ordered_layernorm_mean_and_its_control():
    """float32: with the big pair in slots 0, 1 summed first the error does not grow with R; the
    "big-pair" balance (mean rounded at eps R) is the known negative and does grow."""
    good = [mse(2, R, dtype="float32", B=300) for R in (1e3, 1e5)]
    bad = [mse(2, R, dtype="float32", B=300, balance="big-pair") for R in (1e3, 1e5)]
    assert good[1] < 1e-12 and good[1] < 3 * good[0] + 1e-13
    assert bad[1] > 1e3 * good[1] and bad[1] > 10 * bad[0]


def test_query_in_context_variant_and_limits():
    b = sample_prompts_mv(PromptSpec(N=1000, noise=0.1, R=1e3), 300, d=2, seed=0, dtype="float64")
    q = ln_closed_form_mv_predict(b.x, b.y, b.x_query, 1e3, variant="query-in-context")
    err = float(((q - b.ols_prediction) ** 2).mean())
    assert 1e-8 < err < 1e-3  # an O(1/N) bias, not O(1/R^2)
    with pytest.raises(ConfigError, match="^d:"):
        build_ln_construction_mv(10.0, 0)
    with pytest.raises(ConfigError, match="^amplify:"):
        build_ln_construction_mv(10.0, 2, amplify=0.0)
    with pytest.raises(ConfigError, match="^balance:"):
        build_ln_construction_mv(10.0, 2, balance="x")


def test_default_transformer_numerics_unchanged_for_d1():
    """The shared module's default LayerNorm sum order is torch's: the 1-D construction is untouched."""
    model = build_construction(100.0)
    assert model.cfg.ln_sum == "torch" and model.cfg.d_model == 4
    b = sample_prompts(PromptSpec(N=50, R=100.0), 200, seed=0, dtype="float32")
    a = model.to(torch.float32)(b.tokens)
    hT = b.tokens  # recompute with torch's own reduction written out, as before the option existed
    W = model.embed.weight
    h = torch.bmm(W.expand(hT.shape[0], -1, -1).contiguous(), hT.transpose(1, 2))
    for i, blk in enumerate(model.blocks):
        maps = blk.attn.folded_map()
        last = i == len(model.blocks) - 1
        out = blk.attn.forward_channels(h, maps, last)
        base = h[:, :, -1:] if last else h
        c = out - out.sum(dim=1, keepdim=True) / 4
        inv = torch.rsqrt(c.square().sum(dim=1, keepdim=True) / 4 + blk.ln.eps)
        h = torch.addcmul(base + blk.ln.bias[:, None], c * blk.ln.weight[:, None], inv)
    assert torch.equal(a, model.readout(h[:, :, -1]).squeeze(-1))
