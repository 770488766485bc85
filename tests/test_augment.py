"""Affine augmentation leaves the OLS target unchanged; the proximal l1 step makes exact zeros."""
import numpy as np
import pytest
import torch

from icl_bench.training.augment import (ProxL1, affine_augment, exact_zero_fraction, prox_l1, prox_params, ramp_factor,
                                        training_batch, training_tokens, y_augment)
from icl_bench.errors import ConfigError
from icl_bench.prompts.ols import ols_predict
from icl_bench.prompts.generator import PromptSpec, sample_prompts
from icl_bench.solvers import fused
from icl_bench.training.config import TrainConfig
from icl_bench.training.train import init_model, train
from tests.transformer_models import random_model


def test_augmentation_keeps_ols_and_changes_x():
    b = sample_prompts(PromptSpec(N=20, R=100.0, noise=0.1), 64, seed=0, dtype="float64")
    tok = affine_augment(b.tokens, scale=10.0, shift=5.0, r=1.0, seed=1)
    x, y, u = tok[:, :-1, 0], tok[:, :-1, 1], tok[:, -1, 0]
    torch.testing.assert_close(ols_predict(x, y, u), b.ols_prediction, rtol=1e-8, atol=1e-8)
    assert torch.equal(tok[..., 1:], b.tokens[..., 1:]) and not torch.allclose(tok[..., 0], b.tokens[..., 0])
    s = (tok[:, 1, 0] - tok[:, 0, 0]) / (b.tokens[:, 1, 0] - b.tokens[:, 0, 0])  # per-prompt scale
    assert s.min() >= 0.1 - 1e-9 and s.max() <= 10 + 1e-9 and s.max() / s.min() > 10
    assert torch.equal(affine_augment(b.tokens, scale=10.0, shift=5.0, r=0.0, seed=1), b.tokens)


def test_affine_draws_span_both_signs_of_the_shift_and_the_scale():
    """t ~ U[-r T, r T] and s = exp(U[-r ln S, r ln S]): symmetric about 0 and 1. Only the scale's
    range was tested; a shift drawn from [0, r T] (x moved one way only) passed (a mutation review)."""
    from icl_bench.training.augment import affine_draws

    s, t = affine_draws(100_000, scale=4.0, shift=2.0, r=0.5, seed=0)
    assert -1.0 <= t.min() < -0.99 and 0.99 < t.max() <= 1.0 and abs(float(t.mean())) < 0.01
    assert 0.5 <= s.min() < 0.51 and 1.98 < s.max() <= 2.0 and abs(float(s.log().mean())) < 0.01


def test_ramp():
    assert ramp_factor(0, 300, 1 / 3) == 0 and ramp_factor(50, 300, 1 / 3) == pytest.approx(0.5)
    assert ramp_factor(200, 300, 1 / 3) == 1 and ramp_factor(1, 300, 0.0) == 1


def test_y_augmentation_maps_the_ols_target_with_y():
    b = sample_prompts(PromptSpec(N=20, R=100.0, noise=0.1), 64, seed=0, dtype="float64")
    tok, target = y_augment(b.tokens, b.ols_prediction, scale=10.0, shift=5.0, r=1.0, seed=3)
    x, y, u = tok[:, :-1, 0], tok[:, :-1, 1], tok[:, -1, 0]
    torch.testing.assert_close(ols_predict(x, y, u), target, rtol=1e-8, atol=1e-8)
    assert torch.equal(tok[:, -1], b.tokens[:, -1]) and torch.equal(tok[..., [0, 2]], b.tokens[..., [0, 2]])
    c = (tok[:, 1, 1] - tok[:, 0, 1]) / (b.tokens[:, 1, 1] - b.tokens[:, 0, 1])  # per-prompt y scale
    assert c.min() >= 0.1 - 1e-9 and c.max() <= 10 + 1e-9 and c.max() / c.min() > 10
    assert (target - b.ols_prediction).abs().max() > 1.0


def test_training_batch_leaves_x_draws_alone_and_is_off_by_default():
    b = sample_prompts(PromptSpec(N=10, R=100.0, noise=0.1), 32, seed=1, dtype="float32")
    base = dict(R=100.0, N=[10], steps=30, aug_scale=10.0, aug_shift=5.0, aug_ramp=0.3, progress=False)
    tok_x, tgt_x = training_batch(TrainConfig(**base), b.tokens, b.ols_prediction, step=5)
    tok_xy, tgt_xy = training_batch(TrainConfig(**base, aug_y_scale=10.0, aug_y_shift=5.0), b.tokens, b.ols_prediction, step=5)
    assert tgt_x is b.ols_prediction and torch.equal(tok_xy[..., 0], tok_x[..., 0])
    assert not torch.equal(tok_xy[..., 1], tok_x[..., 1]) and not torch.equal(tgt_xy, tgt_x)


def test_the_proximal_step_acts_on_the_embedding_every_attention_matrix_and_the_readout():
    """docs/training.md: the l1 penalty covers the embedding, the attention matrices and the
    readout; only the overall zero fraction was tested, which the other matrices meet without the
    readout (a mutation review)."""
    model = init_model(TrainConfig(R=10.0, N=[12], steps=10, progress=False))
    want = [model.embed.weight, model.readout.weight] + [p for n, p in model.named_parameters() if ".attn." in n]
    got = prox_params(model)
    assert len(got) == len(want) and {id(p) for p in got} == {id(p) for p in want}
    assert not any(".ln." in n for n, p in model.named_parameters() if any(p is q for q in got))  # LayerNorm is not


def test_prox_soft_threshold():
    w = torch.tensor([-0.3, -0.05, 0.0, 0.04, 0.5])
    prox_l1([w], 0.1)
    torch.testing.assert_close(w, torch.tensor([-0.2, 0.0, 0.0, 0.0, 0.4]))


def test_strong_prox_zeroes_weights_and_off_zeroes_none():
    cfg = dict(R=10.0, N=[12], steps=200, batch_size=64, eval_every=100, eval_prompts=256, lr=1e-2, progress=False,
               aug_scale=3.0, aug_shift=1.0, aug_ramp=0.3)
    calls = fused.calls
    dense, _ = train(TrainConfig(**cfg))
    sparse, hist = train(TrainConfig(**cfg, l1_prox=0.9, l1_start=0.5))
    assert fused.calls == calls  # evaluation runs the eager forward: no kernel per new zero pattern
    assert exact_zero_fraction(dense) == 0.0
    assert exact_zero_fraction(sparse) > 0.3 and torch.isfinite(torch.tensor(hist[-1]["eval_mse_vs_ols"]))


@pytest.mark.parametrize("bad", [{"aug_scale": 0.5}, {"aug_shift": -1.0}, {"aug_ramp": 1.0}, {"l1_prox": -0.1},
                                 {"l1_start": 1.0}, {"aug_scale": True}, {"l1_prox": float("nan")}, {"l1_stop": 0.0}, {"aug_y_scale": 0.9}, {"aug_y_shift": -1.0},
                                 {"aug_y_scale": 1e300}, {"aug_shift": 1e39}, {"aug_scale": 2e6}, {"l1_stop": 0.8},
                                 {"l1_stop": 0.55, "l1_prox": 0.2, "l1_start": 0.5, "steps": 5},
                                 {"l1_stop": 1.5}, {"l1_stop": 0.5, "l1_start": 0.5}])
def test_bad_fields(bad):
    with pytest.raises(ConfigError, match=f"train.{next(iter(bad))}"):
        TrainConfig.from_dict(bad)
    if bad == {"l1_stop": 0.5, "l1_start": 0.5}:
        with pytest.raises(ConfigError, match="above l1_start"):
            TrainConfig.from_dict(bad)
    if bad == {"l1_stop": 0.8}:  # without proximal l1 there is nothing to stop
        with pytest.raises(ConfigError, match="needs l1_prox > 0"):
            TrainConfig.from_dict(bad)
    if "steps" in bad:  # (2.5, 2.75] holds no step
        with pytest.raises(ConfigError, match="holds no step"):
            TrainConfig.from_dict(bad)


def test_a_window_without_a_step_warns_under_a_steps_override():
    """`icl-bench train --steps K` copies a validated config with another step budget; when the
    l1 window then holds no step, training says so instead of silently skipping l1."""
    cfg = TrainConfig(R=10.0, N=[8], steps=40, batch_size=16, eval_every=40, eval_prompts=32, l1_prox=0.2,
                      l1_start=0.5, l1_stop=0.8, progress=False).model_copy(update={"steps": 1, "eval_every": 1})
    with pytest.warns(UserWarning, match="proximal l1 never acts"):
        train(cfg)


def test_masked_fine_tuning_keeps_the_zeros_of_the_stop_and_frees_the_rest():
    """ProxL1 with l1_stop: soft thresholding up to step l1_stop * steps, then the zeros of that
    step are re-zeroed after every step while the other weights move without shrinking."""
    cfg = TrainConfig(R=10.0, N=[12], steps=10, l1_prox=0.5, l1_start=0.2, l1_stop=0.6, progress=False)
    model = init_model(cfg)
    prox, params = ProxL1(model, cfg), prox_params(model)
    g = torch.Generator().manual_seed(0)
    nudge = lambda: [p.data.add_(0.05 * torch.randn(p.shape, generator=g)) for p in params]  # noqa: E731  an "Adam step"
    for step in (1, 2):  # before l1_start: nothing
        before = [p.detach().clone() for p in params]
        prox(step, lr=0.1)
        assert all(torch.equal(a, p) for a, p in zip(before, params))
    for step in (3, 4, 5, 6):  # thresholding by lr * l1_prox = 0.05
        nudge()
        before = [p.detach().clone() for p in params]
        prox(step, lr=0.1)
        for a, p in zip(before, params):
            torch.testing.assert_close(p.detach(), torch.sign(a) * torch.clamp(a.abs() - 0.05, min=0.0))
    zeros = [p.detach() == 0 for p in params]
    assert sum(int(z.sum()) for z in zeros) > 0
    for step in (7, 8, 9, 10):  # masked fine-tuning: the zeros of the stop stay, the rest is free
        nudge()
        before = [p.detach().clone() for p in params]
        prox(step, lr=0.1)
        for a, p, z in zip(before, params, zeros):
            assert torch.equal(p.detach()[z], torch.zeros_like(p.detach()[z]))
            assert torch.equal(p.detach()[~z], a[~z])  # not shrunk
    assert prox.masks is not None and all(torch.equal(m, z) for m, z in zip(prox.masks, zeros))


def _prompts(B=256, N=10, seed=1):
    from icl_bench import PromptSpec, sample_prompts

    return sample_prompts(PromptSpec(N=N, R=100.0, noise=0.1), B, seed=seed, dtype="float64")


def _x_map(before: torch.Tensor, after: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-prompt (s, t) of x -> s x + t, read off two x values of each prompt."""
    s = (after[:, 1] - after[:, 0]) / (before[:, 1] - before[:, 0])
    return s, after[:, 0] - s * before[:, 0]


@pytest.mark.parametrize("scale, shift", [(1.0, 3.0), (10.0, 0.0)])
def test_a_shift_alone_or_a_scale_alone_augments_x(scale, shift):
    """TrainConfig's aug_scale = 1 and aug_shift = 0 each mean "off" for their own part only: a
    shift-only (or scale-only) recipe still maps x and u. An `or` for the `and` in the check for
    "no augmentation" skipped both (a mutation review)."""
    b = _prompts()
    cfg = TrainConfig(R=100.0, N=[10], steps=100, aug_scale=scale, aug_shift=shift, progress=False)
    out = training_tokens(cfg, b.tokens, step=7)
    x0, x1 = b.tokens[..., 0], out[..., 0]  # (B, N+1): the query row maps with the context
    s, t = _x_map(x0, x1)
    torch.testing.assert_close(x1, s[:, None] * x0 + t[:, None], rtol=1e-12, atol=1e-12)
    if shift:
        assert torch.allclose(s, torch.ones_like(s)) and t.abs().max() <= shift and t.abs().max() > 0.5 * shift
    else:
        assert torch.allclose(t, torch.zeros_like(t), atol=1e-12) and s.max() / s.min() > 10


@pytest.mark.parametrize("scale, shift", [(1.0, 3.0), (10.0, 0.0)])
def test_a_y_shift_alone_or_a_y_scale_alone_augments_y_and_the_target(scale, shift):
    b = _prompts()
    cfg = TrainConfig(R=100.0, N=[10], steps=100, aug_y_scale=scale, aug_y_shift=shift, progress=False)
    tok, target = training_batch(cfg, b.tokens, b.ols_prediction, step=7)
    assert torch.equal(tok[..., 0], b.tokens[..., 0])  # x untouched
    torch.testing.assert_close(ols_predict(tok[:, :-1, 0], tok[:, :-1, 1], tok[:, -1, 0]), target, rtol=1e-9, atol=1e-9)
    c, d = _x_map(b.tokens[:, :-1, 1], tok[:, :-1, 1])
    if shift:
        assert torch.allclose(c, torch.ones_like(c)) and 0.5 * shift < d.abs().max() <= shift
    else:
        assert torch.allclose(d, torch.zeros_like(d), atol=1e-12) and c.max() / c.min() > 10


def test_x_and_y_maps_are_drawn_independently():
    """The y map has its own seed stream (cfg.seed * 1e6 + step + 7e8, not the x map's + 5e8): with
    the same stream the y factor of every prompt was its x factor (log c = log s exactly)."""
    b = _prompts()
    cfg = TrainConfig(R=100.0, N=[10], steps=100, aug_scale=10.0, aug_y_scale=10.0, progress=False)
    tok, _ = training_batch(cfg, b.tokens, b.ols_prediction, step=3)
    s, _ = _x_map(b.tokens[..., 0], tok[..., 0])
    c, _ = _x_map(b.tokens[:, :-1, 1], tok[:, :-1, 1])
    corr = np.corrcoef(s.log().numpy(), c.log().numpy())[0, 1]
    assert abs(corr) < 0.3, corr  # 256 independent pairs: |corr| ~ 0.06


def test_each_step_draws_new_maps_and_a_step_repeats_its_own():
    """The per-step seed includes the step: steps 5 and 6 draw other maps, step 5 twice the same."""
    b = _prompts()
    cfg = TrainConfig(R=100.0, N=[10], steps=100, aug_scale=10.0, aug_shift=3.0, progress=False)
    a5, a6 = training_tokens(cfg, b.tokens, 5), training_tokens(cfg, b.tokens, 6)
    assert torch.equal(a5, training_tokens(cfg, b.tokens, 5))
    assert not torch.allclose(a5[..., 0], a6[..., 0])


def test_the_y_map_ramps_up_like_the_x_map():
    """Ramp r = min(1, step / (aug_ramp * steps)) for the y map too: at r = 0.1 the factor lies in
    [C^-0.1, C^0.1] and the shift in [-0.1 D, 0.1 D] (it ran at the full range from step 1)."""
    b = _prompts()
    cfg = TrainConfig(R=100.0, N=[10], steps=100, aug_ramp=0.5, aug_y_scale=100.0, aug_y_shift=10.0, progress=False)
    tok, _ = training_batch(cfg, b.tokens, b.ols_prediction, step=5)  # r = 5 / 50
    c, d = _x_map(b.tokens[:, :-1, 1], tok[:, :-1, 1])
    assert c.min() >= 100.0 ** -0.1 - 1e-9 and c.max() <= 100.0 ** 0.1 + 1e-9
    assert d.abs().max() <= 1.0 + 1e-9 and d.abs().max() > 0.5


def test_exact_zero_fraction_counts_the_readout():
    """Over the embedding, the attention matrices and the readout (the tensors l1 acts on), LayerNorm
    aside: a model whose only zeros are its readout and one W_Q entry, counted by hand."""
    m = random_model(n_layers=1, n_heads=1, d_model=2)  # embed 2x3, W_Q/K/V/O 1x2x2 each, readout 1x2
    with torch.no_grad():
        m.readout.weight.zero_()
        m.blocks[0].attn.W_Q[0, 1, 0] = 0.0
        m.blocks[0].ln.weight.zero_()  # not counted
    assert exact_zero_fraction(m) == pytest.approx(3 / (6 + 4 * 4 + 2))
