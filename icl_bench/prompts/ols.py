"""Closed-form simple least squares, batched: the reference every solver is measured against.

For a prompt with context (x_i, y_i), i = 1..N, and query u (any textbook, e.g. Wasserman,
*All of Statistics*, eq. 13.6):

    b_hat = Sxy / Sxx,   Sxy = sum (x_i - x_bar)(y_i - y_bar),   Sxx = sum (x_i - x_bar)^2
    y_hat(u) = y_bar + b_hat * (u - x_bar)

Ill-posed prompts (`ill_posed`, the one criterion every least-squares solver shares): a NaN or
inf in x, y or u, or all x exactly equal. Nothing else: the shifted problem below is well
conditioned whenever x is not constant, so a near-constant x (Unix timestamps, a spread of 1e-9
around 1) still has an accurate answer. The derivation and the error bound: docs/accuracy.md.

How it is computed, per prompt (shifted sums: Chan, Golub & LeVeque 1983, "Algorithms for
computing the sample variance", eq. 1.7). With a shift c = (c_x, c_y), x' = x - c_x, y' = y - c_y
(each a single rounding of the exact difference):

    Sxx = sum x'^2 - (sum x')^2 / N,    Sxy = sum x'y' - (sum x')(sum y') / N,
    x_bar = c_x + sum x' / N,           y_bar = c_y + sum y' / N,    y_hat = y_bar + (Sxy/Sxx)(u - x_bar),
    with u - x_bar formed as (u - c_x) - sum x' / N (never through a rounded x_bar).

Exact in exact arithmetic for any shift; in floating point the cancellation in Sxx costs a factor
1 + d^2, d = (c_x - x_bar) / sd(x), bounded whatever the offset |x_bar| / sd(x) when c is taken
from the prompt's own values (unlike sum x^2 - N x_bar^2; docs/accuracy.md, "The criterion").
1. Fast path (nearly every prompt), one pass: c = the median of the first SHIFT_SAMPLES values
   (a data value: d^2 <= N / 4, and a constant x gives x' = 0 exactly); the sums come from one
   batched matrix product [1; x'; y'] [x'; y']^T per prompt. Where that shift lies far from the
   mean (d^2 > REFINE - 1: outliers among the first values), the sums are taken again around
   c + mean(x', y') (`_refined`), since their rounding relative to Sxx grows as N u (1 + d^2).
   It is kept where every sum is finite,
   sum x'^2 and sum y'^2 lie in [1/r, r] (r = FAST_RANGE: no product under- or overflows enough to
   matter) and Sxx > 0.
2. Scaled path (the rest: constant x or y, NaN / inf, data beyond about 1e+-75 in float64):
   x and y are first multiplied by 2^-kx, 2^-ky, kx, ky the binary exponents of max|x|, max|y|
   (exact; it keeps every square and sum in range for any finite data, 1e-300 and 1e300 alike),
   c is the mean of the first SHIFT_SAMPLES scaled values (Cauchy-Schwarz: d^2 <= N / 8; refined
   as above), and
   y_hat = 2^ky (y_bar' + beta (u - x_bar) 2^-kx), beta = Sxy'/Sxx' the slope in scaled units.
On the CPU the prompts go through in chunks of about CHUNK_ELEMENTS values of x, so x' and y'
live in one reused, cache-sized buffer and no (B, N) temporary is allocated.
"""
from __future__ import annotations

import math

import torch

CHUNK_ELEMENTS = 1 << 16  # CPU: prompts per chunk = this // N (at least 1)
ROW_ALIGN = 16  # _sums pads each row to a multiple of this many values (64 bytes in float32)
SHIFT_SAMPLES = 8  # values of x (and y) per prompt whose median (scaled path: mean) is the first shift
REFINE = 4.0  # a shift with sum x'^2 > REFINE Sxx (or sum y'^2 > REFINE Syy) moves to the mean (`_refined`)
REFINE_PASSES = 3  # at most this many more passes over such a prompt


def exp_clamp(dtype: torch.dtype) -> int:
    """Largest |scaling exponent| used: 2^+-k and data scaled by it stay normal numbers of `dtype`
    (1000 for float64, 104 for float32)."""
    return math.frexp(torch.finfo(dtype).max)[1] - 24


def exponent_of(m: torch.Tensor) -> torch.Tensor:
    """int64 k, shape of m (magnitudes >= 0, any float dtype), with m < 2^k (0 where m is 0 or not
    finite), clamped to +-exp_clamp(m.dtype): v 2^-k is then exact and below 1 for |v| <= m."""
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    k = exp_clamp(m.dtype)
    return torch.frexp(m).exponent.to(torch.int64).clamp(-k, k)


def pow2(k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2^k (B,) in `dtype` for int64 k with |k| <= exp_clamp(dtype) (exact)."""
    return torch.ldexp(torch.ones((), dtype=torch.float64, device=k.device), k.to(torch.float64)).to(dtype)


def ldexp(v: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """v * 2^k without an overflowing intermediate for |k| <= 2 exp_clamp (two exact halves)."""
    h = torch.div(k, 2, rounding_mode="floor")
    return (v * pow2(h, v.dtype)) * pow2(k - h, v.dtype)


def ill_posed(x: torch.Tensor, y: torch.Tensor, x_query: torch.Tensor) -> torch.Tensor:
    """(B,) bool: prompts with no unique least-squares answer: a NaN or +-inf in x, y or the
    query, or all x exactly equal. The one criterion of every least-squares solver.

    Why exactly-equal and not "numerically" equal: after a shift by a mean of the prompt's own
    values the centred problem has condition number at most sqrt(1 + N / 4) (relative
    to rounding of the shifted values), finite for every non-constant x; see docs/accuracy.md,
    section "The criterion". Args: x, y (B, N); x_query (B,); any float dtype and device.
    """
    xlo, xhi, ylo, yhi = x.amin(dim=1), x.amax(dim=1), y.amin(dim=1), y.amax(dim=1)  # (B,); NaN propagates
    return ill_posed_context(xlo, xhi, ylo, yhi) | ~torch.isfinite(x_query)


def ill_posed_context(xlo, xhi, ylo, yhi) -> torch.Tensor:
    """`ill_posed` from the per-prompt ranges of x and y (B,) each (the query aside)."""
    finite = torch.isfinite(xlo) & torch.isfinite(xhi) & torch.isfinite(ylo) & torch.isfinite(yhi)
    return ~finite | (xlo == xhi)


def _ranges(x: torch.Tensor, y: torch.Tensor):
    """Per prompt of a (n, N) block: ill-posed mask (n,) bool, exponents (kx, ky) (n,) int64,
    exact scale factors s = (2^-kx, 2^-ky) (n, 2) and scaled shifts c (n, 2), in x's dtype."""
    xlo, xhi, ylo, yhi = x.amin(dim=1), x.amax(dim=1), y.amin(dim=1), y.amax(dim=1)  # (n,); NaN propagates
    kx = exponent_of(torch.maximum(xlo.abs(), xhi.abs()))  # (n,)
    ky = exponent_of(torch.maximum(ylo.abs(), yhi.abs()))
    s = torch.stack([pow2(-kx, x.dtype), pow2(-ky, x.dtype)], dim=1)  # (n, 2)
    n0 = min(x.shape[1], SHIFT_SAMPLES)
    c = torch.stack([(x[:, :n0] * s[:, :1]).mean(dim=1), (y[:, :n0] * s[:, 1:]).mean(dim=1)], dim=1)  # (n, 2)
    return ill_posed_context(xlo, xhi, ylo, yhi), kx, ky, s, c


def _sums(x: torch.Tensor, y: torch.Tensor, c: torch.Tensor, s: torch.Tensor | None = None) -> torch.Tensor:
    """G (B, 3, 2) = [[sum x', sum y'], [sum x'^2, sum x'y'], [sum y'x', sum y'^2]] of the shifted
    values x' = x s_x - c_x, y' = y s_y - c_y (s (B, 2) exact powers of two, None for 1), each one
    rounding of the exact difference; x, y (B, N), c (B, 2), all in x's dtype. On the CPU the
    prompts go through in chunks of about CHUNK_ELEMENTS values, x' and y' in one reused buffer."""
    B, N = x.shape
    Np = -(-N // ROW_ALIGN) * ROW_ALIGN  # rows padded with zeros (below: the answer then ignores the slot)
    if torch.is_grad_enabled() and (x.requires_grad or y.requires_grad):  # autograd records no out= ops
        xs, ys = (x, y) if s is None else (x * s[:, :1], y * s[:, 1:])
        z = torch.stack([torch.ones_like(x), xs - c[:, :1], ys - c[:, 1:]], dim=1)  # (B, 3, N)
        z = torch.nn.functional.pad(z, (0, Np - N))  # (B, 3, Np): the same sums as without gradients
        return torch.bmm(z, z[:, 1:3].transpose(1, 2))
    step = max(B, 1) if x.device.type != "cpu" else max(1, min(B, CHUNK_ELEMENTS // N))
    G = torch.empty(B, 3, 2, dtype=x.dtype, device=x.device)
    # rows 1, x', y' (reused per chunk), each padded with zeros to a multiple of ROW_ALIGN values: every
    # prompt's rows then start 64-byte aligned, and bmm's sums came out different in the last bits for
    # a prompt at an odd slot of the chunk (N >= 67: a reference that depended on batch_size; a review).
    # The zeros add exactly nothing to any sum.
    z = torch.zeros(step, 3, Np, dtype=x.dtype, device=x.device)
    z[:, 0, :N] = 1.0
    xs, ys, xy = z[:, 1, :N], z[:, 2, :N], z[:, 1:3].transpose(1, 2)  # views; xy (step, Np, 2)
    neg_c = -c  # (B, 2)
    for a in range(0, B, step):
        e = min(B, a + step)
        n = e - a
        if s is None:
            torch.sub(x[a:e], c[a:e, 0:1], out=xs[:n])  # one rounding of the exact difference
            torch.sub(y[a:e], c[a:e, 1:2], out=ys[:n])
        else:
            torch.addcmul(neg_c[a:e, 0:1], x[a:e], s[a:e, 0:1], out=xs[:n])  # x 2^-kx exact; one rounding
            torch.addcmul(neg_c[a:e, 1:2], y[a:e], s[a:e, 1:2], out=ys[:n])
        torch.bmm(z[:n], xy[:n], out=G[a:e])  # (n, 3, 2)
    return G


def _refined(x: torch.Tensor, y: torch.Tensor, c: torch.Tensor, s: torch.Tensor | None = None):
    """(c, G): the sums of `_sums` around the shift c (B, 2); where c sits far from the prompt's
    mean, c moves to c + mean(x', y') and the sums are taken again, up to REFINE_PASSES times.
    Far: sum x'^2 > REFINE Sxx or sum y'^2 > REFINE Syy, i.e. d^2 > REFINE - 1 for
    d = (c - mean) / sd. Outliers among the first SHIFT_SAMPLES values give d^2 up to N / 4, and the
    sums' rounding relative to Sxx grows as N u (1 + d^2) (docs/accuracy.md, "The criterion"). The
    exact sums do not depend on c; a constant x or y (sum of squares 0) is never far."""
    N = x.shape[1]
    G = _sums(x, y, c, s)
    if x.shape[0] == 0:
        return c, G
    grad = torch.is_grad_enabled() and (x.requires_grad or y.requires_grad)
    idx = None  # the prompts still to look at: all, then those just moved
    for _ in range(REFINE_PASSES):
        Gi = G if idx is None else G[idx]
        sq = Gi[:, 1:].diagonal(dim1=1, dim2=2)  # (n, 2) view: sum x'^2, sum y'^2
        # sum' v^2 > REFINE (sum' v^2 - (sum' v)^2 / N) as (REFINE - 1) N sum' v^2 < REFINE (sum' v)^2: fewer
        # passes; a NaN or inf sum compares False (inf - inf), so such a prompt is never moved
        far = ((sq * ((REFINE - 1) * N) - Gi[:, 0].square() * REFINE) < 0).any(dim=1)  # (n,)
        if not bool(far.any()):
            break
        o = Gi[:, 0] / N  # (n, 2): means of x', y'
        if grad:  # every prompt again, without in-place writes
            c = torch.where(far[:, None], c + o, c)
            G = _sums(x, y, c, s)
            continue
        sub = far.nonzero().squeeze(1) if idx is None else idx[far]  # (m,) prompt indices
        c = c.clone()
        c[sub] = c[sub] + o[far]
        G[sub] = _sums(x[sub], y[sub], c[sub], None if s is None else s[sub])
        idx = sub
    return c, G


def _scaled_sums(x: torch.Tensor, y: torch.Tensor):
    """Per prompt: exponents (kx, ky) (B,) int64, scaled shifts c (B, 2), the sums G (B, 3, 2) of
    `_sums` over the scaled shifted values, and the ill-posed mask of x, y alone (B,) bool; all in
    x's dtype."""
    bad, kx, ky, s, c = _ranges(x, y)  # (B,), (B,), (B,), (B, 2), (B, 2)
    c, G = _refined(x, y, c, s)
    return kx, ky, c, G, bad


FAST_RANGE = {torch.float64: 2.0**500, torch.float32: 2.0**60}  # fast path: sums of squares in [1/r, r]


def _fast_moments(x: torch.Tensor, y: torch.Tensor):
    """The unscaled one-pass sums, for the prompts whose data sit in a safe range (nearly all):
    (ok, c_x, o_x, y_bar, beta), each (B,), x_bar = c_x + o_x (the shift c_x and the mean of
    x - c_x, kept apart so that u - x_bar is (u - c_x) - o_x, docs/accuracy.md). The shift is the median of the first SHIFT_SAMPLES
    values, itself a data value, so a constant x gives x' = 0 exactly. `ok` holds where every sum
    is finite, 1/r <= sum x'^2, sum y'^2 <= r (r = FAST_RANGE: no product can underflow or overflow
    enough to matter, docs/accuracy.md) and Sxx > 0; the other prompts (constant x or y, NaN / inf,
    extreme scales) go through the scaled path."""
    B, N = x.shape
    n0 = min(N, SHIFT_SAMPLES)
    c = torch.stack([x[:, :n0].median(dim=1).values, y[:, :n0].median(dim=1).values], dim=1)  # (B, 2)
    c, G = _refined(x, y, c)  # (B, 2), (B, 3, 2)
    r = FAST_RANGE[x.dtype]
    sq = torch.stack([G[:, 1, 0], G[:, 2, 1]], dim=1)  # (B, 2) sum x'^2, sum y'^2
    offset = G[:, 0] / N  # (B, 2): mean of x', y'
    S = G[:, 1] - G[:, 0, :1] * offset  # (B, 2): Sxx, Sxy
    ok = torch.isfinite(G).all(dim=2).all(dim=1) & ((sq >= 1 / r) & (sq <= r)).all(dim=1) & (S[:, 0] > 0)
    return ok, c[:, 0], offset[:, 0], c[:, 1] + offset[:, 1], S[:, 1] / S[:, 0]


def _moments(x: torch.Tensor, y: torch.Tensor):
    """Scaled statistics: (kx, ky, c_x', o_x', y_bar', beta, bad, fast), x_bar = 2^kx (c_x' + o_x')
    (c_x' the shift, o_x' the mean of x' = x 2^-kx - c_x'), y_bar = 2^ky y_bar', slope =
    2^(ky - kx) beta; beta is NaN where `bad` (x or y ill-posed); `fast` marks the prompts the
    one-pass unscaled path answered (kx = ky = 0 there)."""
    if torch.is_grad_enabled() and (x.requires_grad or y.requires_grad):
        return (*_scaled_moments(x, y), torch.zeros(x.shape[0], dtype=torch.bool, device=x.device))
    fast, cx, ox, yb, beta = _fast_moments(x, y)
    kx = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
    ky, bad = kx.clone(), torch.zeros_like(fast)
    if not bool(fast.all()):
        idx = (~fast).nonzero().squeeze(1)
        for dst, src in zip((kx, ky, cx, ox, yb, beta, bad), _scaled_moments(x[idx], y[idx])):
            dst[idx] = src
    return kx, ky, cx, ox, yb, beta, bad, fast


def _scaled_moments(x: torch.Tensor, y: torch.Tensor):
    """`_moments` by the power-of-two scaled path, for every prompt: (kx, ky, c_x', o_x', y_bar', beta,
    bad); x_bar' = c_x' + o_x' (the shift and the mean of x - c_x, kept apart for u - x_bar)."""
    N = x.shape[1]
    kx, ky, c, G, bad = _scaled_sums(x, y)  # (B,), (B,), (B, 2), (B, 3, 2), (B,)
    offset = G[:, 0] / N  # (B, 2): mean of x', y'
    S = G[:, 1] - G[:, 0, :1] * offset  # (B, 2): Sxx', Sxy' (the shift's share removed)
    # Sxx' > 0 whenever x is not constant (docs/accuracy.md: its relative error is below
    # N u (1 + N / 4) < 1); the guard only keeps a violated bound from returning inf
    bad = bad | ~(S[:, 0] > 0)
    beta = torch.where(bad, float("nan"), S[:, 1] / S[:, 0])
    return kx, ky, c[:, 0], offset[:, 0], c[:, 1] + offset[:, 1], beta, bad


def ols_fit(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-prompt least-squares statistics.

    Args:
        x, y: (B, N) tensors of one floating dtype and device, N >= 2.
    Returns:
        (x_bar, y_bar, slope, intercept), each (B,), in the dtype of x. slope and intercept are
        NaN for ill-posed prompts (`ill_posed`: all x equal, or a NaN / inf in the prompt), and
        +-inf only where the true value overflows the dtype.
    """
    kx, ky, cx, ox, yb, beta, _, _ = _moments(x, y)
    xb = cx + ox  # (B,) scaled x_bar
    x_bar, y_bar = ldexp(xb, kx), ldexp(yb, ky)
    slope = ldexp(beta, ky - kx)
    intercept = ldexp(yb - beta * xb, ky)  # y_bar - slope * x_bar, in the scaled units
    return x_bar, y_bar, slope, intercept


def ols_predict(x: torch.Tensor, y: torch.Tensor, x_query: torch.Tensor) -> torch.Tensor:
    """Least-squares prediction at the query, (B,), in the dtype of x.

    Args:
        x, y: (B, N) context, N >= 2; x_query: (B,) query inputs u.
    Returns:
        y_bar + b_hat * (u - x_bar); NaN (never +-inf) for ill-posed prompts (`ill_posed`) and for
        a result that overflows the dtype. Accuracy (docs/accuracy.md): |error| <= (N + 4) u K
        with u the unit roundoff of the dtype and K the condition numerator of the prompt.
        y and x_query of another dtype are cast to x's (a float64 y beside a float32 x was rounded
        to float32 silently, and the answer promoted to float64: a review).
    """
    y, x_query = y.to(x.dtype), x_query.to(x.dtype)
    kx, ky, cx, ox, yb, beta, bad, fast = _moments(x, y)
    # (u - x_bar) 2^-kx as (u 2^-kx - c_x') - o_x': the scaling is exact and u - c_x' cancels
    # without loss near the prompt's offset, where u - (c_x' + o_x') would first round x_bar to the
    # offset's ulp (x = 1e4 + 0.01 z in float32: relative errors of order 1; docs/accuracy.md)
    q = x_query * pow2(-kx, x.dtype)  # (B,)
    over = ~torch.isfinite(q) & torch.isfinite(x_query)  # (B,) u far beyond tiny data: answered below
    d = (torch.where(over, torch.zeros_like(q), q) - cx) - ox  # no inf in the graph (autograd: 0 * inf)
    pred = ldexp(torch.addcmul(yb, beta, d), ky)  # (B,)
    redo = fast & ~torch.isfinite(pred) & torch.isfinite(x_query)  # an intermediate overflowed unscaled
    if bool(redo.any()):
        idx = redo.nonzero().squeeze(1)
        for dst, src in zip((kx, ky, cx, ox, yb, beta), _scaled_moments(x[idx], y[idx])):
            dst[idx] = src
        pred[idx] = ldexp(torch.addcmul(yb[idx], beta[idx], (x_query[idx] * pow2(-kx[idx], x.dtype) - cx[idx]) - ox[idx]),
                          ky[idx])
    far = (over | ~torch.isfinite(pred)) & torch.isfinite(x_query) & torch.isfinite(beta)  # (B,)
    if bool(far.any()):  # the query's scaled form overflowed (|u| 2^-kx, tiny data): intercept + slope u
        idx = far.nonzero().squeeze(1)
        alt = ldexp(yb[idx] - beta[idx] * (cx[idx] + ox[idx]), ky[idx]) + ldexp(beta[idx], ky[idx] - kx[idx]) * x_query[idx]
        pred = pred.index_put((idx,), alt)  # out of place: the gradient of the rows replaced is 0
    pred = pred.masked_fill(~torch.isfinite(pred), float("nan"))
    if x.dtype != torch.float32 or pred.requires_grad:
        return pred
    lost = torch.isnan(pred) & ~bad & torch.isfinite(beta) & torch.isfinite(x_query)  # (B,) overflowed inside
    if bool(lost.any()):
        # float32's exponent range is too short for the scaling: subnormal x (2^-149) scaled by at most
        # 2^104 left slope * u beyond float32 on answers of 1e32..3e38 (a review). float64 holds every
        # intermediate of float32 data: answer there, rounded once (NaN where it is beyond float32)
        idx = lost.nonzero().squeeze(1)
        redo = ols_predict(x[idx].double(), y[idx].double(), x_query[idx].double()).float()
        pred = pred.index_put((idx,), redo.masked_fill(~torch.isfinite(redo), float("nan")))
    return pred


def centred_scales(x: torch.Tensor, y: torch.Tensor):
    """Per prompt, scale-safe: (x_bar, y_bar, s_x, s_y), each (B,) in x's dtype, s the population
    standard deviations sqrt(Sxx / N), sqrt(Syy / N) computed without underflow or overflow
    (s_x = 0 for constant x; NaN where the prompt holds a NaN / inf). For standardizing prompts."""
    kx, ky, cx, ox, yb, _, _, _ = _moments(x, y)
    xb = cx + ox  # (B,) scaled x_bar
    x_bar, y_bar = ldexp(xb, kx), ldexp(yb, ky)
    sx = ((x * pow2(-kx, x.dtype)[:, None] - xb[:, None]) ** 2).mean(dim=1).sqrt()  # (B,) scaled
    sy = ((y * pow2(-ky, x.dtype)[:, None] - yb[:, None]) ** 2).mean(dim=1).sqrt()
    return x_bar, y_bar, ldexp(sx, kx), ldexp(sy, ky)
