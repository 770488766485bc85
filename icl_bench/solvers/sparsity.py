"""Sparsity of a solver's weights: the result row's weight_sparsity and weight_l1, and Hoyer's measure.

weight_sparsity counts an entry as zero when |w| < 1e-3 * max|w|, the maximum taken over every
tensor of the solver (docs/design.md, "Result row"). Hoyer's sparsity (Hoyer 2004, "Non-negative
matrix factorization with sparseness constraints", eq. 1) is (sqrt(n) - ||w||_1 / ||w||_2) /
(sqrt(n) - 1): 0 for a flat vector, 1 for a single spike.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch

SPARSITY_REL_THRESHOLD = 1e-3  # |w| < 1e-3 * max|w| counts as zero


def check_weights(weights) -> dict[str, torch.Tensor] | None:
    """`weights` as Solver.weights() promises it: None, or a mapping (a dict, an nn.ParameterDict)
    of name -> numeric tensor (floating point or integer, e.g. quantised; not bool), as a dict.
    Raises TypeError naming what came instead (a list or a bare tensor failed deep in torch.cat)."""
    if weights is None:
        return None
    if not isinstance(weights, (Mapping, torch.nn.ParameterDict)):  # (ParameterDict is no registered Mapping)
        raise TypeError(f"weights() returned {type(weights).__name__}; expected a dict of name -> torch.Tensor, or None")
    for name, w in weights.items():
        if not isinstance(w, torch.Tensor) or w.dtype == torch.bool or w.is_complex():
            got = f"{w.dtype} tensor" if isinstance(w, torch.Tensor) else type(w).__name__
            raise TypeError(f"weights()[{name!r}] is a {got}; expected a real numeric torch.Tensor")
    return dict(weights)


def weight_sparsity(weights: dict[str, torch.Tensor] | None, rel: float = SPARSITY_REL_THRESHOLD) -> float:
    """Fraction of all weight entries with |w| < rel * max|w| (max over every tensor); NaN if None
    or if any entry is NaN / inf (no threshold is defined: every comparison with NaN was False)."""
    if not weights:
        return math.nan
    flat = torch.cat([w.detach().reshape(-1).double().abs().cpu() for w in weights.values()])
    if flat.numel() == 0 or not bool(torch.isfinite(flat).all()):
        return math.nan
    largest = flat.max()
    if float(largest) == 0.0:  # every entry exactly zero: all of them count as zero (the threshold is 0)
        return 1.0
    return float((flat < rel * largest).double().mean())


def weight_l1(weights: dict[str, torch.Tensor] | None) -> float:
    """Sum of |w| over every weight entry; NaN if None."""
    if not weights:
        return math.nan
    return float(sum(w.detach().double().abs().sum().cpu() for w in weights.values()))


def hoyer(w: torch.Tensor) -> float:
    """Hoyer sparsity of all entries of w (any shape): (sqrt(n) - l1/l2) / (sqrt(n) - 1) in [0, 1].
    NaN for fewer than 2 entries or an all-zero tensor."""
    v = w.detach().reshape(-1).double().cpu()
    n, l2 = v.numel(), float(v.norm())
    if n < 2 or l2 == 0.0:
        return math.nan
    return (math.sqrt(n) - float(v.abs().sum()) / l2) / (math.sqrt(n) - 1.0)
