"""Training-time random affine augmentation of x (and y) and the proximal l1 step (docs/mechanism.md).

Affine augmentation. Each training prompt gets its own map of the inputs

    x_i -> s x_i + t,  u -> s u + t,   y unchanged,   s = exp(U[r ln(1/S), r ln S]),  t ~ U[-r T, r T]

(S = `aug_scale`, T = `aug_shift`, r the ramp factor below). Least squares with an intercept is
equivariant under it: the fitted line moves with x, so the OLS prediction at the mapped query is
the same number and the training target does not change. A solver that divides by the context
statistics (the LayerNorm closed form, docs/design.md §5) is invariant; one that relies
on the scale and the centre of x being those of N(0, 1) is not. The issue that motivated it
measured that without it the trained models fit OLS without the LayerNorm division (docs/mechanism.md).

y maps (`aug_y_scale` = C, `aug_y_shift` = D): context y -> c y + d, c = exp(U[r ln(1/C), r ln C]),
d ~ U[-r D, r D], and the target -> c target + d (least squares follows this map too). With them
the model is trained to be invariant to every map of the behavioural fingerprint
(icl_bench/analysis/fingerprint.py), not only the x maps.

Ramp: r = min(1, step / (aug_ramp * steps)) (r = 1 throughout when aug_ramp = 0), so the range
grows from the identity to the full range over the first `aug_ramp` fraction of the run.

Proximal l1 (`l1_prox`). After each Adam step, every penalised matrix (embedding, W_Q, W_K, W_V,
W_O, readout; not the LayerNorm gains and biases) is soft-thresholded,

    w <- sign(w) max(|w| - lr_t * l1_prox, 0)

(the proximal map of lr_t * l1_prox * |w|, Parikh & Boyd 2014, "Proximal Algorithms", sec. 6.5.2),
so weights can become exactly zero, which a subgradient penalty never makes them. Since Adam's
steps are about lr_t in size whatever the gradient scale, l1_prox is in units of an Adam step:
a weight whose gradient keeps one sign moves by ~lr_t per step and survives while l1_prox < 1;
a weight with a noisy gradient shrinks to 0. It acts on the parameters Adam sees: for the
preconditioned R column of the embedding (icl_bench.training.train.precondition) that is the stored
column, whose zeros are the real column's zeros. It starts at step `l1_start * steps`.

Masked fine-tuning (`l1_stop` < 1). After step `l1_stop * steps` the thresholding stops and the
weights that are exactly zero then are held at zero (re-zeroed after every Adam step), while the
others train without a penalty: the prune-then-fine-tune schedule of Han et al. 2015, "Learning
both Weights and Connections for Efficient Neural Networks", sec. 3. The exact-zero fraction is
fixed at its value at the stop, and the shrinkage l1 put on the surviving weights is undone.
"""
from __future__ import annotations

import math

import torch


def ramp_factor(step: int, steps: int, ramp: float) -> float:
    """r in [0, 1]: the fraction of the augmentation range used at `step` (1-based) of `steps`."""
    return 1.0 if ramp <= 0 else min(1.0, step / (ramp * steps))


def affine_augment(tokens: torch.Tensor, *, scale: float, shift: float, r: float, seed: int) -> torch.Tensor:
    """x and u -> s x + t per prompt (y and R untouched); the OLS prediction is unchanged.

    Args:
        tokens: (B, N+1, 3) rows (x_i, y_i, R), last row (u, 0, R); any float dtype.
        scale: S >= 1, s = exp(U[-r ln S, r ln S]); shift: T >= 0, t ~ U[-r T, r T]; r: ramp factor.
        seed: seeds the per-prompt draws (CPU float64 generator), so a step is reproducible.
    Returns:
        a new (B, N+1, 3) tensor; `tokens` is not modified. With r = 0 (or S = 1 and T = 0) a copy.
    """
    s, t = affine_draws(tokens.shape[0], scale=scale, shift=shift, r=r, seed=seed)  # (B,) float64 each
    out = tokens.clone()
    out[..., 0] = s.to(tokens)[:, None] * tokens[..., 0] + t.to(tokens)[:, None]
    return out


def affine_draws(B: int, *, scale: float, shift: float, r: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-prompt factor and offset of an affine map, (B,) float64 each: exp(U[-r ln scale,
    r ln scale]) and U[-r shift, r shift], from a CPU generator seeded with `seed`."""
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    u1, u2 = torch.rand(2, B, generator=gen, dtype=torch.float64)  # (B,), (B,)
    return torch.exp(r * math.log(scale) * (2 * u1 - 1)), r * shift * (2 * u2 - 1)


@torch.no_grad()
def prox_l1(params: list[torch.Tensor], threshold: float) -> None:
    """Soft-threshold every tensor in place: w <- sign(w) max(|w| - threshold, 0) (threshold >= 0)."""
    if threshold <= 0:
        return
    for p in params:
        p.copy_(torch.sign(p) * torch.clamp(p.abs() - threshold, min=0.0))


def prox_params(model) -> list[torch.Tensor]:
    """The leaf parameters the proximal step acts on: the embedding as Adam stores it (the
    preconditioned original when parametrized), every attention matrix, the readout."""
    emb = model.embed
    stored = emb.parametrizations.weight.original if hasattr(emb, "parametrizations") else emb.weight
    return [stored, model.readout.weight] + [p for name, p in model.named_parameters() if ".attn." in name]


def exact_zero_fraction(model) -> float:
    """Fraction of entries exactly 0.0 over the embedding, attention matrices and readout
    (the tensors l1 acts on; the LayerNorm gains and biases are not counted)."""
    mats = [model.embed.weight, model.readout.weight] + [p for n, p in model.named_parameters() if ".attn." in n]
    total = sum(m.numel() for m in mats)
    return float(sum(int((m.detach() == 0).sum()) for m in mats)) / total


def y_augment(tokens: torch.Tensor, target: torch.Tensor, *, scale: float, shift: float, r: float,
              seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Context y -> c y + d per prompt, and the target with it (least squares maps its prediction
    the same way: ols(x, c y + d, u) = c ols(x, y, u) + d). The query row's y slot stays 0.

    Args:
        tokens: (B, N+1, 3) as in `affine_augment`; target: (B,) the training target (the OLS
            prediction, or the query's y: both map as y does).
        scale: C >= 1, c = exp(U[-r ln C, r ln C]); shift: D >= 0, d ~ U[-r D, r D]; r: ramp factor.
        seed: seeds the per-prompt draws (CPU float64 generator).
    Returns:
        (tokens (B, N+1, 3), target (B,)), new tensors; the inputs are not modified.
    """
    c, d = (v.to(tokens) for v in affine_draws(tokens.shape[0], scale=scale, shift=shift, r=r, seed=seed))  # (B,)
    out = tokens.clone()
    out[:, :-1, 1] = c[:, None] * tokens[:, :-1, 1] + d[:, None]
    return out, c.to(target) * target + d.to(target)


def training_tokens(cfg, tokens: torch.Tensor, step: int) -> torch.Tensor:
    """The tokens a training step feeds the model before any y map: `tokens` (B, N+1, 3) with
    x and u augmented as cfg says (a TrainConfig; seed cfg.seed * 1e6 + step + 5e8, apart from
    the prompt seeds), or as they are."""
    if cfg.aug_scale <= 1 and cfg.aug_shift <= 0:
        return tokens
    r = ramp_factor(step, cfg.steps, cfg.aug_ramp)
    return affine_augment(tokens, scale=cfg.aug_scale, shift=cfg.aug_shift, r=r, seed=cfg.seed * 1_000_000 + step + 500_000_000)


def training_batch(cfg, tokens: torch.Tensor, target: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B, N+1, 3), target (B,)) of a training step: x maps by `training_tokens`, then the
    y map when cfg.aug_y_scale > 1 or cfg.aug_y_shift > 0 (its own seed stream, cfg.seed * 1e6 +
    step + 7e8, so the x draws are those of a run without it), with the same ramp."""
    tokens = training_tokens(cfg, tokens, step)
    if cfg.aug_y_scale <= 1 and cfg.aug_y_shift <= 0:
        return tokens, target
    r = ramp_factor(step, cfg.steps, cfg.aug_ramp)
    return y_augment(tokens, target, scale=cfg.aug_y_scale, shift=cfg.aug_y_shift, r=r,
                     seed=cfg.seed * 1_000_000 + step + 700_000_000)


class ProxL1:
    """The proximal l1 schedule of one training run (cfg a TrainConfig): call it after optimiser
    step `step` (1-based) at learning rate lr. Nothing when cfg.l1_prox = 0 or before
    cfg.l1_start * steps; soft threshold lr * cfg.l1_prox up to cfg.l1_stop * steps; after that the
    zero pattern at the stop is kept (masked fine-tuning, see the module docstring)."""

    def __init__(self, model, cfg):
        self.cfg = cfg
        self.params = prox_params(model)
        self.masks: list[torch.Tensor] | None = None  # (shape of each param) bool, True = held at 0

    @torch.no_grad()
    def __call__(self, step: int, lr: float) -> None:
        cfg = self.cfg
        if cfg.l1_prox <= 0 or step <= cfg.l1_start * cfg.steps:
            return
        if step <= cfg.l1_stop * cfg.steps:
            prox_l1(self.params, lr * cfg.l1_prox)
            if step + 1 > cfg.l1_stop * cfg.steps:  # the last thresholding step: its zeros are kept
                self.masks = [p == 0 for p in self.params]
            return
        if self.masks is None:  # no step fell in (l1_start, l1_stop] * steps: keep today's zeros
            self.masks = [p == 0 for p in self.params]
        for p, mask in zip(self.params, self.masks):
            p.masked_fill_(mask, 0.0)
