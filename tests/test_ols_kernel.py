"""The numba OLS path (icl_bench/solvers/fused_ols.py, used by `ols` and ln-closed-form) against the reference icl_bench.prompts.ols.ols_predict:
the same values, and NaN exactly where the reference says a prompt is ill-posed."""
import pytest
import torch

from icl_bench.solvers.fused_ols import SCREEN, fast_ols_predict
from icl_bench import PromptSpec, sample_prompts
from icl_bench.solvers import fused
from icl_bench.prompts.ols import ols_predict

needs_numba = pytest.mark.skipif(not fused.available(), reason="numba is not installed: no kernel to test")


@needs_numba
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-12), ("float32", 1e-5)])
@pytest.mark.parametrize("N", [2, 3, 8, 100, 1001])
def test_kernel_equals_reference(dtype, tol, N):
    b = sample_prompts(PromptSpec(N=N, noise=0.1, R=100.0), 300, seed=3, dtype=dtype)
    fast, ref = fast_ols_predict(b.x, b.y, b.x_query), ols_predict(b.x, b.y, b.x_query)
    assert fast.dtype == ref.dtype
    assert torch.equal(torch.isnan(fast), torch.isnan(ref))
    ok = ~torch.isnan(ref)
    assert ((fast[ok] - ref[ok]).abs() / ref[ok].abs().clamp_min(1.0)).max() <= tol


@needs_numba
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_ill_posed_prompts_follow_the_reference(dtype):
    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    x = torch.randn(12, 50, generator=g, dtype=torch.float64).to(dt)
    y = torch.randn(12, 50, generator=g, dtype=torch.float64).to(dt)
    u = torch.randn(12, generator=g, dtype=torch.float64).to(dt)
    x[0] = 2.5  # all x equal
    x[1] = 1000.0 + 1e-9 * torch.arange(50)  # equal up to rounding
    x[2] = 1000.0 + 0.01 * torch.arange(50)  # clear spread, but below the screen: the reference answers
    x[3, 7] = float("nan")
    y[4, 0] = float("inf")
    u[5] = float("inf")
    x[6] *= 1e30  # huge
    y[7] *= 1e38 if dtype == "float32" else 1e300  # may overflow
    fast, ref = fast_ols_predict(x, y, u), ols_predict(x, y, u)
    assert torch.equal(torch.isnan(fast), torch.isnan(ref)), (fast, ref)
    assert torch.isnan(fast[[0, 3, 4, 5]]).all() and torch.isfinite(fast[[8, 9]]).all()
    if dtype == "float64":  # in float32 row 2's spread (1e-8 of sum x^2) is below the reference's N * eps
        assert torch.isfinite(fast[2])
    ok = ~torch.isnan(ref)
    assert torch.allclose(fast[ok], ref[ok], rtol=1e-4 if dtype == "float32" else 1e-10)
    assert SCREEN < 1


def test_falls_back_without_numba_or_with_gradients(monkeypatch):
    b = sample_prompts(PromptSpec(N=20), 16, seed=0, dtype="float64")
    ref = ols_predict(b.x, b.y, b.x_query)
    x = b.x.clone().requires_grad_(True)
    out = fast_ols_predict(x, b.y, b.x_query)
    assert out.requires_grad and torch.allclose(out, ref)
    monkeypatch.setattr(fused, "numba", False)
    assert torch.equal(fast_ols_predict(b.x, b.y, b.x_query), ref)
