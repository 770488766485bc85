"""Closed-form simple least squares, batched: the reference every solver is measured against.

For a prompt with context (x_i, y_i), i = 1..N, and query u (any textbook, e.g. Wasserman,
*All of Statistics*, eq. 13.6):

    b_hat = Sxy / Sxx,   Sxy = sum (x_i - x_bar)(y_i - y_bar),   Sxx = sum (x_i - x_bar)^2
    y_hat(u) = y_bar + b_hat * (u - x_bar)

A prompt whose x has (numerically) zero spread has no unique fit: its prediction is NaN.

How it is computed (the corrected two-pass algorithm; Chan, Golub & LeVeque 1983, "Algorithms
for computing the sample variance", eq. 1.7). Per prompt, m_x and m_y are the computed means;
with x' = x - m_x and y' = y - m_y,

    Sxx = sum x'^2 - (sum x')^2 / N,    Sxy = sum x'y' - (sum x')(sum y') / N,
    x_bar = m_x + sum x' / N,           y_bar = m_y + sum y' / N.

The correction terms remove what rounding left in the means, so the result keeps its accuracy
when |x_bar| >> sd(x) (unlike sum x^2 - N x_bar^2, which cancels). All four sums come from one
batched matrix product [1; x'] [x'; y']^T per prompt. On the CPU the prompts go through in
chunks of about CHUNK_ELEMENTS values of x, so x' and y' live in one reused, cache-sized buffer:
x and y are read from memory once and no (B, N) temporary is allocated.
"""
from __future__ import annotations

import torch

CHUNK_ELEMENTS = 1 << 16  # CPU: prompts per chunk = this // N (at least 1)


def _centred_sums(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per prompt: the means (m_x, m_y) (B, 2) and the sums G (B, 2, 2) =
    [[sum x', sum y'], [sum x'^2, sum x'y']] of the centred values, in x's dtype."""
    B, N = x.shape
    grad = torch.is_grad_enabled() and (x.requires_grad or y.requires_grad)
    step = B if (x.device.type != "cpu" or grad) else max(1, min(B, CHUNK_ELEMENTS // N))
    means = torch.stack([x.mean(dim=1), y.mean(dim=1)], dim=1) if grad else torch.empty(B, 2, dtype=x.dtype, device=x.device)
    if grad:  # autograd cannot record out= ops: the same arithmetic with fresh tensors
        z = torch.stack([torch.ones_like(x), x - means[:, :1], y - means[:, 1:]], dim=1)  # (B, 3, N)
        return means, torch.bmm(z[:, 0:2], z[:, 1:3].transpose(1, 2))
    G = torch.empty(B, 2, 2, dtype=x.dtype, device=x.device)
    z = torch.empty(step, 3, N, dtype=x.dtype, device=x.device)  # rows: 1, x', y' (reused per chunk)
    z[:, 0] = 1.0
    for s in range(0, B, step):
        e = min(B, s + step)
        zc, m = z[: e - s], means[s:e]  # (n, 3, N), (n, 2)
        torch.mean(x[s:e], dim=1, out=m[:, 0])
        torch.mean(y[s:e], dim=1, out=m[:, 1])
        torch.sub(x[s:e], m[:, 0:1], out=zc[:, 1])
        torch.sub(y[s:e], m[:, 1:2], out=zc[:, 2])
        torch.bmm(zc[:, 0:2], zc[:, 1:3].transpose(1, 2), out=G[s:e])  # (n, 2, 2)
    return means, G


def ols_fit(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-prompt least-squares statistics.

    Args:
        x, y: (B, N) tensors of one floating dtype and device.
    Returns:
        (x_bar, y_bar, slope, intercept), each (B,), in the dtype of x. slope and intercept are
        NaN where var(x) <= N * eps * mean(x^2) (all x equal up to rounding), and wherever the
        prompt holds a NaN or an infinity.
    """
    N = x.shape[1]
    means, G = _centred_sums(x, y)  # (B, 2), (B, 2, 2)
    sx, sy, sxx_raw, sxy_raw = G[:, 0, 0], G[:, 0, 1], G[:, 1, 0], G[:, 1, 1]  # (B,) each
    sxx = sxx_raw - sx * sx / N  # (B,) centred sum of squares
    sxy = sxy_raw - sx * sy / N
    x_bar = means[:, 0] + sx / N
    y_bar = means[:, 1] + sy / N
    eps = torch.finfo(x.dtype).eps
    scale = sxx + N * x_bar * x_bar  # (B,) = sum x^2, without another pass over x
    degenerate = sxx <= N * eps * scale
    slope = torch.where(degenerate, torch.full_like(sxx, float("nan")), sxy / sxx)
    intercept = y_bar - slope * x_bar
    return x_bar, y_bar, slope, intercept


def ols_predict(x: torch.Tensor, y: torch.Tensor, x_query: torch.Tensor) -> torch.Tensor:
    """Least-squares prediction at the query, (B,), in the dtype of x.

    Args:
        x, y: (B, N) context; x_query: (B,) query inputs u.
    Returns:
        y_bar + b_hat * (u - x_bar); NaN for prompts with zero spread in x or non-finite input.
    """
    x_bar, y_bar, slope, _ = ols_fit(x, y)
    return y_bar + slope * (x_query - x_bar)
