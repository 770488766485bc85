"""The solver contract: a small class with declared parameters and `predict(batch) -> (B,)`.

Write a solver by subclassing `Solver`, declaring `params` (name -> `Param`) and implementing
`predict`. Register it with `@register_solver("name")` (inside icl_bench) or through the
`icl_bench.solvers` entry-point group (plugins; docs/plugins.md).

    @register_solver("my-solver")
    class MySolver(Solver):
        '''One line that `icl-bench list` shows.'''
        params = {"steps": Param(4, "number of iterations")}

        def predict(self, batch):          # batch: PromptBatch
            ...                            # -> (B,) tensor, batch.dtype, batch.device
"""
from __future__ import annotations

import difflib
import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from icl_bench.errors import ConfigError
from icl_bench.prompts.generator import PromptBatch
from icl_bench.prompts.ols import ill_posed, ill_posed_context
from icl_bench.solvers.fused_screens import apply_screens


def nan_if_ill_posed(pred: torch.Tensor, batch: PromptBatch, r_lost: bool = False,
                     extremes: torch.Tensor | None = None) -> torch.Tensor:
    """`pred` (B,) with NaN at every prompt that has no unique least-squares answer, and in
    place of +-inf (an overflow is no answer either).

    Ill-posed prompts are those of `icl_bench.prompts.ols.ill_posed`, the one criterion every
    least-squares solver shares: a NaN or inf in x, y or the query, or all x exactly equal
    (docs/accuracy.md); a prompt whose float64 OLS reference overflows is treated alike. No finite
    answer to them is right, so a solver reports NaN there (and the runner counts it in
    `n_nonfinite`) instead of whatever finite number its arithmetic happens to produce.
    With r_lost=True (d = 1 only) the prompts of `r_lost(batch.tokens, batch.R)` are NaN too, from
    the same pass over x and y (`ill_posed_or_r_lost`). `extremes` (d = 1; ignored for d > 1): the
    prompts' (x_min, x_max, y_min, y_max) (B, 4) when already known (the fused kernel reads them,
    `Transformer.forward_extremes`), so x and y are not read again. Returns a new tensor; `pred`
    is untouched.
    """
    if batch.d > 1:  # d regressors: the reference's conditioning rule (icl_bench/prompts/ols_mv.py)
        bad = ~torch.isfinite(batch.ols_prediction)  # (B,)
    elif extremes is not None:  # the kernel's extremes: x and y are not read again
        return screen_answers(pred, extremes, batch.x_query, batch.R if r_lost else None,
                              batch.ols_prediction, inf_is_nan=True)
    else:
        test = ill_posed_or_r_lost(batch.x, batch.y, batch.x_query, batch.R) if r_lost else \
            ill_posed(batch.x, batch.y, batch.x_query)
        bad = test | ~torch.isfinite(batch.ols_prediction)  # (B,)
    ok = ~bad.to(pred.device) & ~torch.isinf(pred)  # (B,)
    return pred.masked_fill(~ok, float("nan"))


def r_lost(tokens: torch.Tensor, R: float) -> torch.Tensor:
    """(B,) bool: prompts whose x, y or u are so large that R vanishes in rounding beside them
    (|value| * eps >= R, eps of the tokens' dtype; e.g. |x| ~ 1e30 with R = 100 in float64).
    A model that reads R from the token's third slot cannot tell it from the data there, so its
    output carries no slope: transformer solvers answer NaN for these prompts.
    Args: tokens (B, N+1, 3) as the model reads them; R the constant in their third slot."""
    # max |value| over all 3 slots as max(amax, -amin): two passes and no |tokens| temporary (half
    # the time of abs().amax(), docs/throughput.md). The third slot holds R itself, and R * eps < R
    # never trips the test, so the answer is that of the x and y slots alone (NaN stays NaN: False)
    flat = tokens.flatten(1)  # (B, 3(N+1)); reshape(B, -1) refused B = 0
    return torch.maximum(flat.amax(dim=1), -flat.amin(dim=1)) * torch.finfo(tokens.dtype).eps >= R


def ill_posed_or_r_lost(x: torch.Tensor, y: torch.Tensor, u: torch.Tensor, R: float) -> torch.Tensor:
    """(B,) bool: `ill_posed(x, y, u) | r_lost(make_tokens(x, y, u, R), R)`, from one minimum and one
    maximum per prompt of x and of y (four passes over the context where the two calls take
    eight, over tokens three values wide). The same answer: a token's largest |value| is that of
    x, y or u, since R * eps < R never trips the test and the query's y slot is 0.
    Args: x, y (B, N); u (B,); R > 0 the embedding constant."""
    xlo, xhi, ylo, yhi = x.amin(dim=1), x.amax(dim=1), y.amin(dim=1), y.amax(dim=1)  # (B,); NaN propagates
    return screens(xlo, xhi, ylo, yhi, u, R)


def screens(xlo: torch.Tensor, xhi: torch.Tensor, ylo: torch.Tensor, yhi: torch.Tensor, u: torch.Tensor,
            R: float | None = None) -> torch.Tensor:
    """(B,) bool: `ill_posed(x, y, u)`, and with R given `| r_lost(make_tokens(x, y, u, R), R)`,
    from the per-prompt extremes of the context: xlo, xhi, ylo, yhi (B,) the least and largest x
    and y (NaN, or +-inf, where a value is non-finite: such prompts are ill-posed), u (B,) the
    query, R > 0 the embedding constant. The sign of a zero extreme changes no answer."""
    bad = ill_posed_context(xlo, xhi, ylo, yhi) | ~torch.isfinite(u)  # (B,)
    if R is None:
        return bad
    big = torch.maximum(torch.maximum(xhi, -xlo), torch.maximum(yhi, -ylo))  # (B,) max |x|, |y|
    return bad | (torch.maximum(big, u.abs()) * torch.finfo(xlo.dtype).eps >= R)  # NaN: False (ill-posed anyway)


def screen_answers(pred: torch.Tensor, extremes: torch.Tensor, u: torch.Tensor, R: float | None = None,
                   ols: torch.Tensor | None = None, inf_is_nan: bool = False) -> torch.Tensor:
    """`pred` (B,) with NaN where `screens(*extremes.unbind(1), u, R)` is True, where `ols` (B,)
    is not finite and (inf_is_nan) where pred is +-inf: in one numba loop where it runs
    (`icl_bench.solvers.fused_screens.apply_screens`, the same answers), else in torch.
    extremes (B, 4): per-prompt (x_min, x_max, y_min, y_max), e.g. `Transformer.forward_extremes`'s.
    Returns a new tensor; `pred` is untouched. Raises ValueError for shapes that do not fit pred."""
    screened = apply_screens(pred, extremes, u, R, ols, inf_is_nan)
    if screened is not None:
        return screened
    bad = screens(*extremes.unbind(1), u, R)  # (B,)
    if ols is not None:
        bad = bad | ~torch.isfinite(ols)
    if inf_is_nan:
        bad = bad | torch.isinf(pred)
    return pred.masked_fill(bad.to(pred.device), float("nan"))


def _toml(v: Any) -> str:
    """A value as a TOML config writes it (strings quoted, booleans lower case)."""
    return json.dumps(v) if isinstance(v, (bool, str)) else repr(v)


class SkipCell(Exception):
    """Raised by a solver that cannot handle a cell; the runner records status="skipped"."""


@dataclass(frozen=True)
class Param:
    """A declared solver parameter: its default (which fixes the type), help text and choices."""

    default: Any
    help: str = ""
    choices: tuple | None = None  # accepted values, or None for any value of the default's type
    min: float | None = None  # inclusive lower bound for numbers
    max: float | None = None  # inclusive upper bound for numbers
    gt: float | None = None  # exclusive lower bound for numbers (e.g. a step size > 0)
    same: Callable[[Any], Any] | None = None  # a checked value -> its canonical form, for a list's
    # repeat check (values of one form would run the same cells twice: a folder and its real path)

    def describe(self, name: str) -> str:
        """The parameter as `icl-bench list` shows it, a config key with its default, the accepted
        values in parentheses, then the help: 'steps = 16  (int >= 1, <= 4096)  K, the number of GD steps'."""
        bounds = [f"{op} {b:g}" for op, b in ((">=", self.min), (">", self.gt), ("<=", self.max)) if b is not None]
        kind = f"{type(self.default).__name__} {', '.join(bounds)}".strip()
        if self.choices:
            kind = "one of " + " | ".join(map(_toml, self.choices))
        return f"{name} = {_toml(self.default)}  ({kind})  {self.help}".rstrip()

    def check(self, solver: str, name: str, value: Any) -> Any:
        """Validate and coerce `value`; ConfigError naming solver, parameter and accepted values."""
        kind = type(self.default)
        where = f"solvers.{solver}.{name}"
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not kind:
            raise ConfigError(f"{where}: expected {kind.__name__}, got {value!r}")
        if kind is float and not math.isfinite(value):
            raise ConfigError(f"{where}: must be finite (got {value!r})")
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"{where}: {value!r} is not accepted; accepted: {', '.join(map(str, self.choices))}")
        if self.min is not None and not value >= self.min:
            raise ConfigError(f"{where}: must be >= {self.min} (got {value!r})")
        if self.gt is not None and not value > self.gt:
            raise ConfigError(f"{where}: must be > {self.gt} (got {value!r})")
        if self.max is not None and not value <= self.max:
            raise ConfigError(f"{where}: must be <= {self.max} (got {value!r})")
        return value


class Solver(ABC):
    """Base class. Subclasses set `params` and implement `predict`.

    Attributes:
        name: the registered name (set by the registry).
        params: class-level declaration, name -> Param.
        values: this instance's parameter values, name -> value (defaults filled in).
    """

    name: ClassVar[str] = ""
    params: ClassVar[dict[str, Param]] = {}

    def __init__(self, **values: Any):
        """Check `values` against `params` (ConfigError: an unknown parameter or a bad value).

        A subclass that checks its values further raises ConfigError ("solvers.NAME.PARAM: ...")
        for bad input: the matrix config refuses it (exit 2). Any other exception from building a
        solver (a plain ValueError included) is the solver failing: its cells become error rows."""
        unknown = sorted(set(values) - set(self.params))
        if unknown:
            accepted = ", ".join(self.params) or "(none)"
            close = difflib.get_close_matches(unknown[0], list(self.params), n=1)  # (step: steps)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"solvers.{self.name}.{unknown[0]}: unknown parameter; accepted: {accepted}{hint}")
        self.values = {k: p.check(self.name, k, values.get(k, p.default)) for k, p in self.params.items()}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.values.items())
        return f"{type(self).__name__}({args})"

    @property
    def params_json(self) -> str:
        """The parameter values as canonical JSON text (the result table's `solver_params`)."""
        return json.dumps(self.values, sort_keys=True)

    def check_batch(self, batch: PromptBatch) -> None:
        """Raise SkipCell with a reason if this solver cannot run on `batch` (default: can)."""

    @abstractmethod
    def predict(self, batch: PromptBatch) -> torch.Tensor:
        """Predictions at the queries: (B,) tensor in batch.dtype on batch.device. Never mutates batch.
        NaN for a prompt the solver cannot answer (at least the ill-posed ones: see nan_if_ill_posed)."""

    def input_files(self) -> list:
        """Paths of the files this solver reads besides its prompts (e.g. checkpoints). The
        runner hashes their bytes into the cell key, so replacing a file invalidates the cells
        that used it (--resume and the cell cache recompute them). Default: none."""
        return []

    def weights(self) -> dict[str, torch.Tensor] | None:
        """Named weight matrices for sparsity analysis, or None for solvers without weights."""
        return None

    def probe(self, batch: PromptBatch) -> dict[str, torch.Tensor]:
        """Named intermediate tensors (solvers without internals return {})."""
        return {}
