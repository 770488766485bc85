"""The shared transformer module: associative attention equals the quadratic (score-matrix) form."""
import pytest
import torch

from icl_bench.solvers.transformer import TransformerConfig
from tests.transformer_models import random_model
from tests.transformer_models import tokens as shared_tokens


def naive_attention(attn, h):
    """A loop over prompts, heads, tokens and keys: the definition in docs/design.md §4."""
    B, T, d = h.shape
    M = T - 1 if attn.keys == "masked" else T
    out = torch.zeros_like(h)
    for b in range(B):
        for k in range(attn.W_Q.shape[0]):
            for i in range(T):
                q = attn.W_Q[k] @ h[b, i]
                for j in range(M):
                    out[b, i] += (q @ (attn.W_K[k] @ h[b, j])) * (attn.W_O[k] @ attn.W_V[k] @ h[b, j]) / M
    return out


def tokens(B=3, N=7, seed=1):
    return shared_tokens(B=B, N=N, seed=seed)


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1.0))


@pytest.mark.parametrize("keys", ["masked", "query-in-context"])
@pytest.mark.parametrize("layernorm", [True, False])
def test_forward_equals_quadratic_forward(keys, layernorm):
    m = random_model(keys, layernorm)
    t = tokens()
    with torch.no_grad():
        fast, slow = m(t), m.forward_quadratic(t)
    assert fast.shape == (3,) and fast.abs().max() > 1e-3  # not a vacuous all-zero comparison
    assert rel_err(fast, slow) <= 1e-12


@pytest.mark.parametrize("keys", ["masked", "query-in-context"])
def test_attention_equals_naive_loop(keys):
    m = random_model(keys, True)
    h = m.embed(tokens(B=2, N=5))  # (B, T, d)
    with torch.no_grad():
        ref = naive_attention(m.blocks[0].attn, h)
        assert rel_err(m.blocks[0].attn(h), ref) <= 1e-12
        assert rel_err(m.blocks[0].attn.forward_quadratic(h), ref) <= 1e-12


def test_key_sets_differ():
    # the comparison above can fail: the two key sets give different outputs on the same weights
    t = tokens()
    a, b = random_model("masked", True), random_model("query-in-context", True)
    with torch.no_grad():
        assert rel_err(a(t), b(t)) > 1e-6


def test_probe_and_flatten_readout():
    m = random_model("masked", True, readout="flatten", N=7)
    t = tokens()
    trace = m.probe(t)
    assert set(trace) == {"embed"} | {f"layer{i}.{k}" for i in range(3) for k in ("attn", "ln", "resid")}
    assert all(v.shape == (3, 8, 4) for v in trace.values())
    with torch.no_grad():
        assert rel_err(m(t), m.forward_quadratic(t)) <= 1e-12
    with pytest.raises(ValueError, match="N"):
        m(tokens(N=5))


@pytest.mark.parametrize("readout", ["query", "flatten"])
def test_empty_batch_gives_an_empty_answer(readout):
    """B = 0 prompts: every forward returns (0,) in the model's dtype (the eager path used to
    concatenate an empty list of chunks and raise)."""
    m = random_model("masked", True, readout=readout, N=7)
    t = tokens(B=0)
    for out in (m.forward_eager(t), m(t), m.forward_quadratic(t)):
        assert out.shape == (0,) and out.dtype == torch.float64


@pytest.mark.parametrize("readout", ["query", "flatten"])
@pytest.mark.parametrize("B", [0, 5])
def test_the_layer_by_layer_forward_of_large_maps_is_the_same_arithmetic(monkeypatch, readout, B):
    """Every layer's folded map held at once grows as layers * H^2 d^4: the d = 64 ln-closed-form
    was killed at 20 GB (found by a review). Beyond MAPS_AT_ONCE the eager forward runs layer by
    layer over the chunks, one map at a time: the same numbers, bit for bit, gradients too."""
    from icl_bench.solvers.transformer import Transformer

    m = random_model("masked", True, readout=readout, N=7)
    t = tokens(B=B, N=7).requires_grad_(True)
    monkeypatch.setattr(Transformer, "CHUNK_TOKENS", 16)  # two prompts per chunk: several chunks
    first = m.forward_eager(t)
    monkeypatch.setattr(Transformer, "MAPS_AT_ONCE", 0)
    again = m.forward_eager(t)
    assert torch.equal(first, again) and first.shape == (B,)
    if B:
        g1, = torch.autograd.grad(first.sum(), t)
        g2, = torch.autograd.grad(again.sum(), t)
        assert torch.equal(g1, g2)


@pytest.mark.parametrize("eps", [-1e-5, float("nan"), float("inf"), 10 ** 400, True, "1e-5", None,
                                 torch.tensor(1e-5)])
def test_ln_eps_must_be_a_finite_number_not_negative(eps):
    with pytest.raises(ValueError, match=r"^ln_eps: must be a finite number >= 0 \(got .*\)$"):
        TransformerConfig(ln_eps=eps)
