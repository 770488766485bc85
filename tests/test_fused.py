"""The fused CPU forward (icl_bench/solvers/fused.py) against the eager torch forward and a long-double
reference: every config, float64 agreement, float32 error-vs-R shape, fallbacks, threads."""
import dataclasses

import numpy as np
import pytest
import torch

from icl_bench import PromptSpec, sample_prompts
from icl_bench.solvers import fused, fused_pattern, fused_source
from icl_bench.solvers.gd_lsa import build_gd_construction
from icl_bench.solvers.ln_closed_form import build_construction
from icl_bench.solvers.transformer import Transformer
from tests.transformer_models import random_model, tokens

needs_numba = pytest.mark.skipif(not fused.available(), reason="numba is not installed: no fused path to test")


def longdouble_forward(m: Transformer, t: torch.Tensor) -> np.ndarray:
    """The model's function in numpy long double (token-major, the docs/design.md §4 definition),
    with the model's float64 weights: (B,) np.longdouble."""
    ld = np.longdouble
    W = {k: v.detach().double().numpy().astype(ld) for k, v in m.named_parameters()}
    h = t.double().numpy().astype(ld) @ W["embed.weight"].T  # (B, T, d)
    T = h.shape[1]
    M = T - 1 if m.cfg.keys == "masked" else T
    for i in range(m.cfg.n_layers):
        w = {k: W[f"blocks.{i}.attn.W_{k}"] for k in "QKVO"}  # (H, d, d)
        k = np.einsum("bmd,hed->bhme", h[:, :M], w["K"])
        v = np.einsum("bmd,hed->bhme", h[:, :M], w["V"])
        S = np.einsum("bhme,bhmf->bhef", k, v) / M  # (B, H, d, d)
        z = np.einsum("bhte,bhef->bhtf", np.einsum("btd,hed->bhte", h, w["Q"]), S)
        a = np.einsum("bhtf,hgf->btg", z, w["O"])  # (B, T, d)
        if m.cfg.layernorm:
            c = a - a.mean(-1, keepdims=True)
            a = c / np.sqrt((c * c).mean(-1, keepdims=True) + ld(m.cfg.ln_eps)) * W[f"blocks.{i}.ln.weight"] \
                + W[f"blocks.{i}.ln.bias"]
        h = h + a
    r = W["readout.weight"][0]
    return h.reshape(h.shape[0], -1) @ r if m.cfg.readout == "flatten" else h[:, -1] @ r


@needs_numba
@pytest.mark.parametrize("keys", ["masked", "query-in-context"])
@pytest.mark.parametrize("layernorm", [True, False])
@pytest.mark.parametrize("readout", ["query", "flatten"])
@pytest.mark.parametrize("N", [2, 13, 16, 31, 40])  # around the blocks of LANES = 16 tokens
def test_fused_equals_eager_in_float64(keys, layernorm, readout, N):
    m = random_model(keys, layernorm, readout, N=N)
    t = tokens(N=N)
    with torch.no_grad():
        fast, eager = fused.fused_forward(m, t), m.forward_eager(t)
        assert fast is not None and torch.equal(m(t), fast)  # forward takes the fused path on the CPU
    assert eager.abs().max() > 1e-3
    assert torch.allclose(fast, eager, rtol=1e-12, atol=1e-12)


@needs_numba
@pytest.mark.parametrize("R", [1e3, 1e4])
def test_fused_and_eager_differ_by_rounding_that_grows_with_R(R):
    """At N = 1000 and the larger R of the grids the two paths differ by more than 1e-12 (1.3e-12 at
    R = 1e3, 1.2e-11 at 1e4, relative to max(|y|, 1)): rounding of terms of size R, so bounded by
    R * 1e-14 (README.md and docs/throughput.md quote it so; found by a review)."""
    m = build_construction(R, dtype=torch.float64)
    t = sample_prompts(PromptSpec(N=1000, noise=0.1, R=R), 256, seed=0, dtype="float64").tokens
    with torch.no_grad():
        fast, eager = fused.fused_forward(m, t), m.forward_eager(t)
    gap = ((fast - eager).abs() / eager.abs().clamp(min=1)).max().item()
    assert gap <= R * 1e-14, gap


@needs_numba
@pytest.mark.parametrize("d_model,n_heads,n_layers,layernorm", [(5, 1, 2, True), (3, 4, 2, True), (2, 1, 1, False)])
def test_other_shapes(d_model, n_heads, n_layers, layernorm):
    """Other shapes than the shipped d_model 4 / 2 heads, among them one above SPLIT_MAX (d_model 3
    with 4 heads: 36 key-value products, masked loops only) and a single key (N = 1)."""
    assert 3 * 3 * 4 > fused_source.SPLIT_MAX
    m = random_model(d_model=d_model, n_heads=n_heads, n_layers=n_layers, layernorm=layernorm, ln_sum="slots")
    t = tokens(B=5, N=1 if n_layers == 1 else 33)  # N = 1: a single key
    with torch.no_grad():
        assert torch.allclose(fused.fused_forward(m, t), m.forward_eager(t), rtol=1e-12, atol=1e-12)


@needs_numba
def test_a_layernorm_in_torch_sum_order_above_four_slots_runs_eager():
    """The kernel sums LayerNorm's mean slot by slot; torch's own order (ln_sum = "torch") is that
    order up to 4 slots only. The float32 multivariate construction with ln_sum = "torch" answered
    5e-14 fused where its eager forward answers 1.4e-6, so the experiment contrasting the two orders
    measured one twice (found by a review). Such a model now runs eager; in slot order, fused."""
    from icl_bench import PromptSpec
    from icl_bench.prompts.multivariate import make_tokens_mv, sample_prompts_mv
    from icl_bench.solvers.ln_closed_form_mv import build_ln_construction_mv

    b = sample_prompts_mv(PromptSpec(N=50, noise=0.1, R=1e5), 500, d=2, seed=0, dtype="float32")
    t = make_tokens_mv(b.x, b.y, b.x_query, 1e5)
    mse = lambda p: float(((p.double() - b.ols_prediction) ** 2).mean())  # noqa: E731
    with torch.no_grad():
        torch_order = build_ln_construction_mv(1e5, 2, dtype=torch.float32, ln_sum="torch")
        assert fused.fused_forward(torch_order, t) is None and torch.equal(torch_order(t), torch_order.forward_eager(t))
        slots = build_ln_construction_mv(1e5, 2, dtype=torch.float32, ln_sum="slots")
        assert fused.fused_forward(slots, t) is not None
        assert mse(torch_order(t)) > 1e3 * mse(slots(t)), (mse(torch_order(t)), mse(slots(t)))  # the order shows
        # the eager forward (CUDA, gradients) sums in slot order too: an eager path that fell back to
        # torch's order answered 1.4e-6 here, unseen while every CPU test ran the kernel (a mutation review)
        assert mse(torch_order(t)) > 1e3 * mse(slots.forward_eager(t)), mse(slots.forward_eager(t))
        four = random_model(d_model=4)  # torch's order is slot order: the kernel runs
        assert four.cfg.ln_sum == "torch" and fused.fused_forward(four, tokens()) is not None


@needs_numba
def test_float64_no_worse_than_eager_against_long_double():
    # RMS error against a long-double evaluation of the same float64 weights, per R and per model
    rows = []
    for R in (10.0, 1e2, 1e3, 1e4):
        b = sample_prompts(PromptSpec(N=100, noise=0.1, R=R), 300, seed=0, dtype="float64")
        for name, m in (("ln-closed-form", build_construction(R)), ("gd-lsa", build_gd_construction(8, 0.4, R))):
            ref = longdouble_forward(m, b.tokens)
            with torch.no_grad():
                f = np.sqrt(np.mean((fused.fused_forward(m, b.tokens).numpy() - ref) ** 2))
                e = np.sqrt(np.mean((m.forward_eager(b.tokens).numpy() - ref) ** 2))
            rows.append((name, R, float(f), float(e)))
    scale = 1e-15  # below this both agree with the reference to the last bits of a unit-size answer
    assert all(f <= 1.1 * e + scale for _, _, f, e in rows), rows


@needs_numba
def test_float32_error_vs_R_keeps_its_shape():
    # ln-closed-form's float32 error vs OLS over the default grid's R (benchmarks/default.toml):
    # the best R agrees within one grid step and the error is within 4x at every R
    grid = (10.0, 100.0, 1000.0)
    errs = {"fused": [], "eager": []}
    for R in grid:
        b = sample_prompts(PromptSpec(N=100, noise=0.1, R=R), 2000, seed=0, dtype="float32")
        m = build_construction(R, dtype=torch.float32)
        with torch.no_grad():
            for name, out in (("fused", fused.fused_forward(m, b.tokens)), ("eager", m.forward_eager(b.tokens))):
                errs[name].append(float(((out.double() - b.ols_prediction) ** 2).mean()))
    f, e = np.array(errs["fused"]), np.array(errs["eager"])
    assert abs(int(f.argmin()) - int(e.argmin())) <= 1, errs
    assert np.all(f <= 4 * e) and np.all(e <= 4 * f), errs


@needs_numba
def test_float32_agrees_with_eager():
    m = random_model(dtype=torch.float32)
    t = tokens(B=40, N=300, dtype=torch.float32)
    with torch.no_grad():
        fast, eager = fused.fused_forward(m, t), m.forward_eager(t)
    assert fast.dtype == torch.float32
    assert torch.allclose(fast, eager, rtol=1e-4, atol=1e-5)


@needs_numba
def test_threads_give_the_same_answer(monkeypatch):
    m = random_model()
    t = tokens(B=70, N=20)
    with torch.no_grad():
        one = fused.fused_forward(m, t)
        monkeypatch.setattr(fused, "MIN_WORK_PER_THREAD", 1)
        old = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            two = fused.fused_forward(m, t)
        finally:
            torch.set_num_threads(old)
    assert torch.equal(one, two)  # each prompt is computed alone: the split changes nothing


@needs_numba
def test_non_finite_prompt_stays_in_its_prompt_and_zero_spread_gives_inf_not_an_error():
    m = build_construction(100.0)
    t = tokens(B=4, N=20)
    t[1, 3, 0] = float("nan")
    t[2, :, :2] = 0.0  # all x and y equal: layer 2's LN divides 0 by sqrt(eps), no exception
    with torch.no_grad():
        out, eager = fused.fused_forward(m, t), m.forward_eager(t)
    assert torch.isnan(out[1]) and torch.isfinite(out[[0, 3]]).all()
    assert torch.allclose(out[[0, 2, 3]], eager[[0, 2, 3]], rtol=1e-12, atol=1e-12)


@needs_numba
@pytest.mark.parametrize("keys", ["masked", "query-in-context"])
@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("N", [15, 17, 31])  # a last block of 16 holding pads, the query, or both
def test_last_block_reads_only_its_own_prompt(keys, sparse, N):
    """The block of tokens that holds pads runs from a zero-padded copy of its tokens: a prompt's
    answer and extremes are those it gets alone, whatever its neighbours hold in their last
    block and query (NaN, inf), the last prompt of the batch included."""
    m = sparse_model(keys=keys) if sparse else random_model(keys)
    assert (fused._weights(m, torch.float64)[2] >= fused.SPARSE_MIN) == sparse
    t = tokens(B=5, N=N)
    t[1, N - 1, 0], t[1, N, 0] = float("nan"), float("inf")  # prompt 1: its last context x, its query
    t[3, N, :] = float("-inf")  # prompt 3: its query
    same = lambda a, b: torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())  # noqa: E731
    with torch.no_grad():
        ext = torch.empty(5, 4, dtype=t.dtype)
        out = fused.fused_forward(m, t, extremes=ext)
        for b in range(5):
            ext1 = torch.empty(1, 4, dtype=t.dtype)
            alone = fused.fused_forward(m, t[b:b + 1].clone(), extremes=ext1)
            assert same(out[b:b + 1], alone) and same(ext[b:b + 1], ext1), b
        eager = m.forward_eager(t)
    assert torch.isfinite(out[[0, 2, 4]]).all() and torch.isnan(out[1])
    assert torch.allclose(out[[0, 2, 4]], eager[[0, 2, 4]], rtol=1e-12, atol=1e-12)


def test_falls_back_to_eager(monkeypatch):
    m = random_model()
    t = tokens()
    with torch.no_grad():
        eager = m.forward_eager(t)
        monkeypatch.setattr(fused, "numba", False)  # as if numba were not installed
        assert fused.fused_forward(m, t) is None
        assert torch.equal(m(t), eager)
        monkeypatch.setattr(fused, "numba", None)
        monkeypatch.setattr(fused, "ENABLED", False)
        assert fused.fused_forward(m, t) is None
    monkeypatch.setattr(fused, "ENABLED", True)
    # gradients wanted: the eager path, differentiable
    assert fused.fused_forward(m, t) is None
    out = m(t)
    assert out.requires_grad
    # another dtype than the model's, integer tokens: not the fused path
    with torch.no_grad():
        assert fused.fused_forward(m, t.float()) is None


@needs_numba
def test_solvers_use_the_fused_path(monkeypatch):
    from icl_bench.solvers.registry import get_solver

    b = sample_prompts(PromptSpec(N=30, noise=0.1, R=100.0), 64, seed=0, dtype="float64")
    calls = []
    real = fused.fused_forward
    monkeypatch.setattr("icl_bench.solvers.transformer.fused_forward", lambda m, t, **kw: calls.append(1) or real(m, t, **kw))
    for name in ("ln-closed-form", "gd-lsa"):
        s = get_solver(name)
        fast = s.predict(b)
        monkeypatch.setattr(fused, "ENABLED", False)
        slow = s.predict(b)
        monkeypatch.setattr(fused, "ENABLED", True)
        assert torch.allclose(fast, slow, rtol=1e-10, atol=1e-12, equal_nan=True), name
    assert calls


@needs_numba
def test_unrolled_fold_rounds_as_the_loop_fold(monkeypatch):
    """The per-prompt fold P = sum_k W_O^k S_k^T W_Q^k is unrolled (zero terms left out) when that
    is short, as for sparse patterns; the loop form (dense shapes) sums in the same order, so the
    two give bit-identical outputs."""
    assert "x_0_0_0 =" not in fused_source.source(3, 4, 2, True)  # dense d_model 4, 2 heads: 256 multiplications, loops
    m = sparse_model(n_layers=2, n_heads=1, d_model=3)  # small: two quick compiles (unrolled and looped fold)
    t = tokens(B=7, N=40)
    pattern = fused_pattern.kernel_key(fused._weights(m, torch.float64)[1])
    assert "x_0_0_0 =" in fused_source.source(3, 3, 1, True, pattern)  # short: unrolled
    with torch.no_grad():
        unrolled = fused.fused_forward(m, t)
        monkeypatch.setattr(fused_source, "UNROLL_FOLD", 0)
        monkeypatch.setattr(fused, "_KERNELS", {})
        looped = fused.fused_forward(m, t)
    assert "x_0_0_0 =" not in fused_source.source(3, 3, 1, True, pattern)  # the loop form was the one compiled
    assert torch.equal(unrolled, looped)


def test_lane_sums_are_added_in_lane_order():
    """A key-value sum is kept as LANES lane sums that `sums_j` adds in lane order (0, 1, ...), a
    summation order fixed by the code (docs/throughput.md). Run as plain Python on float32 values
    whose sum depends on the order: lane 0 holds 2^24, every other lane 1, so in order each 1 is
    lost to rounding (2^24 + 1 rounds to 2^24) and the reverse order keeps them (2^24 + 16).
    Nothing pinned the order before (a mutation review)."""
    ns = {"np": np}
    exec(fused_source.source(3, 4, 2, True), ns)  # noqa: S102 - the generated source, run uncompiled
    lanes, F = fused_source.LANES, np.float32
    acc = np.ones(2 * 4 * 4 * lanes, dtype=F)  # (head, e, f) accumulators, LANES lanes each
    acc[::lanes] = F(2.0**24)
    S = np.empty((2, 4, 4), dtype=F)
    ns["sums_0"](acc, S, 1)
    assert (S == F(2.0**24)).all(), S  # in lane order; the reverse order gives 2^24 + 16
    assert not acc.any()  # and the lanes are reset for the next layer


def sparse_model(zeros=0.6, seed=0, **kw):
    """random_model with a share of its matrix weights set to exactly 0 (whole key, value and
    readout rows among them), so every layer has its own zero pattern."""
    m = random_model(seed=seed, **kw)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "ln." not in name:
                p.mul_((torch.rand(p.shape, generator=g) >= zeros).to(p.dtype))
        m.blocks[0].attn.W_K[0, 1].zero_()  # a key row, a value row and a readout slot unused
        m.blocks[-1].attn.W_V[-1, 2].zero_()
        m.readout.weight.view(-1, m.cfg.d_model)[:, -1] = 0.0  # the last slot of every token (flatten: every row)
    return m


@needs_numba
@pytest.mark.parametrize("keys", ["masked", "query-in-context"])
@pytest.mark.parametrize("layernorm", [True, False])
@pytest.mark.parametrize("readout", ["query", "flatten"])
def test_sparse_kernel_equals_eager_and_the_dense_kernel(keys, layernorm, readout, monkeypatch):
    """A model with >= SPARSE_MIN zero weights runs a kernel without its zero products: it agrees
    with the eager forward, and bit for bit with the dense kernel (dropping an exact 0 changes
    no rounding; every sum is in program order)."""
    N = 37
    m = sparse_model(keys=keys, layernorm=layernorm, readout=readout, N=N)
    t = tokens(B=6, N=N)
    _, pattern, zeros = fused._weights(m, torch.float64)
    assert pattern.sparse and zeros >= fused.SPARSE_MIN
    dense_products = fused_pattern.products_per_token(fused_pattern.dense(3, 4, 2, 3))
    assert fused_pattern.products_per_token(pattern) < 0.7 * dense_products
    with torch.no_grad():
        fast, eager = fused.fused_forward(m, t), m.forward_eager(t)
        monkeypatch.setattr(fused, "SPARSE_MIN", 2.0)  # no model is sparse enough: the dense kernel
        dense = fused.fused_forward(m, t)
    assert eager.abs().max() > 1e-3
    assert torch.allclose(fast, eager, rtol=1e-12, atol=1e-12)
    assert torch.equal(fast, dense)


@needs_numba
@pytest.mark.parametrize("build", ["ln-closed-form", "gd-lsa", "sparse"])
def test_sparse_kernel_gives_nan_where_the_zero_products_would(build):
    """A left-out 0 * inf would have made the answer NaN: a prompt with a non-finite token (a key
    or the query) or a key-value sum that overflows is NaN, as in the eager forward; the other
    prompts keep their values."""
    m = {"ln-closed-form": lambda: build_construction(100.0), "gd-lsa": lambda: build_gd_construction(8, 0.4, 100.0),
         "sparse": lambda: sparse_model()}[build]()
    assert fused._weights(m, torch.float64)[2] >= fused.SPARSE_MIN
    t = tokens(B=6, N=20)
    t[1, 3, 0], t[2, 5, 1], t[3, -1, 0] = float("inf"), float("nan"), float("-inf")
    t[4, :20, :2] = 1e300  # finite tokens whose products overflow
    with torch.no_grad():
        out, eager = fused.fused_forward(m, t), m.forward_eager(t)
    assert torch.isnan(out[1:5]).all() and torch.isnan(eager[1:5]).all()
    assert torch.allclose(out[[0, 5]], eager[[0, 5]], rtol=1e-12, atol=1e-12)


@needs_numba
def test_sparse_kernel_gives_nan_for_an_overflowing_sum_that_feeds_only_zero_weights():
    """A head whose W_Q is all zero: its key-value sums S are computed (its key and value rows
    are not zero) but every fold product with them is left out. When S overflows, the eager
    fold's 0 * inf makes the answer NaN; the sparse kernel must say so from its finiteness check
    of S (`zsum`), as nothing downstream carries the inf."""
    m = sparse_model()
    with torch.no_grad():
        attn = m.blocks[0].attn
        attn.W_Q[1].zero_()
        attn.W_K[1].mul_(1e200)  # k, v ~ 1e200: k v overflows float64
        attn.W_V[1].mul_(1e200)
    assert fused._weights(m, torch.float64)[2] >= fused.SPARSE_MIN
    t = tokens(B=4, N=20)
    with torch.no_grad():
        out, eager = fused.fused_forward(m, t), m.forward_eager(t)
        attn.W_K[1].div_(1e200)  # back to finite sums: finite answers, the check stays quiet
        attn.W_V[1].div_(1e200)
        out_ok, eager_ok = fused.fused_forward(m, t), m.forward_eager(t)
    assert torch.isnan(eager).all() and torch.isnan(out).all()
    assert torch.isfinite(out_ok).all() and torch.allclose(out_ok, eager_ok, rtol=1e-12, atol=1e-12)


@needs_numba
@pytest.mark.parametrize("dtype, eps", [(torch.float64, 0.0), (torch.float32, 1e-50)])
def test_zero_ln_gain_with_ln_eps_zero_keeps_the_eager_nan(dtype, eps):
    """With ln_eps = 0 in the model's dtype (1e-50 is 0 in float32) a token whose attention output
    has zero variance (an all-zero prompt) has 1/std = inf, and a LayerNorm gain of exactly 0
    makes the eager forward's 0 * inf NaN. Leaving that product out (a sparse kernel) would
    answer finitely: such a model runs the dense kernel, so the NaN stays; the other prompts keep
    their values."""
    m = sparse_model(n_layers=2).to(dtype)
    with torch.no_grad():
        m.blocks[0].ln.weight.zero_()
    for blk in m.blocks:
        blk.ln.eps = eps
    m.cfg = dataclasses.replace(m.cfg, ln_eps=eps)
    _, pattern, zeros = fused._weights(m, dtype)
    assert zeros >= fused.SPARSE_MIN and not fused.sparse_applies(m.cfg, pattern, zeros, dtype)
    assert fused.sparse_applies(dataclasses.replace(m.cfg, ln_eps=1e-5), pattern, zeros, dtype)
    t = tokens(B=4, N=20, dtype=dtype)
    t[2] = 0.0
    with torch.no_grad():
        out, eager = fused.fused_forward(m, t), m.forward_eager(t)
    assert torch.isnan(eager[2]) and torch.isnan(out[2])
    keep = [0, 1, 3]
    assert torch.isfinite(eager[keep]).all()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert torch.allclose(out[keep], eager[keep], rtol=tol, atol=tol)


@needs_numba
def test_flatten_model_refuses_prompts_of_another_n_and_empty_batches_run_no_kernel():
    """A "flatten" readout has one row of weights per token: prompts of another N are a one-line
    ValueError from the fused path too (its kernel would read past the rows); B = 0 returns (0,)
    without running, or counting, a kernel."""
    m = random_model(readout="flatten", N=13)
    with torch.no_grad(), pytest.raises(ValueError, match="^N: this model's flatten readout needs N=13, got prompts with N=40$"):
        fused.fused_forward(m, tokens(B=3, N=40))
    calls = fused.calls
    with torch.no_grad():
        assert fused.fused_forward(m, tokens(B=0, N=13)).shape == (0,)
    assert fused.calls == calls


@needs_numba
def test_kernels_too_large_to_compile_fall_back(monkeypatch):
    """A kernel whose generated source writes more than MAX_PRODUCTS multiplications is not
    built (its compile time would run to minutes): a sparse model then runs the dense kernel of
    its shape, and where that is too large as well, the eager forward."""
    m = sparse_model()
    t = tokens(B=5, N=21)
    _, pattern, _ = fused._weights(m, torch.float64)
    sparse = fused_source.products(fused_source.source(3, 4, 2, True, fused_pattern.kernel_key(pattern)))
    dense = fused_source.products(fused_source.source(3, 4, 2, True))
    assert dense < sparse  # three layers, three zero patterns: more code than the dense kernel
    built = []
    real = fused._kernel
    monkeypatch.setattr(fused, "_kernel", lambda *a: built.append((a[4:] or (None,))[0]) or real(*a))
    monkeypatch.setattr(fused, "_KERNELS", {})
    with torch.no_grad():
        eager = m.forward_eager(t)
        monkeypatch.setattr(fused, "MAX_PRODUCTS", dense)
        assert torch.allclose(fused.fused_forward(m, t), eager, rtol=1e-12, atol=1e-12)
        assert built[0] is not None and built[1:] == [None]  # the sparse kernel refused, then the dense one
        assert fused._KERNELS[(3, 4, 2, True, built[0])] is None
        monkeypatch.setattr(fused, "MAX_PRODUCTS", dense - 1)
        monkeypatch.setattr(fused, "_KERNELS", {})
        calls = fused.calls
        assert fused.fused_forward(m, t) is None and fused.calls == calls
        assert torch.equal(m(t), eager)  # the eager forward answers


@needs_numba
def test_constructions_get_sparse_kernels():
    for m in (build_construction(100.0), build_gd_construction(8, 0.4, 100.0)):
        _, pattern, zeros = fused._weights(m, torch.float64)
        assert zeros >= 0.85 and pattern.sparse
    _, pattern, zeros = fused._weights(random_model(), torch.float64)
    assert zeros == 0 and not pattern.sparse


@needs_numba
def test_ln_closed_form_screens_split_over_the_threads(monkeypatch):
    """ln-closed-form's ill-posedness / r_lost screens come from the extremes each kernel thread
    reads for its own prompts: two threads give exactly the one-thread answer, NaN where the
    screens say."""
    from icl_bench import make_batch
    from icl_bench.solvers.registry import get_solver

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(96, 25, generator=g, dtype=torch.float64), torch.randn(96, 25, generator=g, dtype=torch.float64)
    x[5] = 2.0  # all x equal: ill-posed
    y[70, 3] = float("nan")
    x[40, 0] = 1e30  # R = 100 lost beside it in float64
    batch = make_batch(x, y, torch.randn(96, generator=g, dtype=torch.float64), R=100.0)
    solver = get_solver("ln-closed-form")
    monkeypatch.setattr(fused, "MIN_WORK_PER_THREAD", 1)
    monkeypatch.setattr(fused, "THREADS", 1)
    one = solver.predict(batch)
    monkeypatch.setattr(fused, "THREADS", 2)
    two = solver.predict(batch)
    assert torch.isnan(one).nonzero().flatten().tolist() == [5, 40, 70]
    torch.testing.assert_close(one, two, rtol=0, atol=0, equal_nan=True)


@needs_numba
def test_models_differing_only_in_depth_share_one_kernel(monkeypatch):
    """gd-lsa's layers are alike: 2 and 5 steps run one compiled kernel (a uniform pattern,
    layers looped at run time) and each still equals its eager forward."""
    monkeypatch.setattr(fused, "_KERNELS", {})
    t = tokens(B=5, N=21)
    for steps in (2, 5):
        m = build_gd_construction(steps, 0.4, 100.0)
        with torch.no_grad():
            assert torch.allclose(fused.fused_forward(m, t), m.forward_eager(t), rtol=1e-12, atol=1e-12)
    assert len(fused._KERNELS) == 1
    assert next(iter(fused._KERNELS))[4].uniform


@needs_numba
def test_kernel_compiles_in_memory_where_numba_cannot_cache(monkeypatch, caplog):
    """A read-only kernel folder that already holds the source, with no writable numba cache,
    makes numba.njit(cache=True) raise RuntimeError: the kernel then compiles in memory."""
    real = fused.numba

    class NoCache:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def njit(*args, cache=False, **kw):
            if cache:
                raise RuntimeError("cannot cache function: no locator available")
            return real.njit(*args, **kw)

    m = random_model(n_layers=1, n_heads=1, d_model=2)  # compiled in memory every run: a small kernel
    t = tokens(B=4, N=9)
    monkeypatch.setattr(fused, "numba", NoCache())
    monkeypatch.setattr(fused, "_KERNELS", {})
    with caplog.at_level("WARNING", logger=fused.__name__), torch.no_grad():
        assert torch.allclose(fused.fused_forward(m, t), m.forward_eager(t), rtol=1e-12, atol=1e-12)
    assert any("compiled in memory" in r.getMessage() for r in caplog.records)  # each process compiles it again


@needs_numba
def test_a_first_compile_says_so_once_per_kernel_folder(monkeypatch, tmp_path, caplog):
    """A kernel numba compiles logs one line (its shape, the time, where numba keeps it: a first
    run compiles for minutes, which a progress bar alone does not explain); the same kernel
    loaded from numba's cache in that folder logs nothing."""
    monkeypatch.setenv("ICL_BENCH_KERNEL_DIR", str(tmp_path))
    m = random_model(n_layers=1, n_heads=1, d_model=2)
    t = tokens(B=4, N=9)
    for expected in (1, 0):
        monkeypatch.setattr(fused, "_KERNELS", {})
        fused.forget(m)  # (the model's cache entry keeps the kernel it chose)
        caplog.clear()
        with caplog.at_level("WARNING", logger=fused.__name__), torch.no_grad():
            assert torch.allclose(fused.fused_forward(m, t), m.forward_eager(t), rtol=1e-12, atol=1e-12)
        said = [r.getMessage() for r in caplog.records if "compiled a fused kernel" in r.getMessage()]
        shape = "(d_in 3, d_model 2, 1 head, LayerNorm, dense, "
        assert len(said) == expected and all(shape in s and " products, float64) in " in s and "numba keeps it in " in s
                                             for s in said), said


def test_zero_fraction_counts_the_embedding():
    """zero_fraction is the share of exactly-zero entries over W_E, W_K, W_V, W_Q, W_O (the LayerNorm
    and the readout aside), counted by hand on a small model."""
    m = random_model(n_layers=1, n_heads=1, d_model=2)  # W_E 2x3, W_Q/K/V/O 2x2 each: 22 entries
    with torch.no_grad():
        m.embed.weight[0].zero_()  # 3
        m.blocks[0].attn.W_K[0, 1, 1] = 0.0  # 1
        m.readout.weight.zero_()  # not counted
    _, pattern, zeros = fused._weights(m, torch.float64)
    assert zeros == pytest.approx(4 / 22) and fused_pattern.zero_fraction(pattern) == zeros


def _assert_fused_equals_eager(m):
    """The fused forward of `m` equals its eager forward to 1e-12 on 5 prompts of N = 20, where
    the eager answers are not all ~0 (a dropped term must show)."""
    t = tokens(B=5, N=21)
    with torch.no_grad():
        fast, eager = fused.fused_forward(m, t), m.forward_eager(t)
    assert eager.abs().max() > 1e-3
    assert torch.allclose(fast, eager, rtol=1e-12, atol=1e-12)


@needs_numba
def test_layers_that_share_a_pattern_with_layer_0_but_not_all_do_are_not_uniform():
    """kernel_key makes one `uniform` layer of a pattern only when every layer has layer 0's zero
    pattern. Here layers 0 and 1 share it and layer 2 does not (a dense W_V where layer 0's has
    zeros): treating it as uniform ran layer 2 with layer 0's zeros."""
    m = sparse_model(n_heads=1, d_model=3)
    with torch.no_grad():
        for name in ("W_Q", "W_K", "W_V", "W_O"):
            getattr(m.blocks[1].attn, name).copy_(1.1 * getattr(m.blocks[0].attn, name))
        m.blocks[2].attn.W_V.copy_(0.3 * torch.randn(1, 3, 3, generator=torch.Generator().manual_seed(5),
                                                     dtype=torch.float64))
    _, pattern, zeros = fused._weights(m, torch.float64)
    assert zeros >= fused.SPARSE_MIN and pattern.wv[0] != pattern.wv[2] and pattern.wv[0] == pattern.wv[1]
    assert not fused_pattern.kernel_key(pattern).uniform
    _assert_fused_equals_eager(m)


@needs_numba
def test_layers_that_differ_only_in_their_layernorm_gains_are_not_uniform():
    """The LayerNorm gains' zero pattern is part of a layer's pattern: two layers alike but for a
    gain of 0 in layer 0 (nonzero in layer 1) must not share layer 0's pattern, which leaves
    that slot's gain product out of layer 1 too."""
    m = sparse_model(n_layers=2, n_heads=1, d_model=3)
    with torch.no_grad():
        for name in ("W_Q", "W_K", "W_V", "W_O"):
            getattr(m.blocks[1].attn, name).copy_(getattr(m.blocks[0].attn, name))
        m.blocks[0].ln.weight[1] = 0.0
        m.readout.weight.copy_(torch.tensor([[0.5, -0.4, 0.0]]))  # (its random zeros had left it all 0)
    _, pattern, zeros = fused._weights(m, torch.float64)
    assert zeros >= fused.SPARSE_MIN and pattern.wv[0] == pattern.wv[1] and pattern.gain[0] != pattern.gain[1]
    assert not fused_pattern.kernel_key(pattern).uniform
    _assert_fused_equals_eager(m)


@needs_numba
def test_sparse_layernorm_keeps_the_terms_of_structurally_zero_slots():
    """In a sparse LayerNorm layer a slot whose attention output is zero by structure (a zero row
    of W_O in every head) still has c = -mean, which enters the variance; and a slot whose gain
    is 0 still gets its bias. Leaving either out (zero products) changed the answer."""
    m = sparse_model(n_layers=2, n_heads=1, d_model=3)
    with torch.no_grad():
        m.blocks[0].attn.W_O[:, 2, :] = 0.0  # slot 2 of layer 0's attention output: structurally 0
        m.blocks[1].ln.weight[0] = 0.0  # slot 0 of layer 1: the bias alone
        m.blocks[1].ln.bias[0] = 0.7
        m.readout.weight.copy_(torch.tensor([[0.5, -0.4, 0.0]]))  # (its random zeros had left it all 0)
    _, pattern, zeros = fused._weights(m, torch.float64)
    assert zeros >= fused.SPARSE_MIN and fused.sparse_applies(m.cfg, pattern, zeros)
    _assert_fused_equals_eager(m)


@needs_numba
def test_a_layernorm_variance_that_overflows_gives_nan_as_in_the_eager_forward():
    """var = inf makes 1 / std = 0, and the slots would read the bias alone, a finite wrong answer:
    the eager forward adds var * 0 (NaN there), and so must the kernel. A W_O of layer 1 scaled
    by 1e160 (attention outputs ~1e160, whose squares overflow float64) in one dense model."""
    m = random_model()
    t = tokens(B=4, N=20)
    with torch.no_grad():
        m.blocks[1].attn.W_O.mul_(1e160)
        fast, eager = fused.fused_forward(m, t), m.forward_eager(t)
    assert torch.isnan(eager).all()
    assert torch.isnan(fast).all(), fast


@needs_numba
def test_sparse_kernel_gives_nan_for_an_overflowing_sum_in_a_later_layer():
    """As tests/test_fused.py's check of layer 0, in the last layer: a head whose W_Q is zero, with
    key-value sums that overflow. Only the finiteness check of the later layers' S catches it."""
    m = sparse_model(n_layers=2, d_model=3)  # (a small kernel: a quick compile)
    with torch.no_grad():
        attn = m.blocks[-1].attn
        attn.W_Q[1].zero_()
        attn.W_K[1].mul_(1e200)
        attn.W_V[1].mul_(1e200)
    assert fused._weights(m, torch.float64)[2] >= fused.SPARSE_MIN
    t = tokens(B=4, N=20)
    with torch.no_grad():
        out, eager = fused.fused_forward(m, t), m.forward_eager(t)
    assert torch.isnan(eager).all() and torch.isnan(out).all(), out


@needs_numba
def test_tokens_of_another_width_than_d_in_take_the_eager_path():
    """Tokens two wide for a model with d_in = 3: not the fused path (its kernel would read
    tok[b, 3 i + j] past each prompt's row), so the forward raises torch's shape error."""
    m = random_model()
    t = tokens(B=3, N=20)[..., :2].contiguous()
    with torch.no_grad():
        assert fused.fused_forward(m, t) is None
        with pytest.raises(RuntimeError):
            m(t)
