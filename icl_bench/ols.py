"""Closed-form simple least squares, batched: the reference every solver is measured against.

For a prompt with context (x_i, y_i), i = 1..N, and query u (any textbook, e.g. Wasserman,
*All of Statistics*, eq. 13.6):

    b_hat = Sxy / Sxx,   Sxy = sum (x_i - x_bar)(y_i - y_bar),   Sxx = sum (x_i - x_bar)^2
    y_hat(u) = y_bar + b_hat * (u - x_bar)

A prompt whose x has (numerically) zero spread has no unique fit: its prediction is NaN.
"""
from __future__ import annotations

import torch


def ols_fit(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-prompt least-squares statistics.

    Args:
        x, y: (B, N) tensors of one floating dtype and device.
    Returns:
        (x_bar, y_bar, slope, intercept), each (B,), in the dtype of x. slope and intercept are
        NaN where var(x) <= N * eps * mean(x^2) (all x equal up to rounding).
    """
    x_bar = x.mean(dim=1)  # (B,)
    y_bar = y.mean(dim=1)  # (B,)
    xc = x - x_bar[:, None]  # (B, N)
    sxx = (xc * xc).sum(dim=1)  # (B,)
    sxy = (xc * (y - y_bar[:, None])).sum(dim=1)  # (B,)
    eps = torch.finfo(x.dtype).eps
    scale = (x * x).sum(dim=1)
    degenerate = sxx <= x.shape[1] * eps * scale
    slope = torch.where(degenerate, torch.full_like(sxx, float("nan")), sxy / sxx)
    intercept = y_bar - slope * x_bar
    return x_bar, y_bar, slope, intercept


def ols_predict(x: torch.Tensor, y: torch.Tensor, x_query: torch.Tensor) -> torch.Tensor:
    """Least-squares prediction at the query, (B,), in the dtype of x.

    Args:
        x, y: (B, N) context; x_query: (B,) query inputs u.
    Returns:
        y_bar + b_hat * (u - x_bar); NaN (never +-inf) for prompts with zero spread in x, a
        non-finite input (an infinite query included) or a result that overflows the dtype.
    """
    x_bar, y_bar, slope, _ = ols_fit(x, y)
    pred = y_bar + slope * (x_query - x_bar)  # (B,)
    return pred.masked_fill(~torch.isfinite(pred), float("nan"))
