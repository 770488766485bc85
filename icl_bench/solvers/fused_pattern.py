"""Zero patterns of a transformer's weights, for the fused forward's sparse kernels.

A `Pattern` records which weights are exactly zero; `layer_structure` derives what is then zero
whatever the prompt (key and value rows, the entries of the key-value sums S_k and of the
per-prompt map P_l = sum_k W_O^k S_k^T W_Q^k, docs/design.md §4). icl_bench/solvers/fused_source.py
leaves those products out of the generated code; icl_bench/solvers/fused.py picks the pattern.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np


@dataclass(frozen=True)
class Pattern:
    """Which weights are not exactly zero (nested tuples of bools, hashable: it keys the kernel).

    Shapes: we (d, d_in); wk, wv, wq, wo (L, H, d, d) as W[k][out][in]; gain, bias (L, d);
    rw (d,): readout column c is used by some row. `sparse`: some weight is zero, so the kernel
    checks finiteness itself (see the module docstring); False generates the plain dense code.
    """

    we: tuple
    wk: tuple
    wv: tuple
    wq: tuple
    wo: tuple
    gain: tuple
    bias: tuple
    rw: tuple
    sparse: bool
    uniform: bool = False  # one layer standing for any number of alike layers (see `kernel_key`)

    @property
    def layers(self) -> int:
        return len(self.wk)


@lru_cache(maxsize=256)
def kernel_key(p: Pattern) -> Pattern:
    """The pattern a kernel is generated for: when every layer has the same zero pattern, one
    layer marked `uniform`, so models that differ only in depth (gd-lsa with 1, 4 or 16 steps)
    share one compiled kernel, which loops over the layers at run time."""
    layer = lambda l: (p.wk[l], p.wv[l], p.wq[l], p.wo[l], p.gain[l], p.bias[l])  # noqa: E731
    if p.uniform or any(layer(l) != layer(0) for l in range(1, p.layers)):
        return p
    return Pattern(p.we, p.wk[:1], p.wv[:1], p.wq[:1], p.wo[:1], p.gain[:1], p.bias[:1], p.rw, p.sparse, True)


def _bools(a: np.ndarray) -> tuple:
    return tuple(_bools(r) for r in a) if a.ndim > 1 else tuple(bool(v) for v in a)


def dense(din: int, d: int, H: int, L: int = 1) -> Pattern:
    """The pattern with every weight non-zero (the layers all alike)."""
    t = lambda *s: _bools(np.ones(s, dtype=bool))
    w = t(L, H, d, d)
    return Pattern(t(d, din), w, w, w, w, t(L, d), t(L, d), t(d), False)


def pattern_of(We, Wkv, WQ, WO, gain, bias, rw) -> Pattern:
    """The zero pattern of the kernel's weight arrays (icl_bench.solvers.fused._weights):
    We (d, d_in), Wkv (L, 2Hd, d) = [W_K heads; W_V heads], WQ, WO (L, H, d, d), gain, bias (L, d),
    rw (rows, d). A NaN weight counts as non-zero."""
    L, H, d = WQ.shape[0], WQ.shape[1], WQ.shape[2]
    nz = lambda a: _bools(np.asarray(a) != 0)
    kv = np.asarray(Wkv).reshape(L, 2, H, d, d)
    p = Pattern(nz(We), nz(kv[:, 0]), nz(kv[:, 1]), nz(WQ), nz(WO), nz(gain), nz(bias),
                _bools((np.asarray(rw) != 0).any(axis=0)), True)
    return p if zero_fraction(p) > 0 else dense(We.shape[1], d, H, L)


def zero_fraction(p: Pattern) -> float:
    """Share of the matrix weights (W_E, W_K, W_V, W_Q, W_O) that are exactly zero."""
    flags = np.concatenate([np.ravel(np.array(a, dtype=bool)) for a in (p.we, p.wk, p.wv, p.wq, p.wo)])
    return float(1.0 - flags.mean())


def layer_structure(p: Pattern, l: int) -> dict:
    """Layer l's structural non-zeros: key rows, value rows, accumulators, S_k, X_k, P."""
    d, H = len(p.wq[l][0]), len(p.wq[l])
    kin = [[tuple(c for c in range(d) if p.wk[l][k][e][c]) for e in range(d)] for k in range(H)]
    vin = [[tuple(c for c in range(d) if p.wv[l][k][f][c]) for f in range(d)] for k in range(H)]
    s = [[[bool(kin[k][e]) and bool(vin[k][f]) for f in range(d)] for e in range(d)] for k in range(H)]
    x = [[[any(s[k][e][f] and p.wq[l][k][e][a] for e in range(d)) for a in range(d)] for f in range(d)]
         for k in range(H)]
    P = [[any(p.wo[l][k][g][f] and x[k][f][a] for k in range(H) for f in range(d)) for a in range(d)]
         for g in range(d)]
    return {"kin": kin, "vin": vin, "s": s, "x": x, "P": P}


def products_per_token(p: Pattern) -> int:
    """Multiplications per context token the kernel of `p` does (embedding; per layer the
    key-value products, and the block before it): a measure of what the zero pattern saves."""
    n = sum(map(sum, p.we))
    for l in range(p.layers):
        x, H, d = layer_structure(p, l), len(p.wq[l]), len(p.we)
        acc = [(k, e, f) for k in range(H) for e in range(d) for f in range(d) if x["s"][k][e][f]]
        n += sum(len(x["kin"][k][e]) for k, e in {(k, e) for k, e, _ in acc})
        n += sum(len(x["vin"][k][f]) for k, f in {(k, f) for k, _, f in acc})
        n += len(acc) + (sum(map(sum, layer_structure(p, l - 1)["P"])) if l else 0)
    return n
