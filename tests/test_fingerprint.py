"""The behavioural fingerprint separates the known solvers: closed forms are invariant to the
affine maps, gd / gd-lsa are GD-like at their own K, a predictor that ignores x is neither."""
import math

import pytest
import torch

from icl_bench.analysis.fingerprint import (CLOSED_FORM_TOL, DIVERGED, GD_LRS, Transform, classify, default_prompts,
                                   gd_reference, profile, relative_mse, transforms)
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


@pytest.mark.parametrize("lr", GD_LRS)
@pytest.mark.parametrize("K", [4, 16, 64])
def test_gd_at_another_step_size_is_gd_like_at_its_K_and_lr(K, lr, batch, gd_profiles):
    """GD is GD at any stable step size: compared with gd at 0.4 only, lr 0.8 at K = 16 and 64 read
    'neither' and lr 0.1 at K = 16 read as K = 4."""
    fp = classify(profile(get_solver("gd-lsa", steps=K, lr=lr), batch), gd_profiles)
    assert fp.verdict == "GD-like" and (fp.gd_steps, fp.gd_lr) == (K, lr) and fp.gd_distance < 1e-6, fp.row()


def test_one_step_size_alone_misses_gd_at_another():
    """Why the step sizes are a grid (the control of the test above): gd-lsa at lr 0.8, K = 16,
    against gd at lr 0.4 alone."""
    b = default_prompts(n_prompts=256, seed=3)
    fp = classify(profile(get_solver("gd-lsa", steps=16, lr=0.8), b), gd_reference(b, lrs=(0.4,)))
    assert fp.verdict == "neither" or fp.gd_steps != 16, fp.row()


class MeanOfY:
    """Predicts the context's mean y: ignores x, so it is neither invariant-and-right nor GD."""

    def predict(self, batch):
        return batch.y.mean(1)


def test_a_predictor_that_ignores_x_is_neither(batch, gd_profiles):
    fp = classify(profile(MeanOfY(), batch), gd_profiles)
    assert fp.verdict == "neither", (fp.gd_steps, fp.gd_distance)


def test_nonfinite_predictions_score_as_diverged(batch):
    assert relative_mse(torch.full((batch.B,), float("nan")), batch) == DIVERGED
    assert relative_mse(batch.ols_prediction, batch) == 0.0
    t = Transform("x*2", scale=2.0)
    assert math.isclose(relative_mse(t.apply(batch).ols_prediction, t.apply(batch)), 0.0, abs_tol=1e-20)
