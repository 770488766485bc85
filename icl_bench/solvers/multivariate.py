"""The d > 1 code paths of the built-in solvers (ols, scipy-lstsq, gd, gd-lsa, ln-closed-form).

Each solver keeps its one-dimensional path unchanged and calls the function here when the batch
carries d > 1 regressors (x (B, N, d); icl_bench/prompts/multivariate.py). A solver without a d > 1 path is
skipped for such a batch with the reason `MULTIVARIATE_SKIP` (see `check_regressors`).
Mathematics: docs/ln-closed-form-multivariate.md.
"""
from __future__ import annotations

import numpy as np
import scipy.linalg
import torch

from icl_bench.solvers.gd_mv import gd_predict_mv
from icl_bench.prompts.ols import ldexp, pow2
from icl_bench.prompts.ols_mv import SHIFT_SAMPLES, column_exponents, dot_scaled, ols_predict_mv
from icl_bench.prompts.generator import PromptBatch
from icl_bench.prompts.multivariate import make_tokens_mv, n_regressors
from icl_bench.solvers.base import SkipCell, nan_if_ill_posed

MULTIVARIATE_SKIP = "{name} handles one regressor only (d = 1); this cell has d = {d}"
CHUNK_ELEMENTS = 1 << 16  # CPU: prompts per gd chunk = this // (N * d)


def check_regressors(solver, batch: PromptBatch) -> None:
    """Raise SkipCell with the reason if `batch` has d > 1 and `solver` declares no d > 1 path
    (class attribute `multivariate = True`). Plugins that say nothing are skipped, never misfed."""
    d = n_regressors(batch)
    if d > 1 and not getattr(solver, "multivariate", False):
        raise SkipCell(MULTIVARIATE_SKIP.format(name=getattr(solver, "name", type(solver).__name__) or "solver", d=d))


def ols_mv(batch: PromptBatch) -> torch.Tensor:
    """`ols` for d > 1: QR least squares in the batch's dtype (icl_bench/prompts/ols_mv.py), (B,)."""
    pred = ols_predict_mv(batch.x, batch.y, batch.x_query, dtype=batch.dtype)
    return nan_if_ill_posed(pred, batch)


def scipy_lstsq_mv(batch: PromptBatch) -> torch.Tensor:
    """`scipy-lstsq` for d > 1: scipy.linalg.lstsq on [1, X] per prompt (float64) after exact scaling
    and centring, NaN where the float64 reference is NaN (ill-posed by its conditioning rule), (B,)
    in batch.dtype.

    Per prompt, before the solve (the maps of icl_bench/prompts/ols_mv.py; OLS is equivariant under
    each, so the answer is the same, and the query gets the same maps):
      1. x_j *= 2^-kx_j, y *= 2^-ky, kx_j and ky the binary exponents of max_i |x_ij| and max |y|
         (exact; every value below 1, so nothing over- or underflows at any finite scale);
      2. shift by the mean of the first SHIFT_SAMPLES scaled rows, then centre (x and y): lstsq never
         sees an offset, which it would otherwise carry in the ones column (x = 1e8 + z: relative
         errors up to 500 on the raw design);
      3. x~_j *= 2^-e_j, e_j the binary exponent of max_i |x~_ij| (exact): every column of the design
         is of size ~1, so lstsq's rank cut (eps sigma_max) and backward error are those of the
         centred problem.
    The prediction is 2^ky (y_bar' + theta_0 + theta . u~), theta = lstsq([1, X~], y~)."""
    x = batch.x.detach().cpu().double().numpy()  # (B, N, d)
    y = batch.y.detach().cpu().double().numpy()  # (B, N)
    u = batch.x_query.detach().cpu().double().numpy()  # (B, d)
    ok = torch.isfinite(batch.ols_prediction).cpu().numpy()  # (B,)
    x, y, u = x[ok], y[ok], u[ok]  # the steps below, batched over the prompts lstsq will see
    kx = np.frexp(np.abs(x).max(axis=1))[1]  # (b, d) (step 1)
    ky = np.frexp(np.abs(y).max(axis=1))[1]  # (b,)
    with np.errstate(over="ignore"):  # u far beyond tiny data: inf here, answered by the fallback below
        xs, ys, us = np.ldexp(x, -kx[:, None]), np.ldexp(y, -ky[:, None]), np.ldexp(u, -kx)  # exact
    k = min(x.shape[1], SHIFT_SAMPLES)
    cx, cy = xs[:, :k].mean(axis=1), ys[:, :k].mean(axis=1)  # (b, d), (b,) the shift (step 2)
    xp, yp = xs - cx[:, None], ys - cy[:, None]
    mx, my = xp.mean(axis=1), yp.mean(axis=1)
    xt, yt, du = xp - mx[:, None], yp - my[:, None], (us - cx) - mx  # centred; u - x_bar in the same units
    e = np.frexp(np.abs(xt).max(axis=1))[1]  # (b, d) (step 3)
    with np.errstate(over="ignore", invalid="ignore"):  # a query or answer beyond float64: NaN below
        xt, du = np.ldexp(xt, -e[:, None]), np.ldexp(du, -e)
        theta = np.stack([scipy.linalg.lstsq(np.column_stack([np.ones(x.shape[1]), xt[i]]), yt[i])[0]
                          for i in range(len(x))]) if len(x) else np.empty((0, x.shape[2] + 1))  # (b, d+1)
        fit = theta[:, 0] + (theta[:, 1:] * du).sum(axis=1)  # (b,) theta_0 + theta . u~
        pred_ok = np.ldexp((cy + my) + fit, ky)
        far = ~np.isfinite(pred_ok) & np.isfinite(u).all(axis=1)  # the query's scaled form overflowed
        if far.any():  # intercept + slope . u in unscaled units, as the reference's fallback
            slope = np.ldexp(theta[far, 1:], ky[far, None] - kx[far] - e[far])  # (f, d)
            shift = (theta[far, 1:] * np.ldexp(cx[far] + mx[far], -e[far])).sum(axis=1)  # (f,)
            intercept = np.ldexp((cy[far] + my[far]) + theta[far, 0] - shift, ky[far])  # (f,)
            pred_ok[far] = dot_scaled(torch.from_numpy(u[far]), torch.from_numpy(slope), torch.from_numpy(intercept)).numpy()
        out = np.full(ok.shape[0], np.nan)
        out[ok] = pred_ok
    pred = torch.from_numpy(out).to(device=batch.device, dtype=batch.dtype)
    return nan_if_ill_posed(pred, batch)


def gd_mv(batch: PromptBatch, steps: int, lr: float, variant: str) -> torch.Tensor:
    """`gd` for d > 1: K explicit GD steps (icl_bench/solvers/gd_mv.py), CPU prompts in cache-sized chunks."""
    N, d = batch.N, n_regressors(batch)
    step = max(batch.B, 1) if batch.device.type != "cpu" else max(1, CHUNK_ELEMENTS // (N * d))
    parts = [gd_predict_mv(c.x, c.y, c.x_query, steps, lr, variant)
             for c in (batch.slice(i, i + step) for i in range(0, max(batch.B, 1), step))]  # B = 0: one empty chunk
    return nan_if_ill_posed(torch.cat(parts), batch)


def r_lost_mv(tokens: torch.Tensor, R: float) -> torch.Tensor:
    """(B,) bool: prompts whose x, y or u are so large that R vanishes beside them in rounding
    (|value| * eps >= R); tokens (B, N+1, d+2) with R in the last slot (icl_bench.solver.r_lost for d = 1)."""
    return tokens[..., :-1].abs().amax(dim=(1, 2)) * torch.finfo(tokens.dtype).eps >= R


def _centre(v: torch.Tensor, q: torch.Tensor | None = None):
    """Shift by the mean of the first SHIFT_SAMPLES rows, then centre (as icl_bench/prompts/ols_mv.py):
    v (B, N, m) scaled values -> (centred v (B, N, m), mean (B, m), q - mean (B, m) or None)."""
    c = v[:, :SHIFT_SAMPLES].mean(dim=1)  # (B, m)
    vs = v - c[:, None]
    m = vs.mean(dim=1)  # (B, m)
    return vs - m[:, None], c + m, None if q is None else (q - c) - m


def standardize_mv(x: torch.Tensor, y: torch.Tensor, u: torch.Tensor):
    """Per prompt and column, from the context only: x' = (x - x_bar) / s_x, u' likewise,
    y' = (y - y_bar) / s_y (population standard deviations; 1 where a column is constant).
    OLS is equivariant: ols(x, y, u) = y_bar + s_y * ols(x', y', u').

    Scale-safe: each column of x and y is first multiplied by 2^-k, k the binary exponent of its
    max |value| (`column_exponents`, exact), shifted by the mean of its first SHIFT_SAMPLES rows and
    centred, so no square under- or overflows at any finite scale (x = 1e-200 z or 1e200 z), and an
    offset (x = 1e8 + z) costs one rounding relative to the spread, not to |x|. x', y', u' come out
    of the scaled values directly; y_bar and s_y are mapped back (they overflow only where y's own
    mean or spread exceeds the dtype's range).
    Args: x (B, N, d), y (B, N), u (B, d), one float dtype. Returns (x', y', u' in that dtype,
    y_bar (B,), s_y (B,)); a prompt with a NaN / inf gets NaN in its own rows only."""
    kx, ky = column_exponents(x), column_exponents(y[..., None])  # (B, d), (B, 1)
    px, py = pow2(-kx, x.dtype), pow2(-ky, x.dtype)  # exact 2^-k
    xt, _, ut = _centre(x * px[:, None], u * px)  # (B, N, d), _, (B, d)
    yt, yb, _ = _centre((y * py)[..., None])  # (B, N, 1), (B, 1)
    sx, sy = xt.pow(2).mean(1).sqrt(), yt.pow(2).mean(1).sqrt()  # (B, d), (B, 1), scaled units
    sx = torch.where(sx > 0, sx, torch.ones_like(sx))
    sy = torch.where(sy > 0, sy, torch.ones_like(sy))
    return xt / sx[:, None], (yt / sy[:, None])[..., 0], ut / sx, ldexp(yb, ky)[:, 0], ldexp(sy, ky)[:, 0]


def ln_inputs_mv(batch: PromptBatch, standardize: bool):
    """Tokens the d > 1 construction reads (B, N+1, d+2) and the map back: pred = shift + scale * out
    (shift, scale None without standardize)."""
    if not standardize:
        return batch.tokens, None, None
    xs, ys, us, y_bar, s_y = standardize_mv(batch.x, batch.y, batch.x_query)
    return make_tokens_mv(xs, ys, us, batch.R), y_bar, s_y


@torch.no_grad()
def ln_closed_form_mv(batch: PromptBatch, model, standardize: bool) -> torch.Tensor:
    """`ln-closed-form` for d > 1 with `model` = build_ln_construction_mv(batch.R, d, ...): (B,)
    predictions; NaN where the reference is NaN (ill-posed) or R is lost in rounding."""
    tokens, shift, scale = ln_inputs_mv(batch, standardize)
    out = model(tokens)  # (B,)
    if shift is not None:
        out = shift + scale * out
    out = out.masked_fill(r_lost_mv(tokens, batch.R), float("nan"))
    return nan_if_ill_posed(out, batch)
