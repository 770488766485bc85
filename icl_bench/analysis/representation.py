"""Representation-space comparison of a model with the construction (docs/analysis.md).

Run both models on the same prompts and fit a linear map from the model's residual stream (after
each block) to the construction's: the R^2 per construction slot says what the model's stream
holds, and the map's closeness to a generalized permutation says whether it holds it in the
construction's basis up to the exact symmetries (docs/design.md, "Symmetries").
"""
from __future__ import annotations

import json
import math

import numpy as np
import scipy.optimize
import torch

from icl_bench.errors import ConfigError
from icl_bench.solvers.transformer import Transformer


def _r2_per_column(pred: np.ndarray, target: np.ndarray) -> np.ndarray:
    """(d,) R^2 of each target column; NaN where the target is constant (variance <= 1e-20 of
    its mean square, e.g. the construction's R slot)."""
    var = target.var(axis=0)
    ss_res = ((target - pred) ** 2).mean(axis=0)
    const = var <= 1e-20 * np.maximum((target ** 2).mean(axis=0), 1e-300)
    return np.where(const, np.nan, 1.0 - ss_res / np.where(const, 1.0, var))


def linear_map_fit(source: torch.Tensor, target: torch.Tensor) -> dict:
    """Fit target ~ source @ W (no intercept: the symmetries are linear) on the first half of the
    rows, score it on the second half.

    Args:
        source: (n, d_s) the model's activations; target: (n, d_t) the construction's.
    Returns:
        {"r2": (d_t,) held-out R^2 per target slot (NaN: constant slot), "gp": closeness of the
        map to a generalized permutation in [0, 1], "assignment": target slot -> source column
        (-1: slot left out), "W": (d_t, d_s) the map, target ~ source @ W.T (numpy float64)}.
        gp: rows of W (one per non-zero target slot; source columns scaled to unit RMS) are
        normalised, a one-to-one slot -> column matching maximises the sum of squared entries
        (scipy.optimize.linear_sum_assignment), gp = that sum / number of rows: 1 exactly when
        each slot reads a single column, 1/d_s for a perfectly flat map.
    Raises:
        ConfigError: row counts that differ, or fewer than 4 rows with finite values.
    """
    X, Y = source.detach().double().cpu().numpy(), target.detach().double().cpu().numpy()
    if X.shape[0] != Y.shape[0] or X.shape[0] < 4:
        raise ConfigError(f"source: need the same number (>= 4) of rows as target (got {X.shape[0]}, {Y.shape[0]})")
    ok = np.isfinite(X).all(1) & np.isfinite(Y).all(1)
    X, Y = X[ok], Y[ok]
    if X.shape[0] < 4:
        raise ConfigError(f"source: need >= 4 rows with finite values (got {X.shape[0]})")
    rms = np.sqrt((X ** 2).mean(axis=0))
    X = X / np.where(rms > 0, rms, 1.0)  # (n, d_s): unit-RMS columns
    half = X.shape[0] // 2
    W, *_ = np.linalg.lstsq(X[:half], Y[:half], rcond=None)  # (d_s, d_t)
    r2 = _r2_per_column(X[half:] @ W, Y[half:])
    W = W.T  # (d_t, d_s)
    live = np.flatnonzero(np.sqrt((Y ** 2).mean(axis=0)) > 0)  # slots that are not identically 0
    norms = np.linalg.norm(W[live], axis=1, keepdims=True)
    U = (W[live] / np.where(norms > 0, norms, 1.0)) ** 2  # (d_live, d_s) squared unit rows
    rows, cols = scipy.optimize.linear_sum_assignment(-U)
    assignment = np.full(Y.shape[1], -1)
    assignment[live[rows]] = cols
    gp = float(U[rows, cols].sum() / max(len(live), 1))
    return {"r2": r2, "gp": gp, "assignment": assignment.tolist(), "W": W / np.where(rms > 0, rms, 1.0)}


@torch.no_grad()
def representation_similarity(model: Transformer, construction: Transformer, tokens: torch.Tensor) -> dict:
    """Representation-space comparison (docs/design.md §7): for each block i, linear maps from the
    model's residual stream after it to the construction's (`linear_map_fit`), fitted on the
    first half of the prompts and scored on the second half, two ways:
      all tokens  one map for every token (the symmetries are one map for the whole stream);
      query       a map for the query token alone: the only token the readout reads, so after
                  the last block the context tokens are free (the construction's slot 3 there is
                  b_hat x~_i ~ y~_i, which any stream holding y predicts).
    Baseline: the all-token fit from the raw tokens (x, y, R), what needs no computation at all
    (x alone predicts x - x_bar with R^2 ~ 1 - 1/N).

    Args:
        model, construction: Transformers with the same number of blocks (float64 advised).
        tokens: (B, N+1, 3) prompts both read, B >= 8.
    Returns:
        flat {"repr.layer{i}.r2.s{j}", "repr.layer{i}.query_r2.s{j}", "repr.layer{i}.token_r2.s{j}"
        (held-out R^2 per construction slot j; NaN for a constant slot), "repr.layer{i}.r2_mean"
        (over non-constant slots, all tokens), "repr.layer{i}.gp", "repr.layer{i}.query_gp"
        (closeness to a generalized permutation), "repr.layer{i}.assignment" (JSON: slot ->
        model coordinate of the all-token map)}.
    Raises:
        ConfigError: different numbers of blocks, or fewer than 8 prompts.
    """
    if len(model.blocks) != len(construction.blocks):
        raise ConfigError(f"model: has {len(model.blocks)} blocks, the construction {len(construction.blocks)}")
    B, T, _ = tokens.shape
    if B < 8:
        raise ConfigError(f"tokens: need at least 8 prompts (got {B})")
    tm = model.probe(tokens.to(next(model.parameters()).dtype))
    tc = construction.probe(tokens.to(next(construction.parameters()).dtype))
    h = B // 2  # prompts per half: rows are prompt-major, so each half holds whole prompts
    out = {}
    for i in range(len(model.blocks)):
        key = f"layer{i}.resid"
        hm, hc = tm[key][: 2 * h].double().cpu(), tc[key][: 2 * h].double().cpu()  # (2h, T, d) each
        fit = linear_map_fit(hm.reshape(2 * h * T, -1), hc.reshape(2 * h * T, -1))
        query = linear_map_fit(hm[:, -1], hc[:, -1])  # (2h, d): the query token only
        base = linear_map_fit(tokens[: 2 * h].reshape(2 * h * T, -1), hc.reshape(2 * h * T, -1))
        for j in range(hc.shape[-1]):
            out[f"repr.layer{i}.r2.s{j}"] = float(fit["r2"][j])
            out[f"repr.layer{i}.query_r2.s{j}"] = float(query["r2"][j])
            out[f"repr.layer{i}.token_r2.s{j}"] = float(base["r2"][j])
        finite = fit["r2"][np.isfinite(fit["r2"])]
        out[f"repr.layer{i}.r2_mean"] = float(finite.mean()) if finite.size else math.nan
        out[f"repr.layer{i}.gp"] = fit["gp"]
        out[f"repr.layer{i}.query_gp"] = query["gp"]
        out[f"repr.layer{i}.assignment"] = json.dumps(fit["assignment"])
    return out
