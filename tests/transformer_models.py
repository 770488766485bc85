"""Random transformers and token batches shared by the transformer tests (test_transformer,
test_fast_forward, test_fused)."""
from __future__ import annotations

import torch

from icl_bench.solvers.transformer import Transformer, TransformerConfig


def random_model(keys="masked", layernorm=True, readout="query", N=None, n_layers=3, n_heads=2, d_model=4,
                 dtype=torch.float64, seed=0, scale=0.5, ln_bias=0.1, ln_sum="torch") -> Transformer:
    """A model with random weights of a modest scale (entries ~ N(0, scale^2 / fan-in)), so the
    activations stay O(1) through the layers and a 1e-12 comparison in float64 is meaningful;
    LayerNorm gains ~ 1 and biases ~ ln_bias (so LN's bias path is used)."""
    torch.manual_seed(seed)
    cfg = TransformerConfig(d_model=d_model, n_layers=n_layers, n_heads=n_heads, layernorm=layernorm, keys=keys,
                            readout=readout, N=N, ln_sum=ln_sum)
    m = Transformer(cfg).to(dtype).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn_like(p) * scale / p.shape[-1] ** 0.5)
            if name.endswith("ln.weight"):
                p.add_(1.0)
            if name.endswith("ln.bias"):
                p.add_(ln_bias)
    return m


def tokens(B=9, N=13, dtype=torch.float64, seed=1) -> torch.Tensor:
    """(B, N+1, 3) prompts: standard-normal x and y, the query's y 0, R = 1.5 in the third slot."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(B, N + 1, 3, generator=g, dtype=torch.float64).to(dtype)
    t[:, -1, 1] = 0.0
    t[:, :, 2] = 1.5
    return t
