"""d regressors: the float64 reference against exact rational least squares, prompts, and GD / gd-lsa."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from icl_bench_baselines.gd import gd_predict
from icl_bench.solvers.gd_lsa import build_gd_construction
from icl_bench.solvers.gd_mv import build_gd_lsa_mv, gd_predict_mv, gd_trajectory_mv, hessian_eigenvalues_mv
from icl_bench.prompts.exact_ols import exact_prediction_mv
from icl_bench.prompts.ols_mv import ols_fit_mv, ols_predict_mv
from icl_bench.prompts.generator import PromptSpec, sample_prompts
from icl_bench.prompts.multivariate import equicorrelation_condition, make_batch_mv, make_tokens_mv, sample_prompts_mv


def _prompt(seed, N, d, offset=0.0, scale=1.0):
    rng = np.random.default_rng(seed)
    x = offset + scale * rng.standard_normal((N, d))
    y = rng.standard_normal(N) * scale + x @ rng.standard_normal(d)
    u = offset + scale * rng.standard_normal(d)
    return x, y, u


@pytest.mark.parametrize("d", [1, 2, 3])
@pytest.mark.parametrize("offset,scale", [(0.0, 1.0), (1e6, 1.0), (0.0, 1e-150), (0.0, 1e150), (1e9, 1e3)])
def test_reference_matches_exact_rational(d, offset, scale):
    for seed in range(4):
        N = d + 2 + seed
        x, y, u = _prompt(seed, N, d, offset, scale)
        exact = exact_prediction_mv(x, y, u)
        fit = ols_fit_mv(torch.tensor(x)[None], torch.tensor(y)[None])
        pred = float(ols_predict_mv(torch.tensor(x)[None], torch.tensor(y)[None], torch.tensor(u)[None])[0])
        kappa, gamma = float(fit["kappa"][0]), float(fit["gamma"][0])
        # stated bound (docs/ln-closed-form-multivariate.md): relative to the data's y scale,
        # |pred - exact| <= 50 N eps kappa gamma (1 + |u - x_bar| / sd(x)) * scale of y
        ysc = float(np.abs(y).max()) + abs(float(exact))
        bound = 50 * N * np.finfo(float).eps * kappa * gamma * (1 + np.abs(u - x.mean(0)).max() / x.std(0).min()) * ysc
        assert abs(pred - float(exact)) <= bound, (pred, float(exact), bound)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(0, 5), st.integers(0, 10**6),
       st.sampled_from([0.0, 1.0, 1e4, 1e8]), st.sampled_from([1e-100, 1e-3, 1.0, 1e3, 1e100]))
def test_reference_exact_property(d, extra, seed, offset, scale):
    N = d + 2 + extra
    x, y, u = _prompt(seed, N, d, offset, scale)
    fit = ols_fit_mv(torch.tensor(x)[None], torch.tensor(y)[None])
    pred = float(ols_predict_mv(torch.tensor(x)[None], torch.tensor(y)[None], torch.tensor(u)[None])[0])
    exact = exact_prediction_mv(x, y, u)
    kappa, gamma = float(fit["kappa"][0]), float(fit["gamma"][0])
    if bool(fit["ill_posed"][0]):  # NaN only where the rounded problem is degenerate: N eps kappa gamma >= 1
        assert np.isnan(pred)  # (e.g. offset 1, scale 1e-100: every x rounds to 1.0, kappa = inf)
        assert np.isinf(kappa) or N * np.finfo(float).eps * kappa * gamma >= 1
        return
    ysc = float(np.abs(y).max()) + abs(float(exact))
    bound = 50 * N * np.finfo(float).eps * kappa * gamma * (1 + np.abs(u - x.mean(0)).max() / x.std(0).min()) * ysc
    assert abs(pred - float(exact)) <= bound


def test_reference_nan_rule():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 10, 2))
    y = rng.standard_normal((5, 10))
    u = rng.standard_normal((5, 2))
    x[1, :, 1] = 2.0 * x[1, :, 0]  # exactly collinear columns
    x[2, :, 1] = 3.5  # a constant column (no spread)
    x[3, 4, 0] = np.nan  # a NaN in the context
    u[4, 1] = np.inf  # an infinite query
    pred = ols_predict_mv(torch.tensor(x), torch.tensor(y), torch.tensor(u))
    assert torch.isnan(pred[1:]).all() and torch.isfinite(pred[0])
    fit = ols_fit_mv(torch.tensor(x), torch.tensor(y))
    assert fit["ill_posed"].tolist() == [False, True, True, True, False]  # the query is not part of the fit
    # fewer examples than regressors + 1: never a unique fit
    assert torch.isnan(ols_predict_mv(torch.randn(3, 3, 3, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64),
                                      torch.randn(3, 3, dtype=torch.float64))).all()
    # nearly collinear but well inside float64: finite and right (kappa ~ 1e6)
    xs = np.stack([x[0, :, 0], x[0, :, 0] + 1e-6 * x[0, :, 1]], axis=1)
    exact = float(exact_prediction_mv(xs, y[0], u[0]))
    got = float(ols_predict_mv(torch.tensor(xs)[None], torch.tensor(y[0])[None], torch.tensor(u[0])[None])[0])
    assert abs(got - exact) <= 1e-6 * (1 + abs(exact))


def test_reference_d1_agrees_with_1d_reference():
    b = sample_prompts(PromptSpec(N=30, noise=0.1), 2000, seed=3, dtype="float64")
    mv = ols_predict_mv(b.x, b.y, b.x_query)
    assert torch.allclose(mv, b.ols_prediction, rtol=1e-12, atol=1e-12)


def test_prompts_d1_is_the_1d_generator_bit_for_bit():
    spec = PromptSpec(N=12, noise=0.2, R=50.0)
    a = sample_prompts(spec, 64, seed=7, dtype="float32")
    b = sample_prompts_mv(spec, 64, d=1, seed=7, dtype="float32")
    for k, v in a.tensors().items():
        assert torch.equal(v, b.tensors()[k]), k


def test_prompts_d_regressors_shapes_truth_and_correlation():
    spec = PromptSpec(N=40, noise=0.0, R=100.0)
    b = sample_prompts_mv(spec, 500, d=3, seed=1, dtype="float64")
    assert b.x.shape == (500, 40, 3) and b.x_query.shape == (500, 3) and b.slope.shape == (500, 3)
    assert b.tokens.shape == (500, 41, 5) and (b.tokens[..., 4] == 100.0).all() and (b.tokens[:, -1, 3] == 0).all()
    assert torch.allclose(b.ols_prediction, b.y_query_clean, atol=1e-10)  # noise 0: OLS recovers the truth
    again = sample_prompts_mv(spec, 500, d=3, seed=1, dtype="float64")
    assert torch.equal(again.x, b.x)
    c = sample_prompts_mv(spec, 4000, d=2, x_corr=0.9, seed=2, dtype="float64")
    corr = np.corrcoef(c.x.reshape(-1, 2).numpy().T)[0, 1]
    assert abs(corr - 0.9) < 0.01 and abs(equicorrelation_condition(2, 0.9) - 19.0) < 1e-9
    with pytest.raises(ValueError, match="^x_corr:"):
        sample_prompts_mv(spec, 4, d=3, x_corr=-0.6, seed=0)
    with pytest.raises(ValueError, match="^d:"):
        sample_prompts_mv(spec, 4, d=0, seed=0)


def test_make_tokens_mv_d1_equals_make_tokens_and_make_batch():
    b = sample_prompts(PromptSpec(N=9), 8, seed=0, dtype="float64")
    assert torch.equal(make_tokens_mv(b.x, b.y, b.x_query, b.R), b.tokens)
    x = torch.randn(4, 9, 2, dtype=torch.float64)
    mb = make_batch_mv(x, x.sum(-1), torch.zeros(4, 2, dtype=torch.float64), R=10.0)
    assert torch.allclose(mb.ols_prediction, torch.zeros(4, dtype=torch.float64), atol=1e-12)
    with pytest.raises(ValueError, match="^x, y, x_query:"):
        make_batch_mv(x, x.sum(-1), torch.zeros(4, 3), R=10.0)


def test_make_batch_mv_with_one_regressor_is_the_univariate_batch():
    """x (B, N, 1) gives make_batch's batch (x (B, N), u (B,)); every solver then answers (B,),
    NaN at the ill-posed prompt. (Before, a 3-D x with d = 1 reached the univariate screens, which
    broadcast a (B, 1) query to (B, B) or raised.)"""
    from icl_bench import make_batch
    from icl_bench.solvers.registry import get_solver

    g = torch.Generator().manual_seed(0)
    x, y, u = (torch.randn(3, 20, 1, generator=g, dtype=torch.float64), torch.randn(3, 20, generator=g, dtype=torch.float64),
               torch.randn(3, 1, generator=g, dtype=torch.float64))
    x[1] = 2.0  # all x equal: ill-posed
    mb, b = make_batch_mv(x, y, u, R=100.0), make_batch(x[..., 0], y, u[:, 0], R=100.0)
    assert mb.d == 1 and torch.equal(mb.x, b.x) and torch.equal(mb.tokens, b.tokens)
    for name in ("ols", "ln-closed-form", "gd-lsa"):
        pred = get_solver(name).predict(mb)
        assert pred.shape == (3,) and torch.isnan(pred).tolist() == [False, True, False], name


@pytest.mark.parametrize("d", [2, 3])
@pytest.mark.parametrize("variant", ["masked", "query-in-context"])
def test_gd_lsa_equals_gd_for_d_regressors(d, variant):
    b = sample_prompts_mv(PromptSpec(N=25, noise=0.1, R=100.0), 300, d=d, seed=d, dtype="float64")
    for steps in (1, 7, 20):
        model = build_gd_lsa_mv(steps, 0.3, 100.0, d, variant)
        assert model.cfg.d_model == d + 3 and model.cfg.d_in == d + 2
        lsa = model(b.tokens)
        gd = gd_predict_mv(b.x, b.y, b.x_query, steps, 0.3, variant)
        assert (lsa - gd).abs().max() <= 1e-12
        assert (model.forward_quadratic(b.tokens) - gd).abs().max() <= 1e-12


def test_gd_mv_converges_to_ols_and_d1_matches_1d():
    b = sample_prompts_mv(PromptSpec(N=50, noise=0.1), 200, d=3, seed=0, dtype="float64")
    lam = hessian_eigenvalues_mv(b.x)  # (B, 4) ascending
    lr = float(1.0 / lam[:, -1].max())
    traj = gd_trajectory_mv(b.x, b.y, b.x_query, 3000, lr)
    assert ((traj[-1] - b.ols_prediction) ** 2).mean() < 1e-20
    assert ((traj[10] - b.ols_prediction) ** 2).mean() > 1e-4  # and it was not there from the start
    b1 = sample_prompts(PromptSpec(N=20, noise=0.1), 100, seed=0, dtype="float64")
    assert torch.allclose(gd_predict_mv(b1.x, b1.y, b1.x_query, 9, 0.4), gd_predict(b1.x, b1.y, b1.x_query, 9, 0.4),
                          rtol=0, atol=1e-13)
    for variant in ("masked", "query-in-context"):  # d = 1: the very weights of the 1-D construction
        m1, mv = build_gd_construction(5, 0.4, 100.0, variant), build_gd_lsa_mv(5, 0.4, 100.0, 1, variant)
        for (k, v), (k2, v2) in zip(m1.state_dict().items(), mv.state_dict().items()):
            assert k == k2 and torch.equal(v, v2)


def test_gd_trajectory_mv_takes_one_step_size_per_prompt():
    """A (B,) tensor of step sizes (the fingerprint runs every step size of its grid at once) gives
    each prompt the trajectory of its own scalar step size; a bad tensor is a one-line ConfigError."""
    from icl_bench.errors import ConfigError

    b = sample_prompts_mv(PromptSpec(N=12, noise=0.1, R=10.0), 6, d=2, seed=1)
    lrs = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], dtype=b.x.dtype)
    traj = gd_trajectory_mv(b.x, b.y, b.x_query, 7, lrs)  # (8, 6)
    for i, lr in enumerate(lrs.tolist()):
        one = gd_trajectory_mv(b.x[i:i + 1], b.y[i:i + 1], b.x_query[i:i + 1], 7, lr)[:, 0]
        torch.testing.assert_close(traj[:, i], one, rtol=1e-12, atol=0)
    for bad in (torch.tensor([0.1, -0.2]), torch.tensor([[0.1]]), torch.tensor([float("nan")])):
        with pytest.raises(ConfigError, match="lr: a tensor of step sizes"):
            gd_trajectory_mv(b.x[:2], b.y[:2], b.x_query[:2], 3, bad)


def test_the_query_noise_is_its_own_draw_at_d_2():
    """The query's label noise reused the last context example's (eps[:, N - 1]): the right std,
    fully correlated with that example (found by a mutation review; the 1-D check is in test_prompts)."""
    b = sample_prompts_mv(PromptSpec(N=5, noise=1.0), 20000, d=2, seed=1, dtype="float64")
    ctx = b.y - (b.intercept[:, None] + (b.x * b.slope[:, None, :]).sum(-1))  # (B, N) context noise
    q = b.y_query - b.y_query_clean  # (B,)
    assert float(q.std()) == pytest.approx(1.0, rel=0.03)
    for i in range(5):
        assert abs(float(torch.corrcoef(torch.stack([ctx[:, i], q]))[0, 1])) < 0.03


def test_equicorrelated_x_takes_correlations_down_to_minus_one_over_d_minus_1():
    """x_corr in (-1/(d-1), 1): -0.4 at d = 3 is valid (bound -0.5) and was refused with a bound of
    -1/d (a mutation review); -0.6 is refused."""
    spec = PromptSpec(N=5, noise=0.0)
    assert sample_prompts_mv(spec, 4, d=3, x_corr=-0.4, seed=0, dtype="float64").x.shape == (4, 5, 3)
    with pytest.raises(Exception, match="x_corr"):
        sample_prompts_mv(spec, 4, d=3, x_corr=-0.6, seed=0, dtype="float64")


def test_a_huge_y_alone_makes_ln_closed_form_mv_answer_nan():
    """r_lost_mv looked at x only ([..., :-2]): with y ~ 1e20 and R = 100 ln-closed-form at d = 2
    answered -133.5 instead of NaN (the reference is 9.9e19; found by a mutation review)."""
    from icl_bench.solvers.multivariate import r_lost_mv
    from icl_bench.solvers.registry import get_solver

    gen = torch.Generator().manual_seed(0)
    x, u = torch.randn(1, 20, 2, generator=gen, dtype=torch.float64), torch.randn(1, 2, generator=gen, dtype=torch.float64)
    y = 1e20 + 1e19 * torch.randn(1, 20, generator=gen, dtype=torch.float64)
    batch = make_batch_mv(x, y, u, R=100.0)
    assert bool(r_lost_mv(batch.tokens, 100.0).all())
    assert bool(torch.isnan(get_solver("ln-closed-form").predict(batch)).all())
