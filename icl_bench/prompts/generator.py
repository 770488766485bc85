"""The shared prompt generator: one source of (x, y) regression prompts for every solver.

A prompt is N context examples (x_i, y_i) with y_i = a + b*x_i + eps_i, eps_i ~ N(0, noise^2),
plus a query x = u. Every solver in the suite reads the same `PromptBatch`
(docs/design.md, "Prompt batch", is the contract):

    x              (B, N)       context inputs
    y              (B, N)       context targets (noisy)
    x_query        (B,)         query input u
    y_query        (B,)         noisy target a + b*u + eps
    y_query_clean  (B,)         a + b*u  (NaN for real data, which has no clean truth)
    slope          (B,)         b        (NaN for real data)
    intercept      (B,)         a        (NaN for real data)
    ols_prediction (B,) float64 least-squares prediction from the context, in float64
    tokens         (B, N+1, 3)  row i = (x_i, y_i, R) for i < N, last row = (u, 0, R)

Sampling draws in float64 on the CPU from a seeded `torch.Generator`, then casts to the requested
dtype and moves to the device, so a spec + seed gives identical values in every process and the
float32 and float64 cells of one grid point see the same prompts (up to rounding).
The OLS reference is computed in float64 *from the cast values*, so it is exactly the
least-squares answer for the data the solver sees.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

from icl_bench.prompts.ols import ols_predict

DISTRIBUTIONS = ("normal", "uniform")
DTYPES = {"float32": torch.float32, "float64": torch.float64}
MAX_VALUES = 2**27  # n_prompts * (N + 1): prompt values one batch may hold in memory (~ 5 GiB in float64)


@dataclass(frozen=True)
class Dist:
    """A named one-dimensional distribution with location and scale.

    normal:  N(loc, scale^2).
    uniform: U[loc, loc + scale]  (the scipy.stats location/scale convention).

    Raises ValueError (one line starting "dist: ") for an unknown `dist`, a `loc` or `scale`
    that is not a real number (a bool, a str; an int beyond float64's range), that is not
    finite, or a negative `scale`. loc and scale are stored as Python floats.
    """

    dist: str = "normal"  # one of DISTRIBUTIONS
    loc: float = 0.0  # location (mean for normal, left end for uniform)
    scale: float = 1.0  # standard deviation (normal) or width (uniform); >= 0

    def __post_init__(self):
        if self.dist not in DISTRIBUTIONS:
            raise ValueError(f"dist: unknown distribution {self.dist!r}; accepted: {', '.join(DISTRIBUTIONS)}")
        for name in ("loc", "scale"):  # numbers as PromptSpec takes them (a spec keys caches): not bool or str
            try:
                object.__setattr__(self, name, as_real(name, getattr(self, name)))
            except ValueError as exc:  # (an int of 400 digits raised OverflowError in isfinite)
                raise ValueError(f"dist: {exc}") from None
        if not (math.isfinite(self.loc) and math.isfinite(self.scale)) or self.scale < 0:
            raise ValueError(f"dist: loc must be finite and scale finite and >= 0 (got loc={self.loc}, scale={self.scale})")

    def sample(self, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
        """Draw float64 CPU samples of `shape` from `gen`."""
        if self.dist == "normal":
            return self.loc + self.scale * torch.randn(shape, generator=gen, dtype=torch.float64)
        return self.loc + self.scale * torch.rand(shape, generator=gen, dtype=torch.float64)


@dataclass(frozen=True)
class PromptSpec:
    """Everything that defines a distribution of prompts (hashable, so it can key caches)."""

    N: int = 20  # context length (number of (x, y) examples); >= 2
    noise: float = 0.0  # standard deviation of the label noise eps; >= 0
    R: float = 100.0  # the large constant in the third token coordinate; > 0, finite
    x: Dist = field(default_factory=Dist)  # distribution of context x and of the query u
    slope: Dist = field(default_factory=Dist)  # distribution of b
    intercept: Dist = field(default_factory=Dist)  # distribution of a

    def __post_init__(self):
        object.__setattr__(self, "N", as_integer("N", self.N, 2))  # (numpy integers become int: the spec keys caches)
        object.__setattr__(self, "noise", as_real("noise", self.noise))
        object.__setattr__(self, "R", as_real("R", self.R))
        if not math.isfinite(self.noise) or self.noise < 0:
            raise ValueError(f"noise: must be finite and >= 0 (got {self.noise!r})")
        if not math.isfinite(self.R) or self.R <= 0:
            raise ValueError(f"R: must be finite and > 0 (got {self.R!r})")
        for name in ("x", "slope", "intercept"):
            if not isinstance(getattr(self, name), Dist):  # a dict or a tuple failed later, in sample()
                raise ValueError(f"{name}: must be an icl_bench.Dist, e.g. Dist('normal', 0.0, 1.0) "
                                 f"(got {type(getattr(self, name)).__name__})")


def _scalar(value):
    """A one-element torch tensor or numpy array as its Python number; anything else unchanged."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, np.ndarray) and value.size == 1:
        return value.item()
    return value


def shown(value) -> str:
    """repr(value) for a message; an integer of more than 256 bits by its size (the repr of one of
    thousands of digits raises ValueError: Python's limit on int-to-str conversion)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value).bit_length() > 256:
        return f"an integer of {int(value).bit_length()} bits"
    return repr(value)


def as_integer(name: str, value, low: int) -> int:
    """`value` as an int >= low (Python or numpy integers, a one-element integer tensor or array;
    not bool). Raises ValueError naming `name`."""
    value = _scalar(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name}: must be an integer >= {low} (got {shown(value)})")
    return int(value)


def as_real(name: str, value) -> float:
    """`value` as a float (Python or numpy reals, a one-element tensor or array; not bool, str or
    complex). Raises ValueError naming `name` (an integer beyond float64's range too)."""
    value = _scalar(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}: must be a real number (got {type(value).__name__} {value!r})")
    try:
        return float(value)
    except OverflowError:  # (an int of hundreds of digits; formatting it as a float overflows too)
        raise ValueError(f"{name}: {shown(value)} is beyond float64's range") from None


def seeded(seed) -> torch.Generator:
    """The CPU generator every prompt draw starts from, seeded with `seed`.
    Raises ValueError: `seed` is not an integer in [-2**63, 2**64), torch's range (a float was
    truncated silently, 1.5 -> 1, and 2**70 was torch's "Overflow when unpacking long long")."""
    value = _scalar(seed)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not -2**63 <= value < 2**64:
        raise ValueError(f"seed: must be an integer in [-2**63, 2**64) (got {shown(value)})")
    return torch.Generator(device="cpu").manual_seed(int(value))


def check_device(device) -> torch.device:
    """`device` (None: the CPU) as a torch.device that can hold a batch. Raises ValueError naming "device"."""
    try:
        dev = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: {device!r} is not a torch device; accepted: cpu, cuda, cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device!r} is not available on this machine (torch.cuda.is_available() is False); "
                         "accepted here: cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: {device!r}; accepted: cpu, cuda, cuda:N")
    return dev


@dataclass(frozen=True)
class PromptBatch:
    """A batch of B prompts; see the module docstring for every field's shape.

    All tensors share one device; `ols_prediction` is float64, the rest are in `dtype`.
    Treat it as read-only: solvers must not modify it in place.
    """

    x: torch.Tensor  # (B, N)
    y: torch.Tensor  # (B, N)
    x_query: torch.Tensor  # (B,)
    y_query: torch.Tensor  # (B,)
    y_query_clean: torch.Tensor  # (B,)
    slope: torch.Tensor  # (B,)
    intercept: torch.Tensor  # (B,)
    ols_prediction: torch.Tensor  # (B,) float64
    tokens: torch.Tensor  # (B, N+1, 3)
    R: float  # the embedding constant written in tokens[..., 2]

    @property
    def B(self) -> int:
        """Prompts in the batch."""
        return self.x.shape[0]

    @property
    def N(self) -> int:
        """Context length: examples per prompt, the query not counted."""
        return self.x.shape[1]

    @property
    def d(self) -> int:
        """Regressors per example: 1 for x (B, N); d for x (B, N, d) (icl_bench/prompts/multivariate.py)."""
        return 1 if self.x.ndim == 2 else self.x.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of x, y and tokens (float32 or float64)."""
        return self.x.dtype

    @property
    def device(self) -> torch.device:
        """The device the tensors live on."""
        return self.x.device

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "R"}

    def to(self, device: str | torch.device) -> "PromptBatch":
        """A copy on `device` (the same object if already there)."""
        if torch.device(device) == self.device:
            return self
        return replace(self, **{k: v.to(device) for k, v in self.tensors().items()})

    def slice(self, start: int, stop: int) -> "PromptBatch":
        """Prompts start..stop-1 as a batch (views, no copy)."""
        return replace(self, **{k: v[start:stop] for k, v in self.tensors().items()})


def make_tokens(x: torch.Tensor, y: torch.Tensor, x_query: torch.Tensor, R: float) -> torch.Tensor:
    """Token matrix (B, N+1, 3): rows (x_i, y_i, R), then the query row (u, 0, R). Dtype of x."""
    B, N = x.shape
    tokens = torch.empty(B, N + 1, 3, dtype=x.dtype, device=x.device)
    tokens[:, :N, 0] = x
    tokens[:, :N, 1] = y
    tokens[:, N, 0] = x_query
    tokens[:, N, 1] = 0.0
    tokens[:, :, 2] = R
    return tokens


def _assemble(x, y, x_query, y_query, y_clean, slope, intercept, *, R, dtype, device) -> PromptBatch:
    dt = resolve_dtype(dtype)
    cast = lambda t: t.to(device=device, dtype=dt)  # noqa: E731
    x, y, x_query = cast(x), cast(y), cast(x_query)
    ols = ols_predict(x.double(), y.double(), x_query.double())
    return PromptBatch(
        x=x, y=y, x_query=x_query, y_query=cast(y_query), y_query_clean=cast(y_clean),
        slope=cast(slope), intercept=cast(intercept), ols_prediction=ols,
        tokens=make_tokens(x, y, x_query, float(R)), R=float(R),
    )


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'float32' / 'float64' (or the torch dtype itself) -> torch dtype; ValueError otherwise."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype: unknown dtype {dtype!r}; accepted: {', '.join(DTYPES)}")


def sample_prompts(spec: PromptSpec, n_prompts: int, *, seed: int, dtype="float32", device="cpu") -> PromptBatch:
    """Draw `n_prompts` prompts from `spec`, reproducibly.

    Args:
        spec: the prompt distribution (N, noise, R and the x / slope / intercept distributions).
        n_prompts: batch size B >= 1.
        seed: integer seed of the CPU float64 generator in [-2**63, 2**64); same spec + seed -> same
            tensors (torch reads a negative seed modulo 2**64: -1 draws as 2**64 - 1).
        dtype: "float32" or "float64" (or the torch dtype) of every field but ols_prediction.
        device: torch device of the batch ("cpu", "cuda", ...).
    Returns:
        PromptBatch with B = n_prompts.
    Raises:
        ValueError: n_prompts < 1, a seed that is not an integer in [-2**63, 2**64), an unknown dtype,
            or a device that is not cpu / an available cuda device.
    """
    n_prompts = as_integer("n_prompts", n_prompts, 1)
    check_device(device)
    gen = seeded(seed)
    B, N = n_prompts, spec.N
    slope = spec.slope.sample((B,), gen)  # (B,)
    intercept = spec.intercept.sample((B,), gen)  # (B,)
    x = spec.x.sample((B, N), gen)  # (B, N)
    x_query = spec.x.sample((B,), gen)  # (B,)
    eps = spec.noise * torch.randn(B, N + 1, generator=gen, dtype=torch.float64)  # (B, N+1)
    y = intercept[:, None] + slope[:, None] * x + eps[:, :N]
    y_clean = intercept + slope * x_query
    y_query = y_clean + eps[:, N]
    return _assemble(x, y, x_query, y_query, y_clean, slope, intercept, R=spec.R, dtype=dtype, device=device)


def make_batch(x, y, x_query, *, R: float, dtype="float64", device="cpu", y_query=None) -> PromptBatch:
    """Wrap the user's own arrays as a PromptBatch (the OLS reference is computed for them too).

    Args:
        x, y: context, array-likes of shape (B, N) or (N,) (one prompt).
        x_query: query inputs, shape (B,) or a scalar.
        R: the embedding constant (> 0, finite).
        dtype, device: as in `sample_prompts`.
        y_query: optional observed query targets (B,) or a scalar; NaN if not given.
    Returns:
        PromptBatch; y_query_clean, slope and intercept are NaN (no known truth).
    Raises:
        ValueError: shapes that do not match, N < 2, or a bad R / dtype / device.
    """
    R = as_real("R", R)
    check_device(device)
    x = torch.as_tensor(x, dtype=torch.float64).cpu()
    y = torch.as_tensor(y, dtype=torch.float64).cpu()
    u = torch.as_tensor(x_query, dtype=torch.float64).cpu()
    if x.ndim == 1:
        x, y = x[None], y[None]
    if x.ndim != 2 or x.shape != y.shape:
        raise ValueError(f"x, y: must both have shape (B, N) or (N,) (got {tuple(x.shape)} and {tuple(y.shape)})")
    if x.shape[1] < 2:
        raise ValueError(f"N: must be >= 2 (got {x.shape[1]})")
    u = u if u.ndim else u.expand(x.shape[0])
    if u.shape != (x.shape[0],):  # (any shape of B values had been flattened into the queries)
        raise ValueError(f"x_query: must have shape ({x.shape[0]},) or be a scalar (got {tuple(u.shape)})")
    if not math.isfinite(R) or R <= 0:
        raise ValueError(f"R: must be finite and > 0 (got {R!r})")
    nan = torch.full_like(u, float("nan"))
    yq = nan if y_query is None else torch.as_tensor(y_query, dtype=torch.float64).cpu()
    yq = yq if yq.ndim else yq.expand(x.shape[0])
    if yq.shape != (x.shape[0],):  # a wrong length failed later, in the metrics (a review)
        raise ValueError(f"y_query: must have shape ({x.shape[0]},) or be a scalar (got {tuple(yq.shape)})")
    return _assemble(x, y, u, yq, nan, nan, nan, R=R, dtype=dtype, device=device)

