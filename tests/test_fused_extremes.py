"""The extremes the fused kernel reads on its way (fused_forward's `extremes`): each prompt's
least and largest context x and y, and the screens built from them (icl_bench.solvers.base.screens)
against the torch screens they replace (ill_posed, ill_posed_or_r_lost)."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from icl_bench import make_batch
from icl_bench.prompts.ols import ill_posed
from icl_bench.solvers import fused
from icl_bench.solvers.base import ill_posed_or_r_lost, r_lost, screen_answers, screens
from icl_bench.solvers.fused_screens import apply_screens
from icl_bench.solvers.ln_closed_form import build_construction
from icl_bench.solvers.registry import get_solver
from tests.transformer_models import random_model, tokens

needs_numba = pytest.mark.skipif(not fused.available(), reason="numba is not installed: no fused path to test")


def torch_extremes(t: torch.Tensor) -> torch.Tensor:
    """(B, 4): x_min, x_max, y_min, y_max over the context tokens (all but the last) of t (B, N+1, 3)."""
    x, y = t[:, :-1, 0], t[:, :-1, 1]
    return torch.stack([x.amin(1), x.amax(1), y.amin(1), y.amax(1)], 1)


def hostile_tokens(N: int, dtype: torch.dtype) -> torch.Tensor:
    """(8, N+1, 3) tokens whose query and pads would change the extremes if the kernel counted
    them: every context y > 0 (the query's y slot and the pads are 0) and a query x far outside
    the context's; plus prompts with NaN, +-inf, all x equal, a huge value, a negative zero, and
    a NaN query."""
    t = tokens(B=8, N=N, dtype=dtype, seed=N)
    t[:, :-1, 1] = t[:, :-1, 1].abs() + 1.0
    t[:, -1, 0] = 1e6
    t[1, N // 2, 0] = float("nan")
    t[2, N - 1, 1] = float("inf")
    t[3, 0, 0] = -float("inf")
    t[4, :-1, 0] = 2.5  # all x equal
    t[5, N - 1, 0] = 1e30  # R lost beside it
    t[6, 0, 0] = -0.0
    t[7, -1, 0] = float("nan")  # a non-finite query: the context's extremes stay finite
    return t


@needs_numba
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["dense", "sparse"])
@pytest.mark.parametrize("keys", ["masked", "query-in-context"])
@pytest.mark.parametrize("N", [2, 15, 16, 17, 31, 32, 47])  # around the blocks of 16 tokens; N + 1 = 16, 32, 48
def test_kernel_extremes_equal_torch_amin_amax(dtype, kind, keys, N):
    if kind == "dense":
        m = random_model(keys, True, "query", n_layers=2, dtype=dtype)
    else:
        m = build_construction(R=1.5, variant=keys, dtype=dtype)
    t = hostile_tokens(N, dtype)
    ext = torch.full((8, 4), 7.0, dtype=dtype)
    with torch.no_grad():
        out = fused.fused_forward(m, t, extremes=ext)
    assert out is not None
    ref = torch_extremes(t)
    bad = ~torch.isfinite(ref).all(1)  # (B,) a NaN or inf among the context's x and y
    assert bad.tolist() == [False, True, True, True, False, False, False, False]
    assert torch.isnan(ext[bad]).all()  # all four NaN: such a prompt is ill-posed
    assert torch.equal(ext[~bad], ref[~bad])  # exact (== treats -0 and +0 alike)
    assert (ext[~bad][:, 2] >= 1.0).all() and (ext[~bad][:, 1] != 1e6).all()  # no query, no pad among them


@needs_numba
def test_extremes_of_each_prompt_with_threads(monkeypatch):
    """Each thread's share writes its own prompts' extremes (the lanes are reset between prompts)."""
    m = build_construction(R=1.5)
    t = hostile_tokens(40, torch.float64)
    t = torch.cat([t, t.flip(0), t], 0)  # (24, 41, 3)
    monkeypatch.setattr(fused, "MIN_WORK_PER_THREAD", 1)
    got = {}
    for threads in (1, 3):
        monkeypatch.setattr(fused, "THREADS", threads)
        got[threads] = torch.empty(24, 4, dtype=torch.float64)
        with torch.no_grad():
            fused.fused_forward(m, t, extremes=got[threads])
    torch.testing.assert_close(got[1], got[3], rtol=0, atol=0, equal_nan=True)
    ok = torch.isfinite(torch_extremes(t)).all(1)
    assert torch.equal(got[3][ok], torch_extremes(t)[ok])


@needs_numba
def test_fused_forward_refuses_extremes_of_the_wrong_shape_or_dtype():
    m = random_model(n_layers=1)
    t = tokens(B=5, N=20)
    for bad in (torch.empty(5, 3, dtype=torch.float64), torch.empty(4, 4, dtype=torch.float64),
                torch.empty(5, 4, dtype=torch.float32), torch.empty(4, 5, dtype=torch.float64).t(),
                torch.empty(5, 4, dtype=torch.float64, device="meta")):
        with torch.no_grad(), pytest.raises(ValueError, match="extremes"):
            fused.fused_forward(m, t, extremes=bad)
    with torch.no_grad(), pytest.raises(ValueError, match="extremes"):  # refused before an empty batch returns
        fused.fused_forward(m, t[:0], extremes=torch.empty(1, 4, dtype=torch.float64))


values = st.one_of(st.floats(-3, 3, allow_subnormal=False),
                   st.sampled_from([0.0, -0.0, 1e30, -1e30, 1e17, 3e38, -3.3e38, 1e-310, 1e300, float("nan"),
                                    float("inf"), -float("inf"), 2.5]))


@needs_numba
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(N=st.integers(2, 40), data=st.data(), dtype=st.sampled_from(["float32", "float64"]),
       R=st.sampled_from([1.0, 100.0, 1e4]))
def test_screens_from_the_kernel_equal_the_torch_screens(N, data, dtype, R):
    """screens(kernel extremes) == ill_posed(x, y, u) | r_lost(tokens, R) (each its own pass) and
    == ill_posed_or_r_lost; without R, == ill_posed: NaN, inf, all-equal x, a value so large that
    R is lost, signed zeros, subnormals, values that overflow float32."""
    B = 4
    f64 = torch.float64  # (the batch casts to dtype: 3e38 and 1e300 overflow float32, 1e-310 is 0 there)
    x = torch.tensor(data.draw(st.lists(values, min_size=B * N, max_size=B * N)), dtype=f64).reshape(B, N)
    y = torch.tensor(data.draw(st.lists(values, min_size=B * N, max_size=B * N)), dtype=f64).reshape(B, N)
    if data.draw(st.booleans()):
        x[0] = x[0, 0]  # all x equal
    u = torch.tensor(data.draw(st.lists(values, min_size=B, max_size=B)), dtype=f64)
    batch = make_batch(x, y, u, R=R, dtype=dtype)
    m = build_construction(R=R, dtype=batch.dtype)
    ext = torch.empty(B, 4, dtype=batch.dtype)
    with torch.no_grad():
        assert fused.fused_forward(m, batch.tokens, extremes=ext) is not None
    got = screens(*ext.unbind(1), batch.x_query, R)
    assert got.tolist() == (ill_posed(batch.x, batch.y, batch.x_query) | r_lost(batch.tokens, R)).tolist()
    assert got.tolist() == ill_posed_or_r_lost(batch.x, batch.y, batch.x_query, R).tolist()
    assert screens(*ext.unbind(1), batch.x_query).tolist() == ill_posed(batch.x, batch.y, batch.x_query).tolist()


edges = [r * 2.0**k for r in (1.0, 100.0, 1e4) for k in (23, 52)]  # |value| * eps == R exactly (float32, float64)
screen_values = st.one_of(values, st.sampled_from(edges + [math.nextafter(e, 0.0) for e in edges]
                                                  + [-e for e in edges]))


@needs_numba
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), dtype=st.sampled_from([torch.float32, torch.float64]),
       R=st.sampled_from([None, 1.0, 100.0, 1e4, 1e39]), use_ols=st.booleans(), inf_is_nan=st.booleans())
def test_numba_screens_equal_the_torch_screens(data, dtype, R, use_ols, inf_is_nan):
    """apply_screens (one numba pass) == pred.masked_fill(screens(...) | ~isfinite(ols) |
    isinf(pred), NaN) in torch, for any extremes (consistent or not), queries, answers and OLS
    values: NaN, inf, signed zeros, ties, values at and just below |value| * eps = R, an R
    beyond float32's range."""
    B = 12
    draw = lambda n: torch.tensor(data.draw(st.lists(screen_values, min_size=n, max_size=n)),  # noqa: E731
                                  dtype=torch.float64)
    ext, u, pred, ols = draw(4 * B).reshape(B, 4).to(dtype), draw(B).to(dtype), draw(B).to(dtype), draw(B)
    if data.draw(st.booleans()):
        ext[:4, 1] = ext[:4, 0]  # x_min == x_max: all x equal
    got = apply_screens(pred, ext, u, R, ols if use_ols else None, inf_is_nan)
    bad = screens(*ext.unbind(1), u, R)
    if use_ols:
        bad |= ~torch.isfinite(ols)
    if inf_is_nan:
        bad |= torch.isinf(pred)
    want = pred.masked_fill(bad, float("nan"))
    assert got is not None and got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_numba_screens_step_aside_where_they_do_not_apply(monkeypatch):
    """None (the caller runs the torch screens) for mixed dtypes, a float16 answer, and with the
    fused path disabled."""
    e, u, p = torch.zeros(3, 4), torch.zeros(3), torch.zeros(3)
    assert apply_screens(p, e.double(), u, 1.0) is None
    assert apply_screens(p.half(), e.half(), u.half(), 1.0) is None
    assert apply_screens(p, e, u, 1.0, ols=torch.zeros(3)) is None  # the OLS reference is float64
    monkeypatch.setattr(fused, "ENABLED", False)
    assert apply_screens(p, e, u, 1.0) is None


@needs_numba
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_screen_answers_are_the_same_in_torch_and_numba(dtype, monkeypatch):
    """base.screen_answers gives the same answers on the torch path (apply_screens steps aside)."""
    g = torch.Generator().manual_seed(3)
    ext, u, pred = torch.randn(40, 4, generator=g, dtype=dtype), torch.randn(40, generator=g, dtype=dtype), \
        torch.randn(40, generator=g, dtype=dtype)
    ext[1, 0], ext[2, 3], ext[3, 1], u[4], pred[5] = float("nan"), float("inf"), ext[3, 0], float("nan"), float("inf")
    ext[6, 1] = 1e30  # R = 100 lost beside it
    ols = torch.randn(40, generator=g, dtype=torch.float64)
    ols[7] = float("inf")
    fast = screen_answers(pred, ext, u, 100.0, ols, inf_is_nan=True)
    monkeypatch.setattr(fused, "ENABLED", False)  # apply_screens -> None: the torch screens
    slow = screen_answers(pred, ext, u, 100.0, ols, inf_is_nan=True)
    assert torch.isnan(fast).nonzero().flatten().tolist() == [1, 2, 3, 4, 5, 6, 7]
    torch.testing.assert_close(fast, slow, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("args, match", [
    ((torch.zeros(3, 1), torch.zeros(3, 4), torch.zeros(3)), "pred must be 1-D"),
    ((torch.zeros(3), torch.zeros(2, 4), torch.zeros(3)), r"extremes must be \(3, 4\), got shape \(2, 4\)"),
    ((torch.zeros(3), torch.zeros(3, 3), torch.zeros(3)), r"extremes must be \(3, 4\)"),
    ((torch.zeros(3), torch.zeros(3, 4), torch.zeros(4)), r"u must be \(3,\), got shape \(4,\)"),
    ((torch.zeros(3), torch.zeros(3, 4), torch.zeros(3), 1.0, torch.zeros(5, dtype=torch.float64)), r"ols must be \(3,\)"),
])
def test_numba_screens_refuse_shapes_that_do_not_fit(args, match):
    """The loop reads B rows of each input without bounds checks: mismatched shapes are refused."""
    with pytest.raises(ValueError, match=match):
        apply_screens(*args)


@needs_numba
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", ["ln-closed-form", "gd-lsa", "trained-l1", "trained-nol1", "trained-lsa",
                                  "trained-l1-noaug"])
def test_solvers_answer_nan_at_the_same_prompts_on_both_paths(name, dtype, monkeypatch):
    """The solvers that take the screens from the kernel give the eager path's answers, NaN at the
    same prompts (all x equal, NaN, inf, R lost), on two threads as on one."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(40, 30, generator=g, dtype=torch.float64), torch.randn(40, 30, generator=g, dtype=torch.float64)
    x[5] = 2.0
    y[17, 29] = float("nan")
    x[22, 3] = float("inf")
    x[30, 0] = 1e30  # R = 100 lost beside it (float64 and float32)
    u = torch.randn(40, generator=g, dtype=torch.float64)
    u[35] = float("nan")
    batch = make_batch(x, y, u, R=100.0, dtype=dtype)
    solver = get_solver(name)
    try:
        solver.check_batch(batch)
    except Exception as exc:  # noqa: BLE001 - a trained solver without a checkpoint for this cell
        pytest.fail(f"{name}: {exc}")
    before = fused.calls
    fast = solver.predict(batch)
    assert fused.calls > before  # the fused path ran
    monkeypatch.setattr(fused, "MIN_WORK_PER_THREAD", 1)
    monkeypatch.setattr(fused, "THREADS", 2)
    torch.testing.assert_close(solver.predict(batch), fast, rtol=0, atol=0, equal_nan=True)
    monkeypatch.setattr(fused, "ENABLED", False)
    slow = solver.predict(batch)
    assert torch.isnan(fast).nonzero().flatten().tolist() == [5, 17, 22, 30, 35]
    tol = 1e-9 if dtype == "float64" else 1e-3
    torch.testing.assert_close(fast, slow, rtol=tol, atol=tol, equal_nan=True)


@needs_numba
def test_tokens_one_value_wide_have_no_extremes():
    """A model reading tokens of width 1 runs without a screen (no y slot to read) and says so."""
    from icl_bench.solvers.transformer import Transformer, TransformerConfig

    m = Transformer(TransformerConfig(d_in=1, d_model=3, n_layers=1, n_heads=1)).double().eval()
    t = torch.randn(6, 21, 1, dtype=torch.float64)
    with torch.no_grad():
        out, ext = m.forward_extremes(t)
        assert ext is None and torch.allclose(out, m.forward_eager(t), rtol=1e-12, atol=1e-12)
        with pytest.raises(ValueError, match="d_in = 1"):
            fused.fused_forward(m, t, extremes=torch.empty(6, 4, dtype=torch.float64))
