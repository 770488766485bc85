"""Multivariate least squares with an intercept, batched, in float64: the reference for d >= 1 regressors.

Per prompt: context x_i in R^d, y_i (i = 1..N), query u in R^d. With the intercept eliminated by
centring (any textbook, e.g. Hastie, Tibshirani & Friedman, *Elements of Statistical Learning*,
section 3.2 and eq. 3.6):

    x_bar, y_bar = context means;  X~ = X - 1 x_bar^T (N x d);  y~ = y - y_bar 1
    beta_hat = argmin_beta || X~ beta - y~ ||_2            (d,)
    y_hat(u) = y_bar + (u - x_bar)^T beta_hat

How it is computed (every step batched over prompts, in float64):
  0. scale: each column j of x is multiplied by 2^-kx_j and y by 2^-ky, kx_j and ky the binary
     exponents of max_i |x_ij| and max_i |y_i| (`column_exponents`; clamped to +-exp_clamp(dtype), as
     in icl_bench/prompts/ols.py). Multiplying by a power of two is exact, and OLS is equivariant
     under it, so the scaled prompt has the same fit in scaled units; every scaled value is below 1
     (2^24 at the clamp), so no shift, sum or square below can overflow or underflow, for any
     finite data (1e-300 and 1e308 alike).
  1. shift: c = mean of the first SHIFT_SAMPLES scaled rows of x (and of y); x' = x - c. For data far
     from 0 (x = 1.7e9 + j) the shifted values are small and exact or nearly so (Sterbenz), so the
     centring below cancels nothing of size |x| (the idea of the shifted algorithm in icl_bench/prompts/ols.py).
     1b. where that shift lies far from the mean (||x'_j|| > 2 ||X~_j|| in a column, or the same in
     y: outliers among the first rows), it moves to c + mean(x') and steps 1-2 run again, up to
     REFINE_PASSES times (as `_refined` in icl_bench/prompts/ols.py): gamma below multiplies the
     rounding, and eight rows at 1e3 ahead of 2e4 standard-normal ones gave gamma = 50 and NaN
     (N eps kappa gamma >= 1) in float32 on a prompt with kappa = 28.
  2. centre: X~ = x' - mean(x'), y~ = y' - mean(y').
  3. equilibrate: A = X~ D^-1, D = diag(max_i |X~_ij|) (column scaling leaves the fitted prediction
     unchanged).
  4. Householder QR (torch.linalg.qr, mode "r": LAPACK geqrf) of the augmented [A, y~], whose last
     column then holds Q^T y~ (Q is never formed); beta_eq = R^-1 Q^T y~ (triangular solve), beta_hat
     = D^-1 beta_eq. [A, y~] gets zero rows up to a multiple of ROW_ALIGN (16), which changes neither R
     nor Q^T y~ in exact arithmetic and puts every prompt's columns on whole 64-byte lines: LAPACK's
     and bmm's sums differed in the last bits with a prompt's slot in the batch (up to 39 of 40
     prompts at N = 1001, so a prompt's reference depended on batch_size; a review); R is padded
     likewise for the triangular solve and for kappa (_block, _kappa). QR never forms A^T A, so it
     loses one factor kappa, not kappa^2, to rounding (Golub & Van Loan, *Matrix Computations*, 4th
     ed., section 5.3.8).
  5. map back: y_hat = 2^ky (y_bar' + sum_j (u_j 2^-kx_j - c_j - mean(x'_j)) beta'_j), beta' the
     slopes in scaled units, so no intermediate leaves the range either. Wherever steps 1-4 on the
     raw values neither overflow nor underflow, the result is bit for bit theirs (the maps are exact).
A prompt with a NaN / inf in x or y is replaced by zeros before any of this (its answer is NaN), so
LAPACK only ever sees finite, bounded values and one bad prompt never fails the batch.

Ill-posedness (the NaN rule; docs/ln-closed-form-multivariate.md, "The reference"): a prompt has no
trustworthy least-squares answer when the rounding of the centred problem can make its design
rank-deficient. Two numbers measure that, both of the *centred* problem:
    kappa  = sigma_max(A) / sigma_min(A)  the condition number of the equilibrated centred design
    gamma  = max_j ||x'_j||_2 / ||X~_j||_2  how much of column j the centring cancelled (>= 1)
Computing X~ perturbs column j by about eps * ||x'_j|| = eps * gamma * ||X~_j|| (normwise), and
Householder QR adds a backward error of about N * eps (Higham, *Accuracy and Stability of
Numerical Algorithms*, 2nd ed., Theorem 19.4); a relative perturbation delta of A moves sigma_min by up
to delta * sigma_max, so no correct digit is guaranteed once N * eps * kappa * gamma >= 1 (a
worst-case bound: measured errors are often smaller, e.g. 3 digits at N = 2000, kappa = 2e12 in
float64; and float32 `ols` at N > 1 / eps32 = 8.4e6 answers NaN even at kappa = 1, where the d = 1
path answers; docs/ln-closed-form-multivariate.md):

    ill-posed  <=>  any non-finite value in x, y or u,  or  N * eps * kappa * gamma >= 1
                    (kappa = inf when a column of X~ is exactly 0 or N <= d).

The shift c is a mean of the prompt's own values, so gamma stays bounded (docs/accuracy.md, "The
criterion"), and after step 1b it is at most 2 (sqrt(REFINE)) unless REFINE_PASSES did not
suffice; for d = 1 (kappa = 1) the rule then fires only for exactly equal x, the criterion of
icl_bench/prompts/ols.py. Predictions are NaN there (never +-inf).
"""
from __future__ import annotations

import torch

from icl_bench.prompts.ols import REFINE, REFINE_PASSES, ROW_ALIGN, exp_clamp, exponent_of, ldexp, pow2

SHIFT_SAMPLES = 8  # rows of x (and y) whose mean is the shift c
SV_ALIGN = 4  # _block pads R to a multiple of this size (a 4 x 4 block is whole 64-byte lines in float32 and float64)


def _as3d(x: torch.Tensor) -> torch.Tensor:
    """(B, N) -> (B, N, 1); (B, N, d) unchanged."""
    return x[..., None] if x.ndim == 2 else x


def column_exponents(x: torch.Tensor) -> torch.Tensor:
    """Per prompt and column of x (B, N, d), any float dtype: (B, d) int64 k with max_i |x_ij| < 2^k
    (0 for a zero column or one holding a NaN / inf), clamped to +-exp_clamp(x.dtype), so that
    x_ij 2^-k is exact and below 1 in magnitude (below 2^24 at the clamp)."""
    return exponent_of(x.abs().amax(dim=1))  # (B, d); NaN / inf propagate to 0


def ols_fit_mv(x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """Per-prompt least-squares fit with an intercept, in float64 (or `dtype`).

    Args:
        x: (B, N, d) context regressors, or (B, N) for d = 1; any float dtype (cast to `dtype`).
        y: (B, N) context targets.
        dtype: the arithmetic (float64 for the reference; the `ols` solver passes the batch's dtype,
            and eps in the NaN rule is that dtype's).
    Returns:
        dict of tensors in `dtype`: "x_bar" (B, d), "y_bar" (B,), "beta" (B, d) (slopes; NaN where
        ill-posed), "intercept" (B,) = y_bar - x_bar . beta, "kappa" (B,) the condition number of
        the equilibrated centred design, "gamma" (B,) the centring cancellation factor, and
        "ill_posed" (B,) bool (the rule in the module docstring). x_bar, y_bar, beta and intercept are
        mapped back from scaled units (module docstring, step 0): +-inf only where the true value
        overflows the dtype. Private, in scaled units (used by ols_predict_mv): "_kx" (B, d) and
        "_ky" (B,) the exponents, "_shift" (B, d) the shift c, "_mxs" (B, d) the mean of x' - c (so
        x_bar = 2^kx (_shift + _mxs)), "_y_bar" (B,) and "_beta" (B, d).
    Raises:
        ValueError: x, y shapes that do not match.
    """
    x = _as3d(x).to(dtype)
    y = y.to(dtype)
    if x.ndim != 3 or y.shape != x.shape[:2]:
        raise ValueError(f"x, y: expected x (B, N, d) or (B, N) and y (B, N) (got {tuple(x.shape)}, {tuple(y.shape)})")
    B, N, d = x.shape
    finite = torch.isfinite(x).all(dim=(1, 2)) & torch.isfinite(y).all(dim=1)  # (B,)
    x = torch.where(finite[:, None, None], x, torch.zeros((), dtype=x.dtype))  # keep LAPACK away from NaN
    y = torch.where(finite[:, None], y, torch.zeros((), dtype=y.dtype))
    kx, ky = column_exponents(x), column_exponents(y[..., None])[:, 0]  # (B, d), (B,)
    x = x * pow2(-kx, dtype)[:, None]  # (B, N, d): exact, every |value| < 1 (step 0)
    y = y * pow2(-ky, dtype)[:, None]  # (B, N)
    k = min(N, SHIFT_SAMPLES)
    cx, cy = x[:, :k].mean(dim=1), y[:, :k].mean(dim=1)  # (B, d), (B,)
    for rounds in range(REFINE_PASSES + 1):  # step 1b: a shift far from the mean moves to it
        xs, ys = x - cx[:, None], y - cy[:, None]  # (B, N, d), (B, N): shifted
        mxs, mys = xs.mean(dim=1), ys.mean(dim=1)  # (B, d), (B,)
        xt, yt = xs - mxs[:, None], ys - mys[:, None]  # centred
        ss, tt = (xs * xs).sum(dim=1), (xt * xt).sum(dim=1)  # (B, d): ||x'_j||^2, ||X~_j||^2 (every |value| < 2)
        far = (ss > REFINE * tt).any(dim=1) | ((ys * ys).sum(dim=1) > REFINE * (yt * yt).sum(dim=1))  # (B,): gamma > 2
        if rounds == REFINE_PASSES or B == 0 or not bool(far.any()):
            break
        cx, cy = torch.where(far[:, None], cx + mxs, cx), torch.where(far, cy + mys, cy)
    scale = xt.abs().amax(dim=1)  # (B, d) column max |X~_j|
    zero_col = (scale == 0).any(dim=1)  # (B,) a column with no spread at all
    A = xt / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]  # (B, N, d) equilibrated
    pad = -N % ROW_ALIGN  # zero rows: each prompt's columns start 64-byte aligned (step 4)
    Ay = A.new_empty(B, N + pad, d + 1)  # (B, Np, d + 1): [A, y~] above zero rows
    Ay[:, :N, :d], Ay[:, :N, d], Ay[:, N:] = A, yt, 0.0
    grad = torch.is_grad_enabled() and Ay.requires_grad  # (mode "r" has no derivative: the same R, with Q)
    Ry = torch.linalg.qr(Ay, mode="reduced" if grad else "r")[1]  # (B, min(Np, d + 1), d + 1): [[R, Q^T y~], [0, *]]
    if N >= d:
        Rm, qty = Ry[:, :d, :d], Ry[:, :d, d:]  # (B, d, d), (B, d, 1)
        kappa = _kappa(Rm)  # (B,) inf where sigma_min = 0
        # the triangular solve on R padded like _kappa's (with 1 on the new diagonal, and zeros below
        # Q^T y~): MKL's solve answered differently in the last bits at odd slots from d = 35 (a review)
        R1 = _block(Rm, torch.ones_like(Rm[:, :1, 0]))  # (B, dp, dp)
        qty = torch.cat([qty, qty.new_zeros(B, R1.shape[-1] - d, 1)], dim=1)  # (B, dp, 1)
        beta_eq = torch.linalg.solve_triangular(R1, qty, upper=True)[:, :d, 0]  # (B, d)
    else:  # fewer examples than regressors: never a unique fit
        kappa = torch.full((B,), float("inf"), dtype=x.dtype, device=x.device)
        beta_eq = torch.zeros(B, d, dtype=x.dtype, device=x.device)
    kappa = torch.where(zero_col | ~torch.isfinite(kappa), float("inf"), kappa)
    gamma = (ss / tt).sqrt().amax(dim=1)  # (B,) max_j ||x'_j|| / ||X~_j|| >= 1; NaN only with a zero column (kappa = inf)
    eps = torch.finfo(dtype).eps
    ill = ~finite | ~(N * eps * kappa * torch.nan_to_num(gamma, nan=1.0) < 1.0)  # (B,)
    beta = beta_eq / torch.where(scale > 0, scale, torch.ones_like(scale))  # (B, d) scaled units
    beta = beta.masked_fill(ill[:, None], float("nan"))
    x_bar, y_bar = cx + mxs, cy + mys  # (B, d), (B,) scaled units
    intercept = ldexp(y_bar - (x_bar * beta).sum(dim=1), ky)  # y_bar - x_bar . beta, formed in scaled units
    return {"x_bar": ldexp(x_bar, kx), "y_bar": ldexp(y_bar, ky), "beta": ldexp(beta, ky[:, None] - kx),
            "intercept": intercept, "kappa": kappa, "gamma": gamma, "ill_posed": ill,
            "_kx": kx, "_ky": ky, "_shift": cx, "_mxs": mxs, "_y_bar": y_bar, "_beta": beta}


def _block(Rm: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """[[R, 0], [0, fill I]] (B, dp, dp), each R (B, d, d) padded to dp, a multiple of SV_ALIGN, with
    `fill` (B, 1) on the new diagonal: every block then starts on a whole 64-byte line, and LAPACK's
    and MKL's per-matrix kernels answer the same bits at any slot of the batch."""
    B, d = Rm.shape[0], Rm.shape[-1]
    dp = -(-d // SV_ALIGN) * SV_ALIGN
    block = Rm.new_zeros(B, dp, dp)
    block[:, :d, :d] = Rm
    extra = torch.arange(d, dp, device=Rm.device)
    block[:, extra, extra] = fill  # (B, 1) broadcast over the new diagonal
    return block


def _kappa(Rm: torch.Tensor) -> torch.Tensor:
    """sigma_max / sigma_min of each R (B, d, d), (B,): the condition number of A (same singular
    values). R is padded (_block) with |R_00| on the new diagonal entries: a triangular R's first
    column has norm |R_00|, which lies between its sigma_min and sigma_max, so the block-diagonal
    [[R, 0], [0, |R_00| I]] has R's extreme singular values (LAPACK's gesdd answered differently in
    the last bits at odd slots when d = 7)."""
    sv = torch.linalg.svdvals(_block(Rm, Rm[:, :1, 0].abs()))  # (B, dp), descending
    return sv[:, 0] / sv[:, -1]


def ols_predict_mv(x: torch.Tensor, y: torch.Tensor, x_query: torch.Tensor,
                   dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Least-squares prediction at the query, (B,) in `dtype` (float64: the reference), d >= 1 regressors.

    Args:
        x: (B, N, d) or (B, N); y: (B, N); x_query: (B, d) or (B,) (d = 1). Any float dtype.
        dtype: the arithmetic, as in ols_fit_mv.
    Returns:
        y_bar + (u - x_bar) . beta_hat on x's device; NaN (never +-inf) for ill-posed
        prompts (module docstring), a non-finite query, or a result that overflows.
    Raises:
        ValueError: shapes that do not match.
    """
    fit = ols_fit_mv(x, y, dtype)
    u = x_query.to(dtype)
    u = u[:, None] if u.ndim == 1 else u  # (B, d)
    if u.shape != fit["x_bar"].shape:
        raise ValueError(f"x_query: expected shape {tuple(fit['x_bar'].shape)} (got {tuple(x_query.shape)})")
    du = (u * pow2(-fit["_kx"], dtype) - fit["_shift"]) - fit["_mxs"]  # (B, d): (u - x_bar) 2^-kx, shifted
    pred = ldexp(fit["_y_bar"] + (du * fit["_beta"]).sum(dim=1), fit["_ky"])  # (B,)
    far = ~torch.isfinite(pred) & torch.isfinite(u).all(dim=1) & ~fit["ill_posed"]  # (B,)
    if u.shape[0] and bool(far.any()):  # the query's scaled form overflowed (|u| 2^-kx, tiny data): intercept + u . beta
        pred = torch.where(far, dot_scaled(u, fit["beta"], fit["intercept"]), pred)
    return pred.masked_fill(~torch.isfinite(pred), float("nan"))


def dot_scaled(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """c + sum_j a_j b_j per row, a, b (B, d), c (B,), without an intermediate overflow: each product
    (one rounding, as a_j b_j) and c are kept as mantissa 2^exponent and summed in units of the
    largest exponent, so terms of 1e300 and -1e300 cancel where their plain products were inf and
    inf - inf NaN. +-inf only where the sum overflows. A term more than about 2^-1075 (float32:
    2^-150) below the largest underflows to 0 in those units, so where the largest terms cancel
    exactly it is lost (e.g. 1e300 1e300 - 1e300 1e300 + 1 gives 0): an absolute error far below
    the largest term's rounding, inside the normwise bound of docs/accuracy.md."""
    (ma, ea), (mb, eb), (mc, ec) = torch.frexp(a), torch.frexp(b), torch.frexp(c)
    m = torch.cat([ma * mb, mc[:, None]], dim=1)  # (B, d + 1): mantissas, |.| < 1
    e = torch.cat([ea + eb, ec[:, None]], dim=1).to(torch.int64)  # (B, d + 1): exponents
    k = 2 * exp_clamp(a.dtype)  # ldexp's range; beyond it the sum overflows, or a term vanishes, anyway
    E = e.max(dim=1).values.clamp(-k, k)  # (B,)
    return ldexp(ldexp(m, (e - E[:, None]).clamp(min=-k)).sum(dim=1), E)
