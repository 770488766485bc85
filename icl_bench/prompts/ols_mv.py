"""Multivariate least squares with an intercept, batched, in float64: the reference for d >= 1 regressors.

Per prompt: context x_i in R^d, y_i (i = 1..N), query u in R^d. With the intercept eliminated by
centring (any textbook, e.g. Hastie, Tibshirani & Friedman, *Elements of Statistical Learning*,
section 3.2 and eq. 3.6):

    x_bar, y_bar = context means;  X~ = X - 1 x_bar^T (N x d);  y~ = y - y_bar 1
    beta_hat = argmin_beta || X~ beta - y~ ||_2            (d,)
    y_hat(u) = y_bar + (u - x_bar)^T beta_hat

How it is computed (every step batched over prompts, in float64):
  1. shift: c = mean of the first SHIFT_SAMPLES rows of x (and of y); x' = x - c. For data far from 0
     (x = 1.7e9 + j) the shifted values are small and exact or nearly so (Sterbenz), so the
     centring below cancels nothing of size |x| (the idea of the shifted algorithm in icl_bench/prompts/ols.py).
  2. centre: X~ = x' - mean(x'), y~ = y' - mean(y').
  3. equilibrate: A = X~ D^-1, D = diag(max_i |X~_ij|) (scale-safe: no squares of raw data are formed;
     column scaling leaves the fitted prediction unchanged).
  4. Householder QR of A (torch.linalg.qr, LAPACK geqrf), beta_eq = R^-1 Q^T y~ (triangular solve),
     beta_hat = D^-1 beta_eq. QR never forms A^T A, so it loses one factor kappa, not kappa^2, to
     rounding (Golub & Van Loan, *Matrix Computations*, 4th ed., section 5.3.8).

Ill-posedness (the NaN rule; docs/ln-closed-form-multivariate.md, "The reference"): a prompt has no
trustworthy least-squares answer when the rounding of the centred problem can make its design
rank-deficient. Two numbers measure that, both of the *centred* problem:
    kappa  = sigma_max(A) / sigma_min(A)  the condition number of the equilibrated centred design
    gamma  = max_j ||x'_j||_2 / ||X~_j||_2  how much of column j the centring cancelled (>= 1)
Computing X~ perturbs column j by about eps * ||x'_j|| = eps * gamma * ||X~_j|| (normwise), and
Householder QR adds a backward error of about N * eps (Higham, *Accuracy and Stability of
Numerical Algorithms*, 2nd ed., Theorem 19.4); a relative perturbation delta of A moves sigma_min by up
to delta * sigma_max, so the answer has no correct digit once N * eps * kappa * gamma >= 1:

    ill-posed  <=>  any non-finite value in x, y or u,  or  N * eps * kappa * gamma >= 1
                    (kappa = inf when a column of X~ is exactly 0 or N <= d).

The shift c is a mean of the prompt's own values, so gamma stays bounded (docs/accuracy.md, "The
criterion"); for d = 1 (kappa = 1) the rule then fires only for exactly equal x, the criterion of
icl_bench/prompts/ols.py. Predictions are NaN there (never +-inf).
"""
from __future__ import annotations

import torch

SHIFT_SAMPLES = 8  # rows of x (and y) whose mean is the shift c


def _as3d(x: torch.Tensor) -> torch.Tensor:
    """(B, N) -> (B, N, 1); (B, N, d) unchanged."""
    return x[..., None] if x.ndim == 2 else x


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
        "ill_posed" (B,) bool (the rule in the module docstring); and "_shift" (B, d), "_mxs" (B, d),
        the shift c and the mean of x - c, so x_bar = _shift + _mxs (used by ols_predict_mv).
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
    k = min(N, SHIFT_SAMPLES)
    cx, cy = x[:, :k].mean(dim=1), y[:, :k].mean(dim=1)  # (B, d), (B,)
    xs, ys = x - cx[:, None], y - cy[:, None]  # (B, N, d), (B, N): shifted
    mxs, mys = xs.mean(dim=1), ys.mean(dim=1)  # (B, d), (B,)
    xt, yt = xs - mxs[:, None], ys - mys[:, None]  # centred
    scale = xt.abs().amax(dim=1)  # (B, d) column max |X~_j|
    zero_col = (scale == 0).any(dim=1)  # (B,) a column with no spread at all
    A = xt / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]  # (B, N, d) equilibrated
    Q, Rm = torch.linalg.qr(A)  # (B, N, min(N,d)), (B, min(N,d), d)
    if N >= d:
        sv = torch.linalg.svdvals(Rm)  # (B, d): singular values of A (= those of R)
        kappa = sv[:, 0] / sv[:, -1]  # inf where sigma_min = 0
        qty = (Q.transpose(1, 2) @ yt[..., None])  # (B, d, 1)
        beta_eq = torch.linalg.solve_triangular(Rm, qty, upper=True).squeeze(-1)  # (B, d)
    else:  # fewer examples than regressors: never a unique fit
        kappa = torch.full((B,), float("inf"), dtype=x.dtype, device=x.device)
        beta_eq = torch.zeros(B, d, dtype=x.dtype, device=x.device)
    kappa = torch.where(zero_col | ~torch.isfinite(kappa), float("inf"), kappa)
    norm_s = torch.linalg.vector_norm(xs / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None], dim=1)
    norm_t = torch.linalg.vector_norm(A, dim=1)  # (B, d)
    gamma = (norm_s / norm_t).amax(dim=1)  # (B,) >= 1; NaN only with a zero column (then kappa = inf)
    eps = torch.finfo(dtype).eps
    ill = ~finite | ~(N * eps * kappa * torch.nan_to_num(gamma, nan=1.0) < 1.0)  # (B,)
    beta = beta_eq / torch.where(scale > 0, scale, torch.ones_like(scale))  # (B, d)
    beta = beta.masked_fill(ill[:, None], float("nan"))
    x_bar, y_bar = cx + mxs, cy + mys  # (B, d), (B,)
    return {"x_bar": x_bar, "y_bar": y_bar, "beta": beta, "intercept": y_bar - (x_bar * beta).sum(dim=1),
            "kappa": kappa, "gamma": gamma, "ill_posed": ill, "_shift": cx, "_mxs": mxs}  # noqa: E501


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
    du = (u - fit["_shift"]) - fit["_mxs"]  # (B, d): u - x_bar, from the shifted values
    pred = fit["y_bar"] + (du * fit["beta"]).sum(dim=1)  # (B,)
    return pred.masked_fill(~torch.isfinite(pred), float("nan"))
