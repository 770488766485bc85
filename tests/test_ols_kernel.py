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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("N", [67, 70, 101, 1001])
def test_the_reference_of_a_prompt_does_not_depend_on_its_batch(dtype, N):
    """ols_predict packs a chunk of prompts into one buffer for bmm, whose sums differed in the
    last bits for a prompt at an odd slot (its rows' alignment), from N = 67: the same prompt got
    another reference alone than in a batch, and `ols`'s mse_vs_ols moved by 30 % with batch_size
    in float32 (found by a review). Rows are now padded to whole 64-byte lines."""
    from icl_bench.prompts.ols import ols_predict

    g = torch.Generator().manual_seed(N)
    x = torch.randn(40, N, generator=g, dtype=dtype) + 3
    y, u = torch.randn(40, N, generator=g, dtype=dtype), torch.randn(40, generator=g, dtype=dtype)
    full = ols_predict(x, y, u)
    alone = torch.cat([ols_predict(x[i:i + 1], y[i:i + 1], u[i:i + 1]) for i in range(40)])
    assert torch.equal(full, alone)
    perm = torch.randperm(40, generator=g)
    assert torch.equal(ols_predict(x[perm], y[perm], u[perm]), full[perm])
    xg = x.clone().requires_grad_(True)  # the autograd branch pads its rows the same way (a review)
    grad = ols_predict(xg, y, u).detach()
    assert torch.equal(grad, torch.cat([ols_predict(xg[i:i + 1], y[i:i + 1], u[i:i + 1]).detach() for i in range(40)]))


def test_mixed_dtypes_are_computed_and_answered_in_the_dtype_of_x():
    """A float64 y beside a float32 x was rounded to float32 silently and the answer promoted to
    float64 (found by a review); the docstrings promise x's dtype."""
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    y = torch.tensor([[0.1, 1.3, 2.2, 3.7]], dtype=torch.float64)
    for u in (torch.tensor([1.5]), torch.tensor([1.5], dtype=torch.float64)):
        for f in (ols_predict, fast_ols_predict):
            r = f(x, y, u)
            assert r.dtype == torch.float32 and torch.equal(r, ols_predict(x, y.float(), u.float())), f


def test_float32_answers_in_range_from_subnormal_x_are_given():
    """Subnormal float32 x (2^-149) are scaled up by at most 2^104, and slope * u then overflowed:
    float32 `ols` answered NaN for 7.1e37, in range (found by a review). Such prompts are answered
    in float64 and rounded once; an answer beyond float32 stays NaN."""
    from icl_bench import get_solver, make_batch
    from icl_bench.training.train import _flushing

    assert not _flushing(), "subnormals flushed to 0 in this process (an earlier test left it on)"
    for u, want in ((0.1, 7.136238546924577e37), (1e-3, 7.136239053984817e35), (1e10, None)):
        b = make_batch([1.4e-45, 2.8e-45], [1e-6, 2e-6], u, R=100.0, dtype="float32")
        for got in (get_solver("ols").predict(b), ols_predict(b.x, b.y, b.x_query)):
            assert got.dtype == torch.float32
            if want is None:
                assert torch.isnan(got).all()
            else:
                assert got.item() == pytest.approx(want, rel=1e-6), got


@needs_numba
@pytest.mark.parametrize("dtype, y_scale", [("float64", 1e-310), ("float64", 1e200), ("float32", 1e-40), ("float32", 1e18)])
def test_ols_prompts_whose_y_lies_outside_the_fast_range_are_the_references(dtype, y_scale):
    """The kernel answers a prompt only when both sums of squares, sum x'^2 and sum y'^2, lie in
    the reference's fast range [1/r, r]; the others are ols_predict's answers, bit for bit
    (module docstring of fused_ols.py). With y subnormal (or y'^2 beyond r) the kernel's own
    answers were 2 to 4 times further from a long-double OLS than the reference's."""
    from icl_bench.solvers.fused_ols import fast_ols_predict

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 30, generator=g, dtype=torch.float64)
    y = y_scale * (2.0 + 0.5 * torch.randn(64, 30, generator=g, dtype=torch.float64))
    u = torch.randn(64, generator=g, dtype=torch.float64)
    x, y, u = (t.to(getattr(torch, dtype)) for t in (x, y, u))
    ref = ols_predict(x, y, u)
    assert torch.isfinite(ref).all()
    assert torch.equal(fast_ols_predict(x, y, u), ref)
