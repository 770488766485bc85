"""Prompts with d regressors: y_i = a + w . x_i + eps_i, x_i in R^d (the multivariate extension).

The batch is the same `PromptBatch` as in one dimension; only the regressor fields gain a trailing
axis when d > 1 (d = 1 keeps the one-dimensional contract exactly, and is drawn by
`icl_bench.prompts.sample_prompts` itself, so every 1-D number stays bit-identical):

    field            d = 1        d > 1
    x                (B, N)       (B, N, d)      context regressors
    x_query          (B,)         (B, d)         query u
    slope            (B,)         (B, d)         w (NaN for the user's own data)
    tokens           (B, N+1, 3)  (B, N+1, d+2)  row i = (x_i, y_i, R); last row = (u, 0, R)
    y, y_query, y_query_clean, intercept, ols_prediction: (B, N) / (B,) in every d.

`ols_prediction` is the float64 reference of icl_bench/prompts/ols_mv.py (QR of the centred design,
conditioning-based NaN rule) for d > 1. Sampling order for d > 1 (one seeded CPU float64 generator,
as in one dimension): slope (B, d), intercept (B,), x (B, N, d), x_query (B, d), eps (B, N+1).

Correlated regressors: with x_corr = rho, each x_i (and u) is drawn coordinate-wise from spec.x
(values z) and mixed as x = loc + (z - loc) L^T, L the Cholesky factor of the equicorrelation
matrix Sigma = (1 - rho) I + rho 1 1^T. For x ~ N(0, I) this gives x ~ N(0, Sigma), whose
condition number is (1 + (d - 1) rho) / (1 - rho) (`equicorrelation_condition`).
"""
from __future__ import annotations

import math

import torch

from icl_bench.prompts.ols_mv import ols_predict_mv
from icl_bench.prompts.generator import (PromptBatch, PromptSpec, as_integer, as_real, check_device, make_batch,
                                        resolve_dtype, sample_prompts, seeded, shown)

MAX_D = 64  # regressors; a bigger d is refused (d_model = d + 3 and d + 1 layers grow with it)


def n_regressors(batch: PromptBatch) -> int:
    """d of a batch: 1 for x (B, N), x.shape[2] for x (B, N, d)."""
    return 1 if batch.x.ndim == 2 else batch.x.shape[2]


def equicorrelation_condition(d: int, rho: float) -> float:
    """Condition number (1 + (d-1) rho) / (1 - rho) of Sigma = (1 - rho) I + rho 1 1^T (d >= 1)."""
    return (1 + (d - 1) * rho) / (1 - rho)


def _check(d, x_corr) -> tuple[int, float]:
    """(d, x_corr) as (int, float) after checking them (one-element tensors and arrays are numbers).
    Raises ValueError naming the field."""
    given = d
    try:
        d = as_integer("d", d, 1)
    except ValueError:
        d = None
    if d is None or d > MAX_D:
        raise ValueError(f"d: must be an integer in [1, {MAX_D}] (got {shown(given)})")
    lo = -1.0 / (d - 1) if d > 1 else -1.0
    try:
        rho = as_real("x_corr", x_corr)
    except ValueError:
        rho = math.nan
    if not lo < rho < 1.0:
        raise ValueError(f"x_corr: must be a number in ({lo:g}, 1) for d = {d} (got {shown(x_corr)})")
    return d, rho


def make_tokens_mv(x: torch.Tensor, y: torch.Tensor, x_query: torch.Tensor, R: float) -> torch.Tensor:
    """Token matrix (B, N+1, d+2): rows (x_i, y_i, R), then (u, 0, R). Dtype / device of x.

    Args: x (B, N, d) or (B, N); y (B, N); x_query (B, d) or (B,); R the embedding constant.
    For x (B, N) the result equals icl_bench.prompts.make_tokens (d = 1)."""
    x3 = x[..., None] if x.ndim == 2 else x  # (B, N, d)
    u = x_query.reshape(x3.shape[0], x3.shape[2])  # (B, d)
    B, N, d = x3.shape
    tokens = torch.empty(B, N + 1, d + 2, dtype=x.dtype, device=x.device)
    tokens[:, :N, :d] = x3
    tokens[:, :N, d] = y
    tokens[:, N, :d] = u
    tokens[:, N, d] = 0.0
    tokens[:, :, d + 1] = R
    return tokens


def sample_prompts_mv(spec: PromptSpec, n_prompts: int, *, d: int = 1, x_corr: float = 0.0, seed: int,
                      dtype="float32", device="cpu") -> PromptBatch:
    """Draw `n_prompts` prompts with d regressors, reproducibly (module docstring for the fields).

    Args:
        spec: N, noise, R and the distributions; spec.x is used per coordinate, spec.slope per
            coordinate of w, spec.intercept for a.
        n_prompts: B >= 1.  d: regressors, 1..MAX_D.  x_corr: rho of the equicorrelated x
            (0 = independent coordinates), in (-1/(d-1), 1).
        seed, dtype, device: as in icl_bench.prompts.sample_prompts.
    Returns:
        PromptBatch; for d = 1 exactly sample_prompts(spec, n_prompts, ...).
    Raises:
        ValueError: bad d, x_corr, n_prompts or dtype (one line naming the field).
    """
    d, x_corr = _check(d, x_corr)
    if d == 1:  # one regressor: the 1-D generator itself (x_corr has no effect on a single coordinate)
        return sample_prompts(spec, n_prompts, seed=seed, dtype=dtype, device=device)
    n_prompts = as_integer("n_prompts", n_prompts, 1)
    check_device(device)
    gen = seeded(seed)
    B, N = n_prompts, spec.N
    slope = spec.slope.sample((B, d), gen)  # (B, d)
    intercept = spec.intercept.sample((B,), gen)  # (B,)
    x = spec.x.sample((B, N, d), gen)  # (B, N, d)
    u = spec.x.sample((B, d), gen)  # (B, d)
    if x_corr != 0.0:
        sigma = (1 - x_corr) * torch.eye(d, dtype=torch.float64) + x_corr
        L = torch.linalg.cholesky(sigma)  # (d, d)
        x = spec.x.loc + (x - spec.x.loc) @ L.T
        u = spec.x.loc + (u - spec.x.loc) @ L.T
    eps = spec.noise * torch.randn(B, N + 1, generator=gen, dtype=torch.float64)  # (B, N+1)
    y = intercept[:, None] + torch.einsum("bnd,bd->bn", x, slope) + eps[:, :N]  # (B, N)
    y_clean = intercept + (u * slope).sum(dim=1)
    return assemble_mv(x, y, u, y_clean + eps[:, N], y_clean, slope, intercept, R=spec.R, dtype=dtype, device=device)


def assemble_mv(x, y, u, y_query, y_clean, slope, intercept, *, R, dtype, device) -> PromptBatch:
    """A PromptBatch from float64 CPU arrays with d regressors (x (B, N, d), u (B, d), slope (B, d));
    casts to dtype / device, then computes the float64 reference from the cast values."""
    dt = resolve_dtype(dtype)
    cast = lambda t: t.to(device=device, dtype=dt)  # noqa: E731
    x, y, u = cast(x), cast(y), cast(u)
    return PromptBatch(
        x=x, y=y, x_query=u, y_query=cast(y_query), y_query_clean=cast(y_clean),
        slope=cast(slope), intercept=cast(intercept), ols_prediction=ols_predict_mv(x, y, u),
        tokens=make_tokens_mv(x, y, u, float(R)), R=float(R),
    )


def make_batch_mv(x, y, x_query, *, R: float, dtype="float64", device="cpu") -> PromptBatch:
    """The user's own arrays with d regressors as a PromptBatch (truth fields NaN).

    Args: x (B, N, d); y (B, N); x_query (B, d); R > 0 finite; dtype, device as in sample_prompts.
    With d = 1 the result is the univariate batch of `make_batch(x[..., 0], y, x_query[:, 0])`
    (x (B, N), x_query (B,)): every solver reads d = 1 that way.
    Raises: ValueError on shapes that do not match, N < 2 or a bad R / dtype / device."""
    R = as_real("R", R)
    check_device(device)
    x = torch.as_tensor(x, dtype=torch.float64).cpu()
    y = torch.as_tensor(y, dtype=torch.float64).cpu()
    u = torch.as_tensor(x_query, dtype=torch.float64).cpu()
    if x.ndim != 3 or y.shape != x.shape[:2] or u.shape != (x.shape[0], x.shape[2]):
        raise ValueError(f"x, y, x_query: expected (B, N, d), (B, N), (B, d) "
                         f"(got {tuple(x.shape)}, {tuple(y.shape)}, {tuple(u.shape)})")
    if x.shape[1] < 2:
        raise ValueError(f"N: must be >= 2 (got {x.shape[1]})")
    if not math.isfinite(R) or R <= 0:
        raise ValueError(f"R: must be finite and > 0 (got {R!r})")
    if x.shape[2] == 1:  # one regressor: the univariate batch
        return make_batch(x[..., 0], y, u[:, 0], R=R, dtype=dtype, device=device)
    nan = torch.full((x.shape[0],), float("nan"), dtype=torch.float64)
    return assemble_mv(x, y, u, nan, nan, torch.full_like(u, float("nan")), nan, R=R, dtype=dtype, device=device)
