"""Per-cell metrics: prediction errors against OLS / truth / target (weight sparsity: solvers/sparsity.py).

Errors are computed in float64 over the prompts where both the prediction and the reference are
finite, and (vs truth and vs target) the prompt is well-posed, so every solver is scored on the
same prompts; the non-finite predictions are counted (`n_nonfinite`; of those, the ones on prompts that
have a least-squares answer in `n_nonfinite_well_posed`), never silently averaged.
"""
from __future__ import annotations

import math

import torch

from icl_bench.prompts.generator import PromptBatch

QUANTILES = torch.tensor([0.5, 0.99], dtype=torch.float64)  # abs_err_median, abs_err_p99 (made once)


def _mse(pred: torch.Tensor, ref: torch.Tensor, ok: torch.Tensor, n: int | None = None) -> tuple[float, float]:
    """(mean, standard error of the mean) of the squared error over the prompts where `ok`
    (bool (B,): the caller's mask of prompts where pred and ref are both finite; `n`: its count
    of True, when the caller has it).

    The standard error is std(squared errors, ddof=1) / sqrt(n); NaN with fewer than 2 prompts.
    """
    n = int(ok.sum()) if n is None else n
    if n == 0:
        return math.nan, math.nan
    # every prompt scored (the usual case): the tensors as they are, not copies through the mask
    # (the same values in the same order, so the same bits; an 8-prompt cell's metrics spent a third
    # of their time in the masks' indexing)
    sq = (pred - ref if n == ok.numel() else pred[ok] - ref[ok]) ** 2  # (n,)
    se = float(sq.std(correction=1) / math.sqrt(n)) if n > 1 else math.nan
    return float(sq.mean()), se


def prediction_metrics(pred: torch.Tensor, batch: PromptBatch) -> dict[str, float | int]:
    """Error metrics of predictions against a batch's references.

    Args:
        pred: (B,) predictions (any float dtype/device).
        batch: the PromptBatch they answer.
    Returns:
        mse_vs_ols, mse_vs_truth (vs y_query_clean; NaN for real data), mse_vs_target
        (vs the noisy y_query), abs_err_median and abs_err_p99 (quantiles of |pred - ols|),
        n_nonfinite (number of non-finite predictions), n_ill_posed (prompts whose OLS reference is
        not finite: ill-posed, no least-squares answer; a solver answers NaN there),
        n_nonfinite_well_posed (non-finite predictions on the other prompts: the solver's own
        failures), and mse_vs_ols_se, mse_vs_truth_se (the
        standard error of those two means over the prompts: std of the squared errors / sqrt(n);
        used by the report for confidence intervals). Units: squared units of y, units of y.
    Raises:
        ValueError: pred is not of shape (B,).
    """
    if pred.shape != (batch.B,):
        raise ValueError(f"predict: returned shape {tuple(pred.shape)}, expected ({batch.B},)")
    p = pred.detach().to("cpu", torch.float64)
    ols = batch.ols_prediction.detach().to("cpu", torch.float64)
    err = (p - ols).abs()
    err = err[torch.isfinite(err)]  # (not p_ok & posed: a difference of two finite values can overflow)
    # both quantiles in one call (the same sort and interpolation as two calls, bit for bit; half the time)
    median, p99 = torch.quantile(err, QUANTILES).tolist() if err.numel() else (math.nan,) * 2
    # the masks once (a cell of 8 prompts spent most of its metrics time in such small calls):
    # p_ok, the finite predictions; posed, the well-posed prompts (a finite OLS answer)
    p_ok, posed = torch.isfinite(p), torch.isfinite(ols)  # (B,) bool
    scored = p_ok & posed  # (B,)
    n_ok, n_posed, n_scored = int(p_ok.sum()), int(posed.sum()), int(scored.sum())
    vs_ols, vs_ols_se = _mse(p, ols, scored, n_scored)
    # every solver is scored on the same prompts: the well-posed ones (a plugin's answer on a prompt
    # with no least-squares answer, where ols says NaN, had entered its error vs the target alone: a
    # mean over 512 prompts beside ols's over 187; found by a new-user tryout)
    truth = batch.y_query_clean.detach().to("cpu", torch.float64)
    target = batch.y_query.detach().to("cpu", torch.float64)
    vs_truth, vs_truth_se = _mse(p, truth, scored & torch.isfinite(truth))
    return {
        "mse_vs_ols": vs_ols,
        "mse_vs_ols_se": vs_ols_se,
        "mse_vs_truth": vs_truth,
        "mse_vs_truth_se": vs_truth_se,
        "mse_vs_target": _mse(p, target, scored & torch.isfinite(target))[0],
        "abs_err_median": median,
        "abs_err_p99": p99,
        "n_nonfinite": batch.B - n_ok,
        "n_ill_posed": batch.B - n_posed,
        "n_nonfinite_well_posed": n_posed - n_scored,
    }
