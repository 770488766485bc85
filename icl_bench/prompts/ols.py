"""Closed-form simple least squares, batched: the reference every solver is measured against.

For a prompt with context (x_i, y_i), i = 1..N, and query u (any textbook, e.g. Wasserman,
*All of Statistics*, eq. 13.6):

    b_hat = Sxy / Sxx,   Sxy = sum (x_i - x_bar)(y_i - y_bar),   Sxx = sum (x_i - x_bar)^2
    y_hat(u) = y_bar + b_hat * (u - x_bar)

A prompt whose x has (numerically) zero spread has no unique fit: its prediction is NaN.

How it is computed: one pass over x and y, the shifted form of the corrected two-pass
algorithm (Chan, Golub & LeVeque 1983, "Algorithms for computing the sample variance", eq. 1.7).
Per prompt, c_x and c_y are the means of the first SHIFT_SAMPLES values of x and y (close to the
means, cheap: no pass over the prompt); with x' = x - c_x and y' = y - c_y,

    Sxx = sum x'^2 - (sum x')^2 / N,    Sxy = sum x'y' - (sum x')(sum y') / N,
    x_bar = c_x + sum x' / N,           y_bar = c_y + sum y' / N.

Exact in exact arithmetic for any shift; in floating point the cancellation in Sxx costs a
factor 1 + ((c_x - x_bar) / sd(x))^2, about 1 + 1/SHIFT_SAMPLES for a shift from 8 samples, and
it does not grow with |x_bar| / sd(x) (unlike sum x^2 - N x_bar^2). All four sums come from one
batched matrix product [1; x'] [x'; y']^T per prompt. On the CPU the prompts go through in
chunks of about CHUNK_ELEMENTS values of x, so x' and y' live in one reused, cache-sized buffer:
x and y are read from memory once and no (B, N) temporary is allocated.
"""
from __future__ import annotations

import torch

CHUNK_ELEMENTS = 1 << 16  # CPU: prompts per chunk = this // N (at least 1)
SHIFT_SAMPLES = 8  # values of x (and y) per prompt whose mean is the shift


def _shifted_sums(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per prompt: the shifts c = (c_x, c_y) (B, 2) and the sums G (B, 2, 2) =
    [[sum x', sum y'], [sum x'^2, sum x'y']] of the shifted values, in x's dtype."""
    B, N = x.shape
    c = torch.stack([x[:, :SHIFT_SAMPLES].mean(dim=1), y[:, :SHIFT_SAMPLES].mean(dim=1)], dim=1)  # (B, 2)
    if torch.is_grad_enabled() and (x.requires_grad or y.requires_grad):  # autograd records no out= ops
        z = torch.stack([torch.ones_like(x), x - c[:, :1], y - c[:, 1:]], dim=1)  # (B, 3, N)
        return c, torch.bmm(z[:, 0:2], z[:, 1:3].transpose(1, 2))
    step = B if x.device.type != "cpu" else max(1, min(B, CHUNK_ELEMENTS // N))
    G = torch.empty(B, 2, 2, dtype=x.dtype, device=x.device)
    z = torch.empty(step, 3, N, dtype=x.dtype, device=x.device)  # rows: 1, x', y' (reused per chunk)
    z[:, 0] = 1.0
    ones_x, xs, ys = z[:, 0:2], z[:, 1], z[:, 2]  # views of the buffer
    xy = z[:, 1:3].transpose(1, 2)  # (step, N, 2)
    for s in range(0, B, step):
        e = min(B, s + step)
        n = e - s
        torch.sub(x[s:e], c[s:e, 0:1], out=xs[:n])
        torch.sub(y[s:e], c[s:e, 1:2], out=ys[:n])
        torch.bmm(ones_x[:n], xy[:n], out=G[s:e])  # (n, 2, 2)
    return c, G


def _moments(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_bar, y_bar, slope, Sxx), each (B,); slope is NaN for degenerate prompts."""
    N = x.shape[1]
    c, G = _shifted_sums(x, y)  # (B, 2), (B, 2, 2)
    offset = G[:, 0] / N  # (B, 2): mean of x', y'
    means = c + offset  # (B, 2): x_bar, y_bar
    S = G[:, 1] - G[:, 0, :1] * offset  # (B, 2): Sxx, Sxy (the shift's share removed)
    sxx, x_bar = S[:, 0], means[:, 0]
    scale = torch.addcmul(sxx, x_bar, x_bar, value=N)  # (B,) = sum x^2, without another pass
    degenerate = sxx <= (N * torch.finfo(x.dtype).eps) * scale
    slope = torch.where(degenerate, float("nan"), S[:, 1] / sxx)
    return x_bar, means[:, 1], slope, sxx


def ols_fit(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-prompt least-squares statistics.

    Args:
        x, y: (B, N) tensors of one floating dtype and device.
    Returns:
        (x_bar, y_bar, slope, intercept), each (B,), in the dtype of x. slope and intercept are
        NaN where var(x) <= N * eps * mean(x^2) (all x equal up to rounding), and wherever the
        prompt holds a NaN or an infinity.
    """
    x_bar, y_bar, slope, _ = _moments(x, y)
    return x_bar, y_bar, slope, y_bar - slope * x_bar


def ols_predict(x: torch.Tensor, y: torch.Tensor, x_query: torch.Tensor) -> torch.Tensor:
    """Least-squares prediction at the query, (B,), in the dtype of x.

    Args:
        x, y: (B, N) context; x_query: (B,) query inputs u.
    Returns:
        y_bar + b_hat * (u - x_bar); NaN (never +-inf) for prompts with zero spread in x, a
        non-finite input (an infinite query included) or a result that overflows the dtype.
    """
    x_bar, y_bar, slope, _ = _moments(x, y)
    pred = torch.addcmul(y_bar, slope, x_query - x_bar)  # (B,)
    return pred.masked_fill(~torch.isfinite(pred), float("nan"))
