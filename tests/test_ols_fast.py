"""The one-pass, chunked OLS reference (icl_bench.prompts.ols): accuracy, chunk edges, NaN rules, autograd.

Accuracy is judged against a long-double two-pass computation (numpy.longdouble, 64-bit mantissa
on x86) and against scipy.stats.linregress; these are correctness checks, not timings.
"""
import numpy as np
import pytest
import scipy.stats
import torch

import icl_bench.prompts.ols as ols_mod
from icl_bench import PromptSpec, sample_prompts
from icl_bench.prompts.ols import ols_fit, ols_predict


def exact_ols(x: torch.Tensor, y: torch.Tensor, u: torch.Tensor) -> np.ndarray:
    """Two-pass OLS prediction in long double on the given (already rounded) values. (B,)"""
    xl, yl, ul = (t.double().numpy().astype(np.longdouble) for t in (x, y, u))
    xc = xl - xl.mean(1)[:, None]
    yc = yl - yl.mean(1)[:, None]
    slope = (xc * yc).sum(1) / (xc * xc).sum(1)
    return (yl.mean(1) + slope * (ul - xl.mean(1))).astype(np.float64)


def rel_err(pred: torch.Tensor, ref: np.ndarray) -> float:
    ref_t = torch.from_numpy(ref)
    return float(((pred.double() - ref_t).abs() / ref_t.abs().clamp_min(1.0)).max())


def shifted(B, N, loc, dtype, seed=0):
    """x ~ N(loc, 1), y = 2 + 0.5 x + 0.1 noise, u ~ N(loc, 1): |x_bar| >> sd(x) when loc is large."""
    g = torch.Generator().manual_seed(seed)
    x = loc + torch.randn(B, N, generator=g, dtype=torch.float64)
    y = 2.0 + 0.5 * x + 0.1 * torch.randn(B, N, generator=g, dtype=torch.float64)
    u = loc + torch.randn(B, generator=g, dtype=torch.float64)
    return x.to(dtype), y.to(dtype), u.to(dtype)


@pytest.mark.parametrize("N", [10, 30, 100, 300])
@pytest.mark.parametrize("noise", [0.0, 0.1, 0.5])
def test_float64_matches_scipy_linregress_to_1e12_on_the_default_grid(N, noise):
    batch = sample_prompts(PromptSpec(N=N, noise=noise), 64, seed=N, dtype="float64")
    pred = ols_predict(batch.x, batch.y, batch.x_query)
    ref = []
    for x, y, u in zip(batch.x.numpy(), batch.y.numpy(), batch.x_query.numpy()):
        fit = scipy.stats.linregress(x, y)
        ref.append(fit.intercept + fit.slope * u)
    assert rel_err(pred, np.array(ref)) <= 1e-12


@pytest.mark.parametrize("loc", [0.0, 10.0, 1e3])
@pytest.mark.parametrize("N", [100, 1000, 4000])
def test_float64_accurate_when_mean_dwarfs_spread(loc, N):
    x, y, u = shifted(64, N, loc, torch.float64)
    assert rel_err(ols_predict(x, y, u), exact_ols(x, y, u)) <= 1e-12


@pytest.mark.parametrize("loc", [0.0, 10.0, 30.0])
def test_float32_no_worse_than_textbook_two_pass(loc):
    # the textbook two-pass formula in float32 is the yardstick; the naive one-pass
    # sum x^2 - N x_bar^2 shows what cancellation costs (and that the check is not vacuous)
    N = 1000
    x, y, u = shifted(256, N, loc, torch.float32)
    ref = exact_ols(x, y, u)
    ours = rel_err(ols_predict(x, y, u), ref)
    xc = x - x.mean(1, keepdim=True)
    textbook = y.mean(1) + (xc * (y - y.mean(1, keepdim=True))).sum(1) / (xc * xc).sum(1) * (u - x.mean(1))
    assert ours <= 2.0 * rel_err(textbook, ref) + 1e-6
    if loc >= 10:
        sxx = (x * x).sum(1) - N * x.mean(1) ** 2
        sxy = (x * y).sum(1) - N * x.mean(1) * y.mean(1)
        naive = y.mean(1) + sxy / sxx * (u - x.mean(1))
        assert rel_err(naive, ref) > 10 * ours


@pytest.mark.parametrize("chunk", [1, 64, 1000, 1 << 30])
def test_chunking_does_not_change_the_answer(monkeypatch, chunk):
    # chunks of 1 prompt, uneven chunks (64 // 10 = 6 rows, 37 = 6*6 + 1), one chunk; N > chunk
    for B, N in ((37, 10), (5, 2000)):
        x, y, u = shifted(B, N, 3.0, torch.float64, seed=B)
        monkeypatch.setattr(ols_mod, "CHUNK_ELEMENTS", 1 << 30)
        whole = ols_predict(x, y, u)
        monkeypatch.setattr(ols_mod, "CHUNK_ELEMENTS", chunk)
        assert torch.allclose(ols_predict(x, y, u), whole, rtol=1e-14, atol=0)


def test_nan_rules_stay_in_their_prompt():
    x, y, u = shifted(6, 20, 0.0, torch.float64)
    x[1] = 2.5  # all x equal: no unique slope
    x[2, 3] = float("nan")
    y[3, 0] = float("inf")
    u[4] = float("nan")
    y[5] = 4.0  # constant y: a valid fit with slope 0
    x_bar, y_bar, slope, intercept = ols_fit(x, y)
    pred = ols_predict(x, y, u)
    assert torch.isnan(slope[1]) and torch.isnan(intercept[1])
    assert not torch.isfinite(pred[1:5]).any()
    assert torch.isfinite(pred[[0, 5]]).all() and pred[5] == pytest.approx(4.0)
    assert rel_err(pred[[0]], exact_ols(x[[0]], y[[0]], u[[0]])) <= 1e-13


def test_ill_posed_marks_each_non_finite_value_alone_in_its_prompt():
    """ill_posed: a NaN, +inf or -inf in x, y or the query, alone in its prompt, or all x equal;
    an ordinary prompt is not (a mutation review: a +inf in y alone passed as well-posed, since
    ols_predict's NaN there comes from its sums)."""
    from icl_bench.prompts.ols import ill_posed

    x = torch.arange(5, dtype=torch.float64).repeat(11, 1)
    y, u = 2.0 * x + 1.0, torch.full((11,), 0.5, dtype=torch.float64)
    for i, v in enumerate((float("nan"), float("inf"), float("-inf"))):
        x[i, 2], y[3 + i, 2], u[6 + i] = v, v, v
    x[9] = 1.5
    assert ill_posed(x, y, u).tolist() == [True] * 10 + [False]


def test_flat_prompt_detected_in_both_dtypes():
    for dtype in (torch.float32, torch.float64):
        x = torch.full((3, 50), 0.1, dtype=dtype)
        x[2] += torch.linspace(0, 1, 50, dtype=dtype)  # one healthy prompt
        y = torch.randn(3, 50, dtype=dtype)
        slope = ols_fit(x, y)[2]
        assert torch.isnan(slope[:2]).all() and torch.isfinite(slope[2])


def test_autograd_path_gives_the_same_values_and_a_gradient():
    x, y, u = shifted(8, 40, 1.0, torch.float64)
    x.requires_grad_(True)
    with_grad = ols_predict(x, y, u)
    with_grad.sum().backward()
    with torch.no_grad():
        plain = ols_predict(x, y, u)
    assert torch.allclose(with_grad.detach(), plain, rtol=1e-13, atol=1e-13)
    assert x.grad is not None and torch.isfinite(x.grad).all()
