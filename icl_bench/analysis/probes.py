"""Mechanism probes: does a model's LayerNorm do the centering and the division?

Given a transformer's intermediates (`Transformer.probe`, names "layer{i}.resid", "layer{i}.ln",
each (B, N+1, d_model)) and the tokens it read (B, N+1, 3), regress what the closed form needs
against what the model holds (docs/design.md §5 and §7):

    centering  the residual stream after layer 1, context tokens  vs  x - x_bar and y - y_bar
    division   the query's LayerNorm output in layer 2             vs  b_hat (u - x_bar)

x_bar, y_bar, b_hat are the OLS statistics of the context (float64). For each target we report the
residual slot that tracks it best (a simple regression slot ~ target: R^2, slope, intercept; the
construction gives slot 0, 1 and 3 with slope 1) and how well the whole stream decodes it (target
~ all slots + intercept: R^2). Slot choice and slope make the probe indifferent to the
generalized-permutation symmetry of the residual stream (section 7), so it applies to trained
models too; r2_stream catches a quantity spread over several slots.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from icl_bench.errors import ConfigError
from icl_bench.prompts.ols import ols_fit


@dataclass(frozen=True)
class ProbeFit:
    """One probe: how a target quantity is represented in one set of activations."""

    target: str  # the regressed quantity, e.g. "x - x_bar"
    source: str  # trace key and tokens, e.g. "layer0.resid[context]"
    slot: int  # residual slot whose simple regression on the target has the highest R^2
    r2: float  # R^2 of slot = slope * target + intercept
    slope: float  # (1.0 for the construction)
    intercept: float
    r2_stream: float  # R^2 of target = stream @ w + c, all slots (linear decodability)
    n: int  # rows used (rows with a non-finite value are dropped)


def _r2(resid: torch.Tensor, values: torch.Tensor) -> float:
    ss_tot = (values - values.mean()).pow(2).sum()
    return float(1.0 - resid.pow(2).sum() / ss_tot) if ss_tot > 0 else float("nan")


def probe_fit(stream: torch.Tensor, target: torch.Tensor, *, name: str = "", source: str = "") -> ProbeFit:
    """Fit one probe in float64.

    Args:
        stream: (n, d) activations (any float dtype / device); target: (n,) the quantity.
        name, source: labels stored in the result.
    Returns:
        ProbeFit; r2 values are NaN when the target or every slot is constant.
    Raises:
        ConfigError: shapes that do not match, or fewer than 3 finite rows.
    """
    if stream.ndim != 2 or target.shape != stream.shape[:1]:
        raise ConfigError(f"stream: expected (n, d) activations and an (n,) target (got {tuple(stream.shape)}, {tuple(target.shape)})")
    S, t = stream.detach().double().cpu(), target.detach().double().cpu()
    keep = torch.isfinite(S).all(1) & torch.isfinite(t)
    S, t = S[keep], t[keep]  # (n, d), (n,)
    if t.numel() < 3:
        raise ConfigError(f"stream: a probe needs at least 3 finite rows (got {t.numel()})")
    tc, Sc = t - t.mean(), S - S.mean(0)  # centred: the intercepts drop out
    # finite values near 1e308 overflow when centred, and lstsq then failed with a torch internal
    # assert (publish of a run at noise 1e308; a review)
    if not (torch.isfinite(tc).all() and torch.isfinite(Sc).all()):
        raise ConfigError("stream: values too large to centre in float64 (they overflow); no probe fits")
    var_t = tc.pow(2).sum()
    best = (float("-inf"), 0, float("nan"), float("nan"))  # (r2, slot, slope, intercept)
    for k in range(S.shape[1]):
        slope = float((Sc[:, k] * tc).sum() / var_t) if var_t > 0 else float("nan")
        r2 = _r2(Sc[:, k] - slope * tc, Sc[:, k])
        if r2 == r2 and r2 > best[0]:  # skip NaN (constant slot)
            best = (r2, k, slope, float(S[:, k].mean() - slope * t.mean()))
    coef = torch.linalg.lstsq(Sc, tc[:, None], driver="gelsd").solution  # (d, 1); gelsd: rank-deficient ok
    r2_stream = _r2(tc - (Sc @ coef)[:, 0], t)
    r2_best = best[0] if best[0] != float("-inf") else float("nan")
    return ProbeFit(name, source, best[1], r2_best, best[2], best[3], r2_stream, int(t.numel()))


def mechanism_probes(trace: dict[str, torch.Tensor], tokens: torch.Tensor, *,
                     centering: str = "layer0.resid", division: str = "layer1.ln") -> dict[str, ProbeFit]:
    """The centering and division probes of a 2-layer model (see the module docstring).

    Args:
        trace: intermediates by name, as `Transformer.probe` (or a solver's `probe`) returns them.
        tokens: (B, N+1, 3) the tokens the model read: rows (x_i, y_i, R), last row (u, 0, R).
        centering, division: trace keys to probe (defaults: after block 0, LN of block 1).
    Returns:
        {"centering.x": ..., "centering.y": ..., "division": ...} of ProbeFit.
    Raises:
        ConfigError: a key missing from the trace, or shapes that do not match the tokens.
    """
    for key in (centering, division):
        if key not in trace:
            raise ConfigError(f"trace: no entry {key!r}; accepted: {', '.join(k for k in trace if k != 'tokens')}")
    B, T, _ = tokens.shape
    x, y, u = tokens[:, :-1, 0].double(), tokens[:, :-1, 1].double(), tokens[:, -1, 0].double()  # (B,N),(B,N),(B,)
    x_bar, y_bar, b_hat, _ = ols_fit(x, y)  # (B,) each
    h1 = trace[centering][:, :-1]  # (B, N, d) context tokens after layer 1
    q2 = trace[division][:, -1]  # (B, d) the query's LN output in layer 2
    if h1.shape[:2] != (B, T - 1) or q2.shape[0] != B:
        raise ConfigError(f"trace: activations {tuple(trace[centering].shape)} do not match tokens {tuple(tokens.shape)}")
    flat = h1.reshape(B * (T - 1), -1)  # (B*N, d)
    src = f"{centering}[context]"
    return {
        "centering.x": probe_fit(flat, (x - x_bar[:, None]).reshape(-1), name="x - x_bar", source=src),
        "centering.y": probe_fit(flat, (y - y_bar[:, None]).reshape(-1), name="y - y_bar", source=src),
        "division": probe_fit(q2, b_hat * (u - x_bar), name="b_hat (u - x_bar)", source=f"{division}[query]"),
    }
