"""The fused forward's per-model cache (icl_bench/solvers/fused.py `_entry`): the weights and the
kernel chosen for them are kept between calls, and every way a model's weights change is seen."""
import copy
import dataclasses

import pytest
import torch

from icl_bench.solvers import fused
from icl_bench.solvers.gd_lsa import build_gd_construction
from icl_bench.solvers.ln_closed_form import build_construction
from tests.transformer_models import random_model, tokens

needs_numba = pytest.mark.skipif(not fused.available(), reason="numba is not installed: no fused path to test")


def agrees(m, t) -> bool:
    """The fused forward ran and equals the eager forward of the model's current weights."""
    with torch.no_grad():
        out = fused.fused_forward(m, t)
        return out is not None and torch.allclose(out, m.forward_eager(t), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("build", [random_model, lambda: build_gd_construction(8, 0.4, 100.0),
                                   lambda: build_construction(100.0)])
def test_parameter_walk_finds_every_parameter(build):
    m = build()
    assert sorted(map(id, fused._parameters(m))) == sorted(map(id, m.parameters()))


@needs_numba
def test_fused_forward_sees_every_kind_of_weight_change():
    m, t = random_model(), tokens(B=4, N=21)
    assert agrees(m, t)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)  # an optimizer step (in place, versions bumped)
    m.forward_eager(t).square().sum().backward()
    opt.step()
    assert agrees(m, t)
    with torch.no_grad():
        m.blocks[0].attn.W_V.mul_(-1.5)  # an in-place op
    assert agrees(m, t)
    m.blocks[1].attn.W_Q = torch.nn.Parameter(torch.randn_like(m.blocks[1].attn.W_Q))  # a new parameter
    assert agrees(m, t)
    ln = torch.nn.LayerNorm(4, eps=m.cfg.ln_eps, dtype=torch.float64)
    with torch.no_grad():
        ln.weight.fill_(0.7)
        ln.bias.fill_(-0.2)
    m.blocks[2].ln = ln  # a new submodule
    assert agrees(m, t)
    m.readout.weight.data.mul_(3.0)  # through .data: no version counter moves, so forget() first
    m.blocks[0].attn.W_K.data.mul_(-2.0)
    fused.forget(m)
    assert agrees(m, t)


@needs_numba
def test_kernel_choice_follows_the_weights(monkeypatch):
    """A construction runs its sparse kernel; filling its zeros gives the dense kernel on the next
    call; a changed SPARSE_MIN or config is obeyed without touching the weights."""
    m, t = build_construction(100.0), tokens(B=3, N=17)
    t[:, :, 2] = 100.0
    assert agrees(m, t)
    sparse = fused._entry(m, torch.float64)["kernel"][1]
    dense = fused._kernel(3, 4, 2, True)
    assert sparse is not dense
    monkeypatch.setattr(fused, "SPARSE_MIN", 1.0)  # no model is sparse enough now
    assert agrees(m, t) and fused._entry(m, torch.float64)["kernel"][1] is dense
    monkeypatch.undo()
    assert agrees(m, t) and fused._entry(m, torch.float64)["kernel"][1] is sparse
    cfg = m.cfg
    m.cfg = dataclasses.replace(cfg, ln_eps=0.0)  # with LN gains of 0: the dense kernel (fused.sparse_applies)
    with torch.no_grad():
        fused.fused_forward(m, t)
    assert fused._entry(m, torch.float64)["kernel"][1] is dense
    m.cfg = cfg
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.01 * torch.randn_like(p))  # no weight exactly zero any more
    assert agrees(m, t) and fused._entry(m, torch.float64)["kernel"][1] is dense


@needs_numba
def test_weights_assigned_through_data_are_seen():
    """`vector_to_parameters` assigns `param.data` (no version counter moves): each new vector is
    seen, although a freed vector's address could be reused by the next one (the cache holds the
    storages it read, so no address of theirs is reused while it lives). Without that, glibc's
    allocator here hands the freed vector's address to the vector after next, and the fused
    forward answered with the old weights (a difference of ~1)."""
    m, t = random_model(), tokens(B=4, N=11)
    v = torch.nn.utils.parameters_to_vector(m.parameters()).detach()
    got = {}
    with torch.no_grad():
        for scale in range(1, 10):
            torch.nn.utils.vector_to_parameters(v * scale, m.parameters())  # frees the vector before
            if scale % 2:  # a forward every other vector: the one read two vectors ago is free now
                got[scale] = m(t)
        for scale, out in got.items():  # the eager answers afterwards (no allocation in between above)
            torch.nn.utils.vector_to_parameters(v * scale, m.parameters())
            assert torch.allclose(out, m.forward_eager(t), rtol=1e-12, atol=1e-12), scale


@needs_numba
def test_a_copy_answers_for_its_own_weights():
    m, t = random_model(), tokens(B=4, N=11)
    assert agrees(m, t)
    twin = copy.deepcopy(m)
    with torch.no_grad():
        twin.blocks[0].attn.W_O.mul_(0.5)
    assert agrees(twin, t) and agrees(m, t)
    assert not torch.allclose(twin.forward_eager(t), m.forward_eager(t))
