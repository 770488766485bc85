"""d > 1 regressors at extreme offsets and scales: the reference (ols_mv), `ols`, `scipy-lstsq` and
`ln-closed-form` (standardize = true) against exact rational least squares.

The three cases a review found (docs/accuracy.md, "Scale safety"): scipy-lstsq solved the raw design
[1, X] (relative errors of order 100 at x = 1e8 + z), the reference's shift overflowed on data near
1e308 and its SVD then failed the whole batch, and standardize_mv formed plain squares (x = 1e-200 z:
the answer collapsed to mean(y)).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from icl_bench.prompts.exact_ols import exact_prediction_mv
from icl_bench.prompts.multivariate import make_batch_mv
from icl_bench.prompts.ols_mv import ols_fit_mv
from icl_bench.solvers.ln_closed_form_mv import build_ln_construction_mv
from icl_bench.solvers.multivariate import ln_closed_form_mv, ols_mv, scipy_lstsq_mv, standardize_mv

EPS = np.finfo(np.float64).eps
OFFSETS = [1.0, 1e3, 1e6, 1e9]  # in units of the spread of x
SCALES = [1e-200, 1e-150, 1e-13, 1.0, 1e13, 1e150, 1e200]


def _prompts(d, offset, scale, seed, B=3, N=12):
    """x = scale (offset + z), u likewise, y = x . w + scale 0.1 noise (so y carries the offset too).
    Returns x (B, N, d), y (B, N), u (B, d) and the unscaled z (B, N, d), zu (B, d)."""
    rng = np.random.default_rng(seed)
    z, zu, w = rng.standard_normal((B, N, d)), rng.standard_normal((B, d)), rng.standard_normal((B, d))
    x, u = scale * (offset + z), scale * (offset + zu)
    y = np.einsum("bnd,bd->bn", x, w) + scale * 0.1 * rng.standard_normal((B, N))
    return x, y, u, z, zu


def _bound(fit, i, x, y, zu, z, exact):
    """The reference's stated bound (docs/ln-closed-form-multivariate.md, "The reference"):
    50 N eps kappa gamma (1 + max_k |u_k - x_bar_k| / sd(x_k)) (max|y| + |y_hat|); the query's
    distance in sd units is read from the unscaled draws (the same number, without rounding)."""
    far = 1 + np.abs(zu - z.mean(0)).max() / z.std(0).min()
    kg = float(fit["kappa"][i]) * float(fit["gamma"][i])
    return 50 * len(y) * EPS * kg * far * (np.abs(y).max() + abs(exact)), far


@pytest.mark.parametrize("d", [2, 3])
@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("scale", SCALES)
def test_least_squares_paths_match_exact_at_any_offset_and_scale(d, offset, scale):
    x, y, u, z, zu = _prompts(d, offset, scale, seed=d * 100 + OFFSETS.index(offset))
    b = make_batch_mv(x, y, u, R=100.0)
    fit = ols_fit_mv(b.x, b.y)
    model = build_ln_construction_mv(100.0, d, amplify=1e6)  # amplify: the model term is ~1e-16
    preds = {"reference": b.ols_prediction, "ols": ols_mv(b), "scipy-lstsq": scipy_lstsq_mv(b),
             "ln-closed-form": ln_closed_form_mv(b, model, standardize=True)}
    for i in range(len(x)):
        exact = float(exact_prediction_mv(x[i], y[i], u[i]))
        bound, far = _bound(fit, i, x[i], y[i], zu[i], z[i], exact)
        for name, pred in preds.items():
            # ln-closed-form: the standardization's rounding (the same bound) plus the model's own
            # error, well below 1e-9 s_y per sd of query distance at amplify 1e6
            tol = bound + (1e-9 * scale * (y[i] / scale).std() * far if name == "ln-closed-form" else 0.0)
            assert abs(float(pred[i]) - exact) <= tol, (name, i, float(pred[i]), exact, tol)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.integers(2, 4), st.integers(0, 6), st.integers(0, 10**6),
       st.sampled_from([10.0 ** k for k in range(10)]), st.sampled_from([10.0 ** k for k in range(-150, 151, 25)]))
def test_scipy_lstsq_agrees_with_exact_property(d, extra, seed, offset, scale):
    x, y, u, z, zu = _prompts(d, offset, scale, seed, B=1, N=d + 2 + extra)
    b = make_batch_mv(x, y, u, R=100.0)
    fit = ols_fit_mv(b.x, b.y)
    got = float(scipy_lstsq_mv(b)[0])
    if bool(fit["ill_posed"][0]):  # NaN exactly where the reference's conditioning rule says so
        assert np.isnan(got) and np.isnan(float(b.ols_prediction[0]))
        return
    exact = float(exact_prediction_mv(x[0], y[0], u[0]))
    assert abs(got - exact) <= _bound(fit, 0, x[0], y[0], zu[0], z[0], exact)[0]


def test_scipy_lstsq_near_a_large_offset():
    # the review's case: lstsq on the raw [1, X] gave 0.0135 for -0.4785 (relative error 29)
    rng = np.random.default_rng(0)
    x = 1e8 + rng.standard_normal((1, 20, 2))
    y = (x - 1e8) @ np.array([1.0, -2.0]) + 0.1 * rng.standard_normal((1, 20))
    u = 1e8 + np.array([[0.5, 0.5]])
    b = make_batch_mv(x, y, u, R=100.0)
    exact = float(exact_prediction_mv(x[0], y[0], u[0]))
    assert float(scipy_lstsq_mv(b)[0]) == pytest.approx(exact, rel=1e-9)
    assert float(b.ols_prediction[0]) == pytest.approx(exact, rel=1e-9)


def test_reference_near_the_overflow_threshold_answers_and_never_fails_the_batch():
    # the review's case: the shift (a plain mean of 1e308 values) overflowed, svdvals raised
    b = make_batch_mv([[[1e308, 0.0], [1e308, 1.0], [0.0, 2.0], [0.0, 4.0]]], [[0.0, 1.0, 2.0, 3.0]], [[0.0, 3.0]], R=100.0)
    assert float(b.ols_prediction[0]) == 2.5  # the exact answer (exact_prediction_mv)
    # one batch: huge x, huge y, a NaN in x, an infinite query, an ordinary prompt
    rng = np.random.default_rng(1)
    x, y, u = rng.standard_normal((5, 10, 2)), rng.standard_normal((5, 10)), rng.standard_normal((5, 2))
    x[0] *= 1.7e308 / np.abs(x[0]).max()
    y[1] *= 1.7e308 / np.abs(y[1]).max()
    x[2, 3, 1] = np.nan
    u[3, 0] = np.inf
    b = make_batch_mv(x, y, u, R=100.0)
    assert torch.isnan(b.ols_prediction[2:4]).all() and torch.isfinite(b.ols_prediction[[0, 1, 4]]).all()
    for i in (0, 1, 4):
        exact = float(exact_prediction_mv(x[i], y[i], u[i]))
        assert float(b.ols_prediction[i]) == pytest.approx(exact, rel=1e-12)
        assert float(scipy_lstsq_mv(b)[i]) == pytest.approx(exact, rel=1e-12)
        assert float(ols_mv(b)[i]) == pytest.approx(exact, rel=1e-12)
    # float32 arithmetic (the `ols` solver) near float32's range: 3e38 used to overflow the same way
    b32 = make_batch_mv(x[4:] * 3e38 / np.abs(x[4]).max(), y[4:], u[4:] * 3e38 / np.abs(x[4]).max(), R=100.0,
                        dtype="float32")
    assert float(ols_mv(b32)[0]) == pytest.approx(float(b32.ols_prediction[0]), rel=1e-4)


@pytest.mark.parametrize("scale", [1e-200, 1e200, 1e-300, 1e300])
def test_standardize_is_scale_free(scale):
    # the review's case: x = z scale, y = x . w / scale + noise; plain squares under/overflowed and
    # ln-closed-form (standardize = true) answered mean(y)
    rng = np.random.default_rng(1)
    z, zu = rng.standard_normal((8, 20, 2)), rng.standard_normal((8, 2))
    y = z @ np.array([1.0, -2.0]) + 0.1 * rng.standard_normal((8, 20))
    unit, far = make_batch_mv(z, y, zu, R=100.0), make_batch_mv(z * scale, y, zu * scale, R=100.0)
    model = build_ln_construction_mv(100.0, 2)
    ref, got = unit.ols_prediction, ln_closed_form_mv(far, model, standardize=True)
    assert torch.allclose(far.ols_prediction, ref, rtol=1e-12, atol=0)
    assert torch.allclose(got, ln_closed_form_mv(unit, model, standardize=True), rtol=1e-10, atol=1e-12)
    assert ((got - ref) ** 2).mean() < 1e-6 * ref.var()  # the construction's R = 100 error, not mean(y)
    xs, ys, us, yb, sy = standardize_mv(far.x, far.y, far.x_query)
    assert torch.allclose(xs.pow(2).mean(1), torch.ones(8, 2, dtype=torch.float64), rtol=1e-12)
    # float32: squares of 1e-30 underflow there
    f32 = make_batch_mv(z * 1e-30, y, zu * 1e-30, R=100.0, dtype="float32")
    p32 = ln_closed_form_mv(f32, build_ln_construction_mv(100.0, 2, dtype=torch.float32), standardize=True)
    assert ((p32.double() - f32.ols_prediction) ** 2).mean() < 1e-4 * f32.ols_prediction.var()


def test_outliers_among_the_first_rows_do_not_make_a_well_posed_prompt_nan():
    """The shift is the mean of the first 8 rows: eight rows at 1e3 ahead of 2e4 standard-normal
    ones gave gamma = 50, and N eps kappa gamma >= 1 made float32 `ols` answer NaN on a prompt
    with kappa = 28 (the d > 1 form of the refined shift; icl_bench/prompts/ols_mv.py step 1b)."""
    from icl_bench import get_solver

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 20000, 2, generator=g, dtype=torch.float64)
    x[:, :8] += 1e3
    y = x @ torch.tensor([1.0, -2.0], dtype=torch.float64) + 0.5 + 0.1 * torch.randn(1, 20000, generator=g, dtype=torch.float64)
    batch = make_batch_mv(x.numpy(), y.numpy(), np.array([[0.5, 0.5]]), R=100.0, dtype="float32")
    fit = ols_fit_mv(batch.x, batch.y, torch.float32)
    assert float(fit["gamma"][0]) <= 2.0 and not bool(fit["ill_posed"][0])
    ref = float(batch.ols_prediction[0])
    assert abs(float(get_solver("ols").predict(batch)[0]) - ref) <= 1e-3 * max(1.0, abs(ref))


def test_a_query_far_beyond_tiny_data_is_answered_for_d_above_1():
    """x ~ 1e-300 (d = 3), u = (1e10, 0, 0): the answer 1e10 is in range but u 2^-kx overflowed,
    and the reference answered NaN since its per-column scaling (found by a review)."""
    from icl_bench.prompts.ols_mv import ols_predict_mv

    g = torch.Generator().manual_seed(0)
    x = 1e-300 * torch.randn(1, 50, 3, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([1.0, 2.0, -1.0], dtype=torch.float64)
    pred = ols_predict_mv(x, y, torch.tensor([[1e10, 0.0, 0.0]], dtype=torch.float64))
    assert float(pred[0]) == pytest.approx(1e10, rel=1e-9)


def test_scipy_lstsq_answers_a_query_far_beyond_tiny_data_for_d_above_1():
    """x ~ 1e-300 (d = 2), u = (1e10, 1e10), answer 3e10: scipy-lstsq answered NaN, lacking the
    reference's fallback to intercept + slope . u (found by a numerical review)."""
    from icl_bench import get_solver

    p = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 1.0]])
    batch = make_batch_mv((p * 1e-300)[None], ((p[:, 0] + 2 * p[:, 1]) * 1e-300)[None], np.array([[1e10, 1e10]]), R=100.0)
    assert float(batch.ols_prediction[0]) == pytest.approx(3e10, rel=1e-12)
    assert float(get_solver("scipy-lstsq").predict(batch)[0]) == pytest.approx(3e10, rel=1e-12)


@pytest.mark.parametrize("dtype, scale, far", [("float64", 1e-10, 3e298), ("float32", 1e-20, 5e18)])
def test_the_far_query_fallback_sums_without_overflowing_a_term(dtype, scale, far):
    """x = p scale, y = 8 p_1 - 7.5 p_2, u = (far, far): the answer (1.5e308; 2.5e38 in float32) is in
    range, but the fallback's terms u_j beta_j overflow one by one (inf - inf = NaN, found by a
    numerical review); dot_scaled sums them in units of the largest exponent."""
    from icl_bench import get_solver
    from icl_bench.prompts.ols_mv import dot_scaled

    p = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    batch = make_batch_mv((p * scale)[None], (8 * p[:, 0] - 7.5 * p[:, 1])[None], np.array([[far, far]]), R=100.0, dtype=dtype)
    exact = float(exact_prediction_mv(batch.x[0].double().numpy(), batch.y[0].double().numpy(), batch.x_query[0].double().numpy()))
    assert float(batch.ols_prediction[0]) == pytest.approx(exact, rel=1e-9)
    for name in ("ols", "scipy-lstsq"):
        assert float(get_solver(name).predict(batch)[0]) == pytest.approx(exact, rel=1e-4), name
    a = torch.tensor([[1e300, 1e300]], dtype=torch.float64)
    assert float(dot_scaled(a, torch.tensor([[1e10, -1e10]], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64))[0]) == 1.0
    f32 = torch.tensor([[3e38, 3e38]], dtype=torch.float32)  # exponents beyond ldexp's float32 range: 0, not NaN
    assert float(dot_scaled(f32, f32 * torch.tensor([[1.0, -1.0]]), torch.zeros(1))[0]) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("N,d", [(67, 3), (1001, 3), (333, 7), (50, 9), (200, 47), (100, 39)])
def test_the_reference_of_a_prompt_does_not_depend_on_its_batch_for_d_above_1(dtype, N, d):
    """LAPACK's QR and SVD and bmm's Q^T y differed in the last bits with a prompt's slot in the
    batch (its rows' alignment): up to 39 of 40 prompts at N = 1001 got another reference alone
    than in a batch (found by a review). Rows and R are now padded to whole 64-byte lines, for the
    triangular solve too (MKL's differed from d = 35; a review of the fix)."""
    from icl_bench.prompts.ols_mv import ols_predict_mv

    g = torch.Generator().manual_seed(N * d)
    x = torch.randn(40, N, d, generator=g, dtype=dtype) * 3 + 1
    y = torch.randn(40, N, generator=g, dtype=dtype)
    u = torch.randn(40, d, generator=g, dtype=dtype)
    full, fit = ols_predict_mv(x, y, u, dtype), ols_fit_mv(x, y, dtype)
    alone = [ols_fit_mv(x[i:i + 1], y[i:i + 1], dtype) for i in range(40)]
    assert torch.equal(full, torch.cat([ols_predict_mv(x[i:i + 1], y[i:i + 1], u[i:i + 1], dtype) for i in range(40)]))
    assert torch.equal(fit["kappa"], torch.cat([a["kappa"] for a in alone]))  # (the NaN rule's input)
    perm = torch.randperm(40, generator=g)
    assert torch.equal(ols_predict_mv(x[perm], y[perm], u[perm], dtype), full[perm])
    assert torch.equal(ols_predict_mv(x[3:10], y[3:10], u[3:10], dtype), full[3:10])


def test_the_reference_for_d_above_1_is_differentiable():
    """QR in mode "r" (R only) has no derivative: ols_predict_mv under autograd raised (a review);
    with grad it runs the reduced QR, whose R is the same."""
    from icl_bench.prompts.ols_mv import ols_predict_mv

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 12, 2, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(3, 12, generator=g, dtype=torch.float64, requires_grad=True)
    u = torch.randn(3, 2, generator=g, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: ols_predict_mv(a, b, u), (x, y))
    assert torch.equal(ols_predict_mv(x, y, u).detach(), ols_predict_mv(x.detach(), y.detach(), u))
