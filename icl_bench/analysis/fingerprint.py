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
    GD-like           otherwise, if the score profile matches that of K-step GD from w = 0 (the
                      `gd` baseline) on the same prompts for some K in GD_STEPS (1..128) and step
                      size lr in [0.1, 0.8]: mean over the maps of |log10 score - log10
                      score_gd(K, lr)| <= GD_TOL, and no single map more than GD_MAP_TOL decades
                      away (scores floored at FLOOR). (K, lr) = the best match by the mean among
                      the profiles within the band (among all if none is);
    neither           otherwise. "neither" does not rule out every form of GD: GD on
                      preconditioned or centred data, or from another start, has another
                      profile (docs/analysis.md).

How lr is searched: a grid GD_LRS (9 % apart), then, where no grid profile matches, a bounded
scalar fit of lr between grid points (fit_lr). GD's scores fall as (1 - lr lambda)^(2K), and near
the stability edge of a map (lr lambda_max ~ 2 on a few prompts) they move by a decade for 1 % of
lr: GD between two grid points must still be found (on a grid of powers of two, GD at K = 16,
lr 0.5 read "neither"; tests/test_fingerprint.py checks GD off the grid).

The per-map band is what GD cannot escape: K-step GD from w = 0 is linear in y, so its y*10 and
y*0.1 scores equal its identity score; a model whose error grows 1000x when y is scaled is not GD
at any (K, lr), however well its other maps agree on average.
"""
from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from icl_bench.prompts.generator import PromptBatch, PromptSpec, make_batch, sample_prompts

X_SCALES = (0.1, 0.3, 3.0, 10.0)
X_SHIFTS = (-5.0, -1.0, 1.0, 5.0, 20.0)
Y_MAPS = ((0.1, 0.0), (10.0, 0.0), (1.0, -5.0), (1.0, 5.0))
CLOSED_FORM_TOL = 0.05  # max relative MSE vs OLS over the maps for "closed-form-like"
GD_TOL = 0.5  # max mean |log10 ratio| to the gd profile for "GD-like" (a factor ~3 per map)
GD_MAP_TOL = 1.0  # max |log10 ratio| on any one map for "GD-like" (a factor 10)
GD_STEPS = tuple(range(1, 129))  # the K tried for the gd baseline: every K up to 128
# its step sizes: 0.1 * 2^(k/8), k = 0..24, to 4 digits (0.4: gd's default; stable while lr < 2 / lambda_max)
GD_LRS = tuple(round(0.1 * 2 ** (k / 8), 4) for k in range(25))
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
    prediction of a well-posed prompt is not finite or the score exceeds DIVERGED.

    Raises:
        ValueError: fewer than 2 well-posed prompts, or OLS predictions that do not vary
            (relative_mse_rows); so do profile and fingerprint, which call it."""
    return relative_mse_rows(pred[None], batch)[0]


def relative_mse_rows(preds: torch.Tensor, batch: PromptBatch) -> list[float]:
    """relative_mse of each row of preds (S, B): S predictions of the batch's B prompts at once.

    Raises:
        ValueError: fewer than 2 well-posed prompts, or OLS predictions that do not vary: there is
            no var(ols) to divide by (every score would read DIVERGED, and every solver match gd).
    """
    ols = batch.ols_prediction
    ok = torch.isfinite(ols)
    var = ols[ok].var() if int(ok.sum()) >= 2 else torch.tensor(math.nan)
    if not float(var) > 0:
        raise ValueError(f"batch: the fingerprint needs at least 2 well-posed prompts (finite OLS reference) whose "
                         f"OLS predictions vary; this batch has {int(ok.sum())} of {batch.B} well-posed"
                         + (", all predicting the same value" if int(ok.sum()) >= 2 else ""))
    p = preds.detach().double().to(ols.device)[:, ok]  # (S, B_ok)
    score = ((p - ols[ok]) ** 2).mean(dim=1) / var  # (S,)
    bad = ~torch.isfinite(p).all(dim=1) | ~torch.isfinite(score)
    return torch.where(bad, DIVERGED, score.clamp(max=DIVERGED)).tolist()


def profile(solver, batch: PromptBatch, maps: list[Transform] | None = None) -> dict[str, float]:
    """{map name: relative MSE vs OLS} of `solver` (any Solver) on `batch` under each map."""
    out = {}
    for t in maps or transforms():
        mapped = t.apply(batch)
        with torch.no_grad():
            out[t.name] = relative_mse(solver.predict(mapped), mapped)
    return out


def log_gaps(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """{map: |log10 max(a, FLOOR) - log10 max(b, FLOOR)|} over the maps a and b share (decades)."""
    return {k: abs(math.log10(max(a[k], FLOOR)) - math.log10(max(b[k], FLOOR))) for k in a if k in b}


def profile_distance(a: dict[str, float], b: dict[str, float]) -> float:
    """Mean over the shared maps of |log10 max(a, FLOOR) - log10 max(b, FLOOR)| (decades)."""
    gaps = log_gaps(a, b)
    return sum(gaps.values()) / len(gaps)


@dataclass
class Fingerprint:
    """A solver's scores, the gd profiles it was compared with, and the verdict."""

    scores: dict[str, float]  # map name -> relative MSE vs OLS
    verdict: str  # "closed-form-like", "GD-like" or "neither"
    gd_steps: int | None  # the best-matching K (None if no gd profile was computed)
    gd_distance: float  # profile distance to gd at that K (NaN if none)
    gd_profiles: dict = field(default_factory=dict)  # (K, lr) or K -> profile
    gd_lr: float | None = None  # the best-matching step size (None if the profiles were keyed by K only)
    gd_max_gap: float = math.nan  # the largest per-map gap to that profile, decades (NaN if none)
    gd_worst_map: str | None = None  # the map with that gap

    def row(self) -> dict:
        """Flat dict for a table: fp.<map>, fp.verdict, fp.gd_steps, fp.gd_lr, fp.gd_distance,
        fp.gd_max_gap, fp.gd_worst_map."""
        return {**{f"fp.{k}": v for k, v in self.scores.items()}, "fp.verdict": self.verdict,
                "fp.gd_steps": self.gd_steps, "fp.gd_lr": self.gd_lr, "fp.gd_distance": self.gd_distance,
                "fp.gd_max_gap": self.gd_max_gap, "fp.gd_worst_map": self.gd_worst_map}


TRAJECTORY_BYTES = 64 * 2**20  # GD trajectories held at once by gd_reference (maps are batched up to this)


def gd_reference(batch: PromptBatch, maps: list[Transform] | None = None, *, steps=GD_STEPS,
                 lrs=GD_LRS) -> dict[tuple[int, float], dict[str, float]]:
    """(K, lr) -> the profile of K-step GD from w = 0 (masked key set) on `batch`, for K in steps,
    lr in lrs: one GD trajectory per (map, lr), read at every K. The iteration is the `gd`
    baseline's (icl_bench_baselines/gd.py), run in its Gram form (gd_mv.gd_trajectory_gram: ~10x
    fewer operations at N = 20, the same iterates up to rounding; a test checks the scores agree
    above FLOOR). Every step size and as many maps as fit TRAJECTORY_BYTES run as one batch: GD is
    per prompt, so batching changes no number, only how many small torch ops run."""
    from icl_bench.solvers.gd_mv import gd_trajectory_gram

    maps = maps or transforms()
    mapped = [t.apply(batch) for t in maps]
    B, L, K = batch.B, len(lrs), max(steps)
    per_map = (K + 1) * L * B * 8  # bytes of one map's trajectories (float64)
    chunk = max(1, TRAJECTORY_BYTES // per_map)
    out = {(k, lr): {} for lr in lrs for k in steps}
    lr_col = torch.tensor(lrs, dtype=mapped[0].x.dtype, device=mapped[0].x.device).repeat_interleave(B)  # (L B,)
    for i in range(0, len(maps), chunk):
        group = mapped[i:i + chunk]  # (map, lr, prompt)-major below: column (g L + j) B + b
        cat = lambda f: torch.cat([f(m).repeat(L, *([1] * (f(m).ndim - 1))) for m in group])  # noqa: E731
        traj = gd_trajectory_gram(cat(lambda m: m.x), cat(lambda m: m.y), cat(lambda m: m.x_query), K,
                                lr_col.repeat(len(group)))  # (K + 1, G L B)
        for g, (t, m) in enumerate(zip(maps[i:i + chunk], group)):
            rows = traj[list(steps), g * L * B:(g + 1) * L * B].reshape(len(steps) * L, B)  # row (K index, lr index)
            scores = iter(relative_mse_rows(rows, m))
            for k in steps:
                for lr in lrs:
                    out[(k, lr)][t.name] = next(scores)
    return out


REFERENCES_KEPT = 4  # gd_reference results kept by reference() (a few MB each at 1024 prompts)
_references: OrderedDict = OrderedDict()  # key of (prompts, maps, K, lr) -> gd_reference's result
_references_lock = threading.Lock()


def reference(batch: PromptBatch, maps: list[Transform], *, steps=GD_STEPS, lrs=GD_LRS) -> dict:
    """gd_reference(batch, maps, steps=steps, lrs=lrs), kept for the REFERENCES_KEPT most recent
    arguments. It depends on the prompts and the grid only, not on the solver, and `sweep`
    analyses its runs of one seed on the same prompts (docs/analysis.md, "How K and lr are
    searched"). The prompts are keyed by the bytes of what the
    maps read (x, y, the query x), their dtype and device (not R: GD reads no token); an equal batch
    sampled again hits, and so does one at another R. Returns a copy (a caller that edits its
    profiles, e.g. through Fingerprint.gd_profiles, changes no later answer)."""
    h = hashlib.sha256(repr((str(batch.dtype), str(batch.device), tuple(batch.x.shape), tuple(maps),
                             tuple(steps), tuple(lrs))).encode())
    for t in (batch.x, batch.y, batch.x_query):
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    key = h.hexdigest()
    with _references_lock:
        kept = _references.get(key)
        if kept is not None:
            _references.move_to_end(key)
    if kept is None:
        kept = gd_reference(batch, maps, steps=steps, lrs=lrs)
        with _references_lock:
            _references[key] = kept
            while len(_references) > REFERENCES_KEPT:
                _references.popitem(last=False)
    return {k: dict(p) for k, p in kept.items()}


def _penalised(gaps: dict[str, float]) -> float:
    """What the match minimises: the mean gap, plus how far the worst map exceeds GD_MAP_TOL."""
    return sum(gaps.values()) / len(gaps) + max(0.0, max(gaps.values()) - GD_MAP_TOL)


def fit_lr(scores: dict[str, float], batch: PromptBatch, gd_profiles: dict, maps: list[Transform] | None = None,
           *, brackets: int = 2) -> dict:
    """gd_profiles (keyed by (K, lr), from gd_reference on `batch` and `maps`) plus the profiles at
    step sizes fitted between its grid points: around the `brackets` grid step sizes whose best K
    matches `scores` best, a bounded scalar minimisation (scipy.optimize.minimize_scalar, on log lr,
    between the two neighbouring grid points, to 0.1 %) of the penalised distance, every K at once.

    Near the stability edge of a map (lr lambda_max ~ 2 on a few prompts) GD's score moves by a
    decade for 1 % of lr, finer than any affordable grid; the fit follows it there.
    """
    from scipy.optimize import minimize_scalar

    steps = sorted({k for k, _ in gd_profiles})
    lrs = sorted({lr for _, lr in gd_profiles})
    best = {lr: min(_penalised(log_gaps(scores, p)) for (_, l), p in gd_profiles.items() if l == lr) for lr in lrs}
    extra: dict = {}

    def objective(log_lr: float) -> float:
        prof = gd_reference(batch, maps, steps=steps, lrs=(math.exp(log_lr),))
        extra.update(prof)
        return min(_penalised(log_gaps(scores, p)) for p in prof.values())

    for i in sorted(range(len(lrs)), key=lambda i: best[lrs[i]])[:brackets]:
        lo, hi = lrs[max(i - 1, 0)], lrs[min(i + 1, len(lrs) - 1)]
        if lo < hi:
            minimize_scalar(objective, bounds=(math.log(lo), math.log(hi)), method="bounded",
                            options={"xatol": 1e-3})
    return {**gd_profiles, **extra}


def classify(scores: dict[str, float], gd_profiles: dict, batch: PromptBatch | None = None,
             maps: list[Transform] | None = None) -> Fingerprint:
    """The verdict of the module docstring from a solver's scores and gd's profiles, keyed by
    (K, lr) (gd_reference) or by K alone (one step size, as the multivariate fingerprint's).

    batch (and maps, if not transforms()): the prompts the profiles were computed on; given, the
    step size is also fitted between the grid points (fit_lr) unless a grid profile already
    matches. Without it only the grid is tried.
    """
    fp = _classify(scores, gd_profiles)
    if batch is None or fp.verdict != "neither" or not all(isinstance(k, tuple) for k in gd_profiles):
        return fp
    return _classify(scores, fit_lr(scores, batch, gd_profiles, maps))


def _classify(scores: dict[str, float], gd_profiles: dict) -> Fingerprint:
    gaps = {k: log_gaps(scores, prof) for k, prof in gd_profiles.items()}
    within = [k for k, g in gaps.items() if max(g.values()) <= GD_MAP_TOL]
    best_k = min(within or gaps, key=lambda k: sum(gaps[k].values()) / len(gaps[k]), default=None)
    best_d = sum(gaps[best_k].values()) / len(gaps[best_k]) if best_k is not None else math.nan
    worst = max(gaps[best_k], key=gaps[best_k].get) if best_k is not None else None
    max_gap = gaps[best_k][worst] if worst is not None else math.nan
    best_k, lr = best_k if isinstance(best_k, tuple) else (best_k, None)
    if max(scores.values()) <= CLOSED_FORM_TOL:
        verdict = "closed-form-like"
    elif best_k is not None and best_d <= GD_TOL and max_gap <= GD_MAP_TOL:
        verdict = "GD-like"
    else:
        verdict = "neither"
    return Fingerprint(scores, verdict, best_k, best_d, gd_profiles, lr, max_gap, worst)


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
    return classify(profile(solver, batch, maps), reference(batch, maps, steps=gd_steps, lrs=gd_lrs), batch, maps)
