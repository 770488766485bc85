"""The behavioural fingerprint separates the known solvers: closed forms are invariant to the
affine maps, gd / gd-lsa are GD-like at their own K, a predictor that ignores x is neither."""
import math

import pytest
import torch

from icl_bench.analysis.fingerprint import (CLOSED_FORM_TOL, DIVERGED, FLOOR, GD_MAP_TOL, GD_TOL, Transform, classify,
                                            default_prompts, gd_reference, profile, profile_distance, relative_mse,
                                            relative_mse_rows, transforms, fingerprint)
from icl_bench.errors import ConfigError
from icl_bench.prompts.generator import make_batch
from icl_bench.solvers.registry import get_solver


@pytest.fixture(scope="module")
def batch():
    return default_prompts(n_prompts=256, seed=3)


@pytest.fixture(scope="module")
def gd_profiles(batch):
    return gd_reference(batch)


def test_maps_keep_ols_as_least_squares_says(batch):
    for t in transforms():
        mapped = t.apply(batch)
        expected = batch.ols_prediction * t.y_scale + t.y_shift  # x-maps: unchanged; y-maps: c ols + d
        torch.testing.assert_close(mapped.ols_prediction, expected, rtol=1e-9, atol=1e-9)
    assert len(transforms()) == 1 + 4 + 5 + 4


@pytest.mark.parametrize("name,params", [("ols", {}), ("scipy-lstsq", {}), ("ln-closed-form", {})])
@pytest.mark.parametrize("R", [100.0, 1000.0])
def test_closed_forms_are_closed_form_like(name, params, R, gd_profiles):
    b = default_prompts(n_prompts=256, seed=3, R=R)
    fp = classify(profile(get_solver(name, **params), b), gd_profiles)
    assert fp.verdict == "closed-form-like", fp.scores
    assert max(fp.scores.values()) <= CLOSED_FORM_TOL


@pytest.mark.parametrize("name", ["gd", "gd-lsa"])
@pytest.mark.parametrize("K", [1, 4, 16])
def test_gd_is_gd_like_at_its_K(name, K, batch, gd_profiles):
    fp = classify(profile(get_solver(name, steps=K), batch), gd_profiles)
    assert fp.verdict == "GD-like" and fp.gd_steps == K and fp.gd_distance < 1e-6, (fp.gd_steps, fp.gd_distance)
    assert fp.gd_lr == 0.4  # the solvers' default step size
    assert fp.scores["x*10"] >= 100 * fp.scores["identity"]  # scaled up, GD degrades or diverges


@pytest.mark.parametrize("lr", [0.1, 0.2, 0.8])
@pytest.mark.parametrize("K", [4, 16, 64])
def test_gd_at_another_step_size_is_gd_like_at_its_K_and_lr(K, lr, batch, gd_profiles):
    """GD is GD at any stable step size: compared with gd at 0.4 only, lr 0.8 at K = 16 and 64 read
    'neither' and lr 0.1 at K = 16 read as K = 4."""
    fp = classify(profile(get_solver("gd-lsa", steps=K, lr=lr), batch), gd_profiles)
    assert fp.verdict == "GD-like" and (fp.gd_steps, fp.gd_lr) == (K, lr) and fp.gd_distance < 1e-6, fp.row()


@pytest.mark.parametrize("lr", [0.3, 0.5, 0.6, 0.7])
@pytest.mark.parametrize("K", [12, 16, 48])
def test_gd_between_grid_points_is_gd_like(K, lr, batch, gd_profiles):
    """GD at a step size off the lr grid is still matched: within both thresholds, by a K near its own."""
    fp = classify(profile(get_solver("gd-lsa", steps=K, lr=lr), batch), gd_profiles, batch)
    assert fp.verdict == "GD-like" and fp.gd_max_gap <= GD_MAP_TOL, fp.row()
    assert 0.5 * K * lr <= fp.gd_steps * fp.gd_lr <= 2 * K * lr, fp.row()  # GD's error falls with K lr


def test_a_coarse_grid_misses_gd_between_its_points(batch):
    """The control of the test above: on K = powers of two and lr in {0.1, 0.2, 0.4, 0.8}, GD at
    K = 16, lr 0.5 matches no profile."""
    coarse = gd_reference(batch, steps=(1, 2, 4, 8, 16, 32, 64, 128), lrs=(0.1, 0.2, 0.4, 0.8))
    fp = classify(profile(get_solver("gd", steps=16, lr=0.5), batch), coarse)
    assert fp.verdict == "neither", fp.row()


def test_the_lr_fit_finds_gd_at_a_stability_edge(batch, gd_profiles):
    """At K = 48, lr 0.5, a few prompts of x+1 sit at GD's stability edge: no grid step size is
    within a decade there (the grid alone reads neither), the fitted one is lr 0.5 itself."""
    scores = profile(get_solver("gd", steps=48, lr=0.5), batch)
    assert classify(scores, gd_profiles).verdict == "neither"
    fp = classify(scores, gd_profiles, batch)
    assert fp.verdict == "GD-like" and fp.gd_steps == 48 and abs(fp.gd_lr - 0.5) < 2e-3, fp.row()


def test_gd_reference_is_the_gd_baseline(batch, gd_profiles):
    """gd_reference reads one GD trajectory (in its Gram form) at every K: the same scores as the
    `gd` solver run to K, to 1e-9 where the fingerprint tells scores apart (>= FLOOR) and to 1e-6
    below it, where both are rounding-level (1.9e-14 agreed to 1.7e-9)."""
    for K, lr in [(1, 0.1), (16, 0.4), (91, 0.6169)]:
        want = profile(get_solver("gd", steps=K, lr=lr), batch)
        got = gd_profiles[(K, lr)]
        assert want.keys() == got.keys()
        for k in want:
            tol = 1e-9 if want[k] >= FLOOR else 1e-6
            assert math.isclose(got[k], want[k], rel_tol=tol, abs_tol=1e-300), (K, lr, k, got[k], want[k])


@pytest.mark.parametrize("d", [1, 3])
def test_the_gram_form_of_gd_is_its_iteration(d):
    """gd_trajectory_gram runs theta <- theta + lr (g - H theta): the iterates of gd_trajectory_mv up
    to rounding, for one step size or one per prompt, with x shifted (a less well-conditioned H)."""
    from icl_bench.solvers.gd_mv import gd_trajectory_gram, gd_trajectory_mv

    gen = torch.Generator().manual_seed(d)
    x = torch.randn(256, 20, d, dtype=torch.float64, generator=gen) + 1
    y, u = torch.randn(256, 20, dtype=torch.float64, generator=gen), torch.randn(256, d, dtype=torch.float64, generator=gen)
    if d == 1:
        x, u = x[..., 0], u[:, 0]
    for lr in (0.3, torch.rand(256, dtype=torch.float64, generator=gen) * 0.6 + 0.05):
        want, got = gd_trajectory_mv(x, y, u, 64, lr), gd_trajectory_gram(x, y, u, 64, lr)
        assert got.shape == want.shape == (65, 256) and torch.equal(got[0], want[0])
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-12), float((got - want).abs().max())
    with pytest.raises(ConfigError, match="steps"):
        gd_trajectory_gram(x, y, u, -1, 0.3)


class YScaleBreaker:
    """GD at K = 8, except that it answers 3x too large when the context's y spread exceeds 5:
    off GD on y*10 alone (GD from w = 0 is linear in y, so its y*10 score is its identity score)."""

    def predict(self, batch):
        pred = get_solver("gd", steps=8).predict(batch)
        return torch.where(batch.y.std(dim=1) > 5, 3 * pred, pred)


def test_one_map_far_from_gd_is_neither(batch, gd_profiles):
    """The per-map band: close to GD on average (within GD_TOL), but y*10 decades away."""
    fp = classify(profile(YScaleBreaker(), batch), gd_profiles, batch)
    assert fp.verdict == "neither" and fp.gd_worst_map == "y*10" and fp.gd_max_gap > GD_MAP_TOL, fp.row()
    assert profile_distance(fp.scores, gd_profiles[(8, 0.4)]) <= GD_TOL  # the mean alone would pass it


class MeanOfY:
    """Predicts the context's mean y: ignores x, so it is neither invariant-and-right nor GD."""

    def predict(self, batch):
        return batch.y.mean(1)


def test_a_predictor_that_ignores_x_is_neither(batch, gd_profiles):
    fp = classify(profile(MeanOfY(), batch), gd_profiles)
    assert fp.verdict == "neither", (fp.gd_steps, fp.gd_distance)


def test_nonfinite_predictions_score_as_diverged(batch):
    assert relative_mse(torch.full((batch.B,), float("nan")), batch) == DIVERGED
    rows = torch.stack([batch.ols_prediction, batch.ols_prediction * 1e300, torch.full((batch.B,), float("inf"))])
    assert relative_mse_rows(rows, batch) == [0.0, DIVERGED, DIVERGED]
    assert relative_mse(batch.ols_prediction, batch) == 0.0
    t = Transform("x*2", scale=2.0)
    assert math.isclose(relative_mse(t.apply(batch).ols_prediction, t.apply(batch)), 0.0, abs_tol=1e-20)


def test_a_batch_with_nothing_to_score_is_an_error_not_gd_like():
    """With one prompt (or none well-posed) var(ols) was NaN, every score DIVERGED, and any solver
    matched gd at distance 0: 'GD-like' (found by an adversarial tester)."""
    from icl_bench import make_batch

    one = default_prompts(n_prompts=1)
    flat = make_batch(torch.ones(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64),
                      torch.ones(4, dtype=torch.float64), R=100.0)  # var(x) = 0: OLS not defined
    for b, k in ((one, 1), (flat, 0)):
        with pytest.raises(ValueError, match=rf"^batch: the fingerprint needs at least 2 well-posed prompts .* has {k} of"):
            fingerprint(get_solver("ols"), b)


def test_the_gd_reference_is_reused_for_equal_prompts_only(monkeypatch):
    """fingerprint() keeps gd's profiles (most of an analysis' time) for the prompts it last saw:
    an equal batch sampled again (or at another R) reuses them, and any change to the prompts, the
    maps or the grid computes them afresh; the numbers are those of gd_reference either way."""
    import icl_bench.analysis.fingerprint as fp

    monkeypatch.setattr(fp, "_references", type(fp._references)())
    calls = []
    real = fp.gd_reference
    monkeypatch.setattr(fp, "gd_reference", lambda *a, **k: calls.append(1) or real(*a, **k))
    maps, steps, lrs = transforms()[:3], (1, 2, 8), (0.2, 0.4)
    a = default_prompts(N=12, n_prompts=64, seed=5)
    first = fp.reference(a, maps, steps=steps, lrs=lrs)
    assert first == real(a, maps, steps=steps, lrs=lrs) and len(calls) == 1
    first[(1, 0.2)]["identity"] = -1.0  # the caller's copy: the kept one is untouched
    first.clear()
    again = fp.reference(default_prompts(N=12, n_prompts=64, seed=5), maps, steps=steps, lrs=lrs)
    assert len(calls) == 1 and again == real(a, maps, steps=steps, lrs=lrs)
    again[(1, 0.2)]["identity"] = -1.0  # a copy again
    assert fp.reference(a, maps, steps=steps, lrs=lrs) == real(a, maps, steps=steps, lrs=lrs) and len(calls) == 1
    at_r10 = default_prompts(N=12, n_prompts=64, seed=5, R=10.0)  # the same x and y: gd reads no token
    assert fp.reference(at_r10, maps, steps=steps, lrs=lrs) == real(at_r10, maps, steps=steps, lrs=lrs)
    assert len(calls) == 1
    y = a.y.clone()
    y[0, 0] += 1e-12  # one label of one prompt
    others = [(default_prompts(N=12, n_prompts=64, seed=6), maps, steps, lrs),
              (make_batch(a.x, y, a.x_query, R=a.R, dtype=a.dtype), maps, steps, lrs),
              (default_prompts(N=12, n_prompts=64, seed=5, dtype="float32"), maps, steps, lrs),
              (a, transforms()[:4], steps, lrs), (a, maps, (1, 2), lrs), (a, maps, steps, (0.2,))]
    for i, (b, m, k, lr) in enumerate(others):
        assert fp.reference(b, m, steps=k, lrs=lr) == real(b, m, steps=k, lrs=lr)
        assert len(calls) == 2 + i, i
    assert len(fp._references) == fp.REFERENCES_KEPT  # the oldest dropped
    fp.reference(a, maps, steps=steps, lrs=lrs)
    assert len(calls) == 2 + len(others)  # dropped: computed again


def test_ill_posed_prompts_are_left_out_of_the_score():
    """relative_mse scores the well-posed prompts only: a prompt whose OLS reference is NaN (all x
    equal) neither makes the batch unscorable nor turns a solver's NaN there into DIVERGED. Hand
    computation: a constant error of 0.1 on the others scores 0.01 / var(ols)."""
    b = default_prompts(n_prompts=64, seed=1)
    x = b.x.clone()
    x[0] = 1.5
    bad = make_batch(x, b.y, b.x_query, R=b.R, dtype=b.dtype)
    ols = bad.ols_prediction
    assert torch.isnan(ols[0]) and torch.isfinite(ols[1:]).all()
    pred = ols + 0.1  # NaN at prompt 0, as a solver that screens it answers
    assert relative_mse(pred, bad) == pytest.approx(0.01 / float(ols[1:].var()), rel=1e-9)


def test_a_score_beyond_diverged_reads_diverged():
    """Scores are capped at DIVERGED (module docstring): a finite answer 1e4 standard deviations
    off scores DIVERGED, not 1e8."""
    b = default_prompts(n_prompts=64, seed=1)
    ols = b.ols_prediction
    assert relative_mse(ols + 1e4 * ols.std(), b) == DIVERGED
    assert relative_mse(ols + 10 * ols.std(), b) == pytest.approx(100.0, rel=1e-9)


def test_the_best_gd_match_is_taken_among_the_profiles_within_the_band():
    """(K, lr) is the best match by the mean gap among the profiles within the per-map band, and
    among all only when none is (module docstring). Profile (1, 0.1) is closer on average (0.4
    decades) but one map is 1.2 decades off; profile (2, 0.1) is 0.45 decades off on every map:
    GD-like at K = 2. Taking the best mean over all profiles read 'neither'."""
    scores = {"a": 1.0, "b": 1.0, "c": 1.0}
    off = 10 ** 0.45
    profiles = {(1, 0.1): {"a": 1.0, "b": 1.0, "c": 10 ** 1.2}, (2, 0.1): {"a": off, "b": off, "c": off}}
    fp = classify(scores, profiles)
    assert fp.verdict == "GD-like" and (fp.gd_steps, fp.gd_lr) == (2, 0.1), fp.row()
    assert fp.gd_distance == pytest.approx(0.45) and fp.gd_max_gap == pytest.approx(0.45)


def test_the_lr_fit_minimises_the_distance_penalised_beyond_the_band(monkeypatch):
    """fit_lr minimises the penalised distance (mean gap + how far the worst map exceeds
    GD_MAP_TOL), not the mean gap alone. Synthetic profiles in tau = ln(lr / 0.2) / ln 1.5 (gd_reference
    replaced): maps a and b are 0.45 tau decades off, map c 1.2 - 0.75 tau, for 0 <= tau <= 1, and
    steeply worse outside. The mean gap is least at tau = 0 (lr 0.2, map c 1.2 decades off: out of
    the band); the penalised distance at tau = 0.2 / 0.75, where map c reaches the band's edge:
    lr = 0.2 * 1.5^(0.2 / 0.75) = 0.22284. Fitting the mean alone reported lr 0.2356."""
    import icl_bench.analysis.fingerprint as fpm

    def prof(lr):
        tau = (math.log(lr) - math.log(0.2)) / math.log(1.5)
        ab = 0.45 * abs(tau) + 5 * max(0.0, tau - 1)
        c = 1.2 - 0.75 * tau if 0 <= tau <= 1 else (1.2 - 5 * tau if tau < 0 else 0.45 + 5 * (tau - 1))
        return {"a": 10 ** ab, "b": 10 ** ab, "c": 10 ** c}

    monkeypatch.setattr(fpm, "gd_reference", lambda batch, maps=None, *, steps, lrs: {(k, lr): prof(lr) for k in steps
                                                                                       for lr in lrs})
    scores = {"a": 1.0, "b": 1.0, "c": 1.0}
    grid = {(1, lr): prof(lr) for lr in (0.1, 0.2, 0.4)}
    assert classify(scores, grid).verdict == "neither"  # no grid point is within the band
    fp = classify(scores, grid, batch=object(), maps=[])
    assert fp.verdict == "GD-like" and fp.gd_max_gap <= GD_MAP_TOL, fp.row()
    assert fp.gd_lr == pytest.approx(0.2 * 1.5 ** (0.2 / 0.75), rel=5e-3), fp.row()
