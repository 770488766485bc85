"""Behavioural fingerprint: does a solver act like a closed form or like K steps of GD?

Needs no weights, so it applies to any registered solver, plugins included (docs/analysis.md,
section "Behavioural fingerprint"; the reasoning is in docs/design.md §9).

Affine maps of a prompt that least squares with an intercept follows exactly:

    x-maps  x_i -> s x_i + t, u -> s u + t, y unchanged:   the OLS prediction is unchanged
            (s in {0.1, 0.3, 3, 10} with t = 0; t in {-5, -1, 1, 5, 20} with s = 1)
    y-maps  y_i -> c y_i + d:                               the OLS prediction maps to c ols + d
            ((c, d) in {(0.1, 0), (10, 0), (1, -5), (1, 5)})

For each map the solver predicts on the mapped prompts and we score its relative MSE vs the OLS
prediction of the mapped prompts, mean (pred - ols)^2 / var(ols) (NaN / inf predictions count as
DIVERGED = 1e6). A closed form (OLS, the LayerNorm construction with R >> the data) is invariant:
every score stays small. K-step GD from w = 0 is not: it degrades with the conditioning of
its Hessian [[1, x_bar], [x_bar, mean x^2]] (a shift couples intercept and slope, a scale-up
puts lr above 2 / lambda_max and it diverges, a scale-down slows it).

Verdict (thresholds below, checked on the known solvers by tests/test_fingerprint.py):
    closed-form-like  every score (the identity included) <= CLOSED_FORM_TOL;
    GD-like           otherwise, if the score profile matches the `gd` baseline's at some K in
                      GD_STEPS and step size lr in GD_LRS on the same prompts: mean over the maps
                      of |log10 score - log10 score_gd(K, lr)| <= GD_TOL (scores floored at
                      FLOOR), (K, lr) = the best match;
    neither           otherwise. "neither" does not rule out every form of GD: plain GD from
                      w = 0 on [1, x] at a step size outside GD_LRS, or GD on preconditioned or
                      centred data, has another profile (docs/analysis.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from icl_bench.prompts.generator import PromptBatch, PromptSpec, make_batch, sample_prompts

X_SCALES = (0.1, 0.3, 3.0, 10.0)
X_SHIFTS = (-5.0, -1.0, 1.0, 5.0, 20.0)
Y_MAPS = ((0.1, 0.0), (10.0, 0.0), (1.0, -5.0), (1.0, 5.0))
CLOSED_FORM_TOL = 0.05  # max relative MSE vs OLS over the maps for "closed-form-like"
GD_TOL = 0.5  # max mean |log10 ratio| to the gd profile for "GD-like" (a factor ~3 per map)
GD_STEPS = (1, 2, 4, 8, 16, 32, 64, 128)  # the K tried for the gd baseline
GD_LRS = (0.1, 0.2, 0.4, 0.8)  # its step sizes tried (0.4: gd's default; stable while lr < 2 / lambda_max)
DIVERGED = 1e6  # the score of a map where the solver returns NaN / inf or worse than this
FLOOR = 1e-8  # scores below this are equal for the profile match (rounding-level agreement)


@dataclass(frozen=True)
class Transform:
    """One affine map: x -> scale x + shift (context and query), y -> y_scale y + y_shift."""

    name: str
    scale: float = 1.0
    shift: float = 0.0
    y_scale: float = 1.0
    y_shift: float = 0.0

    def apply(self, batch: PromptBatch) -> PromptBatch:
        """The mapped prompts (same dtype and R); their OLS reference is recomputed on them."""
        x = batch.x.double() * self.scale + self.shift  # (B, N)
        u = batch.x_query.double() * self.scale + self.shift  # (B,)
        y = batch.y.double() * self.y_scale + self.y_shift  # (B, N)
        return make_batch(x, y, u, R=batch.R, dtype=batch.dtype, device=batch.device)


def transforms() -> list[Transform]:
    """The identity, then every x-map and y-map of the module docstring, in that order."""
    out = [Transform("identity")]
    out += [Transform(f"x*{s:g}", scale=s) for s in X_SCALES]
    out += [Transform(f"x{t:+g}", shift=t) for t in X_SHIFTS]
    out += [Transform(f"y*{c:g}{d:+g}" if d else f"y*{c:g}", y_scale=c, y_shift=d) for c, d in Y_MAPS]
    return out


def relative_mse(pred: torch.Tensor, batch: PromptBatch) -> float:
    """mean (pred - ols)^2 / var(ols) over the well-posed prompts, in float64; DIVERGED if any
    prediction of a well-posed prompt is not finite or the score exceeds DIVERGED."""
    ols = batch.ols_prediction
    ok = torch.isfinite(ols)
    p = pred.detach().double().to(ols.device)[ok]
    if not bool(torch.isfinite(p).all()):
        return DIVERGED
    score = float(((p - ols[ok]) ** 2).mean() / ols[ok].var())
    return min(score, DIVERGED) if math.isfinite(score) else DIVERGED


def profile(solver, batch: PromptBatch, maps: list[Transform] | None = None) -> dict[str, float]:
    """{map name: relative MSE vs OLS} of `solver` (any Solver) on `batch` under each map."""
    out = {}
    for t in maps or transforms():
        mapped = t.apply(batch)
        with torch.no_grad():
            out[t.name] = relative_mse(solver.predict(mapped), mapped)
    return out


def profile_distance(a: dict[str, float], b: dict[str, float]) -> float:
    """Mean over the shared maps of |log10 max(a, FLOOR) - log10 max(b, FLOOR)|."""
    keys = [k for k in a if k in b]
    return sum(abs(math.log10(max(a[k], FLOOR)) - math.log10(max(b[k], FLOOR))) for k in keys) / len(keys)


@dataclass
class Fingerprint:
    """A solver's scores, the gd profiles it was compared with, and the verdict."""

    scores: dict[str, float]  # map name -> relative MSE vs OLS
    verdict: str  # "closed-form-like", "GD-like" or "neither"
    gd_steps: int | None  # the best-matching K (None if no gd profile was computed)
    gd_distance: float  # profile distance to gd at that K (NaN if none)
    gd_profiles: dict = field(default_factory=dict)  # (K, lr) or K -> profile
    gd_lr: float | None = None  # the best-matching step size (None if the profiles were keyed by K only)

    def row(self) -> dict:
        """Flat dict for a table: fp.<map>, fp.verdict, fp.gd_steps, fp.gd_lr, fp.gd_distance."""
        return {**{f"fp.{k}": v for k, v in self.scores.items()}, "fp.verdict": self.verdict,
                "fp.gd_steps": self.gd_steps, "fp.gd_lr": self.gd_lr, "fp.gd_distance": self.gd_distance}


def gd_reference(batch: PromptBatch, maps: list[Transform] | None = None, *, steps=GD_STEPS,
                 lrs=GD_LRS) -> dict[tuple[int, float], dict[str, float]]:
    """(K, lr) -> the `gd` baseline's profile on `batch` (masked key set), for K in steps, lr in lrs."""
    from icl_bench.solvers.registry import get_solver  # the gd baseline (baselines/gd.py)

    return {(k, lr): profile(get_solver("gd", steps=k, lr=lr), batch, maps) for lr in lrs for k in steps}


def classify(scores: dict[str, float], gd_profiles: dict) -> Fingerprint:
    """The verdict of the module docstring from a solver's scores and gd's profiles, keyed by
    (K, lr) (gd_reference) or by K alone (one step size, as the multivariate fingerprint's)."""
    best_k, best_d = None, math.nan
    for k, prof in gd_profiles.items():
        d = profile_distance(scores, prof)
        if best_k is None or d < best_d:
            best_k, best_d = k, d
    best_k, lr = best_k if isinstance(best_k, tuple) else (best_k, None)
    if max(scores.values()) <= CLOSED_FORM_TOL:
        verdict = "closed-form-like"
    elif best_k is not None and best_d <= GD_TOL:
        verdict = "GD-like"
    else:
        verdict = "neither"
    return Fingerprint(scores, verdict, best_k, best_d, gd_profiles, lr)


def default_prompts(*, N: int = 20, R: float = 100.0, n_prompts: int = 1024, noise: float = 0.1,
                    seed: int = 0, dtype: str = "float64") -> PromptBatch:
    """The fingerprint's prompts: x, slope, intercept ~ N(0, 1), label noise `noise`."""
    return sample_prompts(PromptSpec(N=N, noise=float(noise), R=float(R)), n_prompts, seed=seed, dtype=dtype)


def fingerprint(solver, batch: PromptBatch | None = None, *, gd_steps=GD_STEPS, gd_lrs=GD_LRS) -> Fingerprint:
    """Score `solver` under every map and classify it against the `gd` baseline on the same prompts.

    Args:
        solver: any object with predict(PromptBatch) -> (B,) tensor (a registered Solver).
        batch: the prompts (default: `default_prompts()`, N = 20, R = 100, 1024 prompts, float64).
        gd_steps, gd_lrs: the K and step sizes tried for gd (masked key set).
    Returns:
        Fingerprint (scores per map, verdict, best-matching K and lr, and its distance).
    """
    batch = default_prompts() if batch is None else batch
    maps = transforms()
    return classify(profile(solver, batch, maps), gd_reference(batch, maps, steps=gd_steps, lrs=gd_lrs))
