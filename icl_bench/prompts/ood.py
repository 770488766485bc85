"""Out-of-distribution prompts: the `ood` axis of the benchmark matrix (docs/analysis.md,
section "Behavioural fingerprint"; the maps are those of icl_bench.analysis.fingerprint).

An OOD value is a string; "none" is the in-distribution prompt. The others map a drawn batch:

    x-shift:T     x_i -> x_i + T, u -> u + T, y unchanged (least squares moves with x: the OLS
                  prediction is unchanged, the truth y_query is unchanged)
    x-scale:S     x_i -> S x_i, u -> S u, y unchanged (S > 0; OLS prediction unchanged)
    student-t:NU  x and u drawn from Student's t with NU degrees of freedom (heavy tails; NU > 0),
                  y = a + b x + the batch's own noise (the same slope, intercept, noise draws)
    outliers:F    a fraction F in (0, 1] of each prompt's context y (at least one) replaced by
                  +-OUTLIER_SIZE (random sign); the query's truth is unchanged

The OLS reference of the mapped batch is recomputed on the mapped values (it is what least squares
gives on the data the solver sees), so mse_vs_ols measures how a solver follows least squares
off-distribution and mse_vs_truth how robust it is. Draws come from a CPU generator seeded by
`seed`, so an OOD cell is reproducible.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from icl_bench.errors import ConfigError
from icl_bench.prompts.generator import PromptBatch, make_tokens, seeded
from icl_bench.prompts.ols import ols_predict

KINDS = ("none", "x-shift", "x-scale", "student-t", "outliers")
OUTLIER_SIZE = 20.0  # |y| of a replaced context label (the in-distribution y has std ~ 1.4)


def needs_generator(value) -> bool:
    """True for an ood value that redraws the prompts from their slope and intercept (student-t:NU),
    which CSV prompts do not have; any text is accepted (a bad value is parse_ood's to refuse)."""
    return str(value).split(":", 1)[0].strip() == "student-t"


def parse_ood(value: str, where: str = "grid.ood") -> tuple[str, float]:
    """'x-shift:5' -> ('x-shift', 5.0); 'none' -> ('none', nan).

    Raises:
        ConfigError: an unknown kind, a missing or non-finite parameter, or one out of range.
    """
    accepted = "none, x-shift:T, x-scale:S (S > 0), student-t:NU (NU > 0), outliers:F (0 < F <= 1)"
    if not isinstance(value, str):
        raise ConfigError(f"{where}: {value!r} is not a string; accepted: {accepted}")
    if value == "none":
        return "none", math.nan
    kind, _, arg = value.partition(":")
    try:
        p = float(arg)
    except ValueError:
        p = math.nan
    ok = kind in KINDS[1:] and math.isfinite(p) and {
        "x-shift": True, "x-scale": p > 0, "student-t": p > 0, "outliers": 0 < p <= 1}[kind]
    if not ok:
        raise ConfigError(f"{where}: {value!r} is not accepted; accepted: {accepted}")
    return kind, p


def apply_ood(batch: PromptBatch, value: str, *, seed: int) -> PromptBatch:
    """The batch mapped as `value` says (module docstring); "none" returns `batch` itself.

    Args:
        batch: (B, N) prompts from the generator (student-t needs its slope and intercept).
        value: an OOD string; seed: seeds the draws of student-t and outliers.
    Returns:
        a new PromptBatch (same dtype, device and R), OLS reference recomputed in float64.
    Raises:
        ConfigError: a bad value, or student-t on a batch without slope / intercept (real data).
    """
    kind, p = parse_ood(value)
    if kind == "none":
        return batch
    dt, dev = batch.dtype, batch.device
    x, y, u = batch.x.double().cpu(), batch.y.double().cpu(), batch.x_query.double().cpu()  # (B,N),(B,N),(B,)
    yq, yc = batch.y_query.double().cpu(), batch.y_query_clean.double().cpu()
    a, b = batch.intercept.double().cpu(), batch.slope.double().cpu()
    gen = seeded(seed)
    if kind == "x-shift":
        x, u = x + p, u + p
    elif kind == "x-scale":
        x, u = x * p, u * p
    elif kind == "student-t":
        if not bool(torch.isfinite(a).all() & torch.isfinite(b).all()):
            raise ConfigError("grid.ood: student-t needs generated prompts (slope, intercept known), not data")
        eps, eps_q = y - (a[:, None] + b[:, None] * x), yq - yc  # the batch's own noise
        draws = torch.from_numpy(np.random.default_rng(int(seed)).standard_t(p, size=(x.shape[0], x.shape[1] + 1)))  # (B, N+1)
        x, u = draws[:, :-1], draws[:, -1]
        y = a[:, None] + b[:, None] * x + eps
        yc = a + b * u
        yq = yc + eps_q
    else:  # outliers
        B, N = y.shape
        k = max(1, int(round(p * N)))
        idx = torch.rand(B, N, generator=gen, dtype=torch.float64).argsort(1)[:, :k]  # (B, k) distinct slots
        sign = (torch.rand(B, k, generator=gen, dtype=torch.float64) < 0.5).double() * 2 - 1  # (B, k) +-1
        y = y.scatter(1, idx, OUTLIER_SIZE * sign)
    cast = lambda t_: t_.to(device=dev, dtype=dt)  # noqa: E731
    xs, ys, us = cast(x), cast(y), cast(u)
    return PromptBatch(x=xs, y=ys, x_query=us, y_query=cast(yq), y_query_clean=cast(yc), slope=batch.slope,
                       intercept=batch.intercept, ols_prediction=ols_predict(xs.double(), ys.double(), us.double()),
                       tokens=make_tokens(xs, ys, us, batch.R), R=batch.R)
