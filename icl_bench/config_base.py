"""The one config layer: TOML reading, a pydantic base model and the shared field validators.

Every config the suite reads (the benchmark matrix in bench/config.py, training runs and sweeps
in training/config.py) is a `ConfigModel` validated by `validate`. A problem becomes one
`ConfigError` line `<dotted.key>: <problem; accepted values>`, which the CLI prints as
`icl-bench: error: ...` with exit code 2 (docs/design.md, "Bad input").

Field validators (`integer`, `number`, `choice`, `flag`, `text`, `axis_list`) are plain functions
wrapped as pydantic `BeforeValidator`s: they check the raw TOML value themselves so that the
message names our accepted values, not pydantic's internal types.
"""
from __future__ import annotations

import difflib
import math
import re
import typing
from pathlib import Path
from typing import Any, Callable, Iterable

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from icl_bench.errors import ConfigError

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

MAX_SEED = 2**63 - 1  # seeds are stored as 64-bit integers (parquet)
MAX_THREADS = 1024  # torch.set_num_threads beyond this crashes the process (seen at 100000)
FLOAT_MAX = {"float32": 3.4028234663852886e38, "float64": 1.7976931348623157e308}
FLOAT_TINY = {"float32": 1.1754943508222875e-38, "float64": 2.2250738585072014e-308}  # smallest normal


def problem(msg: str, key: str | None = None) -> PydanticCustomError:
    """A validation problem with our own message; `key` overrides the location (cross-field checks)."""
    return PydanticCustomError("icl", "{msg}", {"msg": msg, "key": key})


class ConfigModel(BaseModel):
    """Base of every config table: unknown keys are refused with the list of accepted ones, and a
    non-table value is refused as such. Instances are frozen (a validated config never changes)."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    @model_validator(mode="before")
    @classmethod
    def _table(cls, data: Any) -> Any:
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise problem(f"must be a table (got {type(data).__name__})")
        accepted = [f.alias or name for name, f in cls.model_fields.items()]
        for k in data:
            if k not in accepted:
                close = difflib.get_close_matches(str(k), accepted, n=1)  # (grid.devices: device)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise PydanticCustomError("icl_key", "{msg}", {"msg": f"unknown key; accepted: {', '.join(accepted)}{hint}",
                                                               "unknown": str(k)})
        return data

    def to_dict(self) -> dict:
        """Plain dict of the validated values (JSON-able; what run folders and checkpoints store)."""
        return self.model_dump(mode="python", by_alias=True)


def _loc(err: dict, where: str) -> str:
    parts = [where] if where else []
    parts += [str(p) for p in err["loc"] if not isinstance(p, int)]
    ctx = err.get("ctx") or {}
    if ctx.get("key"):  # a cross-field check names its key relative to the table it checks
        parts.append(ctx["key"])
    if err["type"] == "icl_key":
        parts.append(ctx["unknown"])
    return ".".join(parts)


def format_error(exc: ValidationError, where: str = "") -> str:
    """One line for the first problem of `exc`: `<dotted.key>: <message>` (list indices dropped)."""
    err = exc.errors(include_url=False)[0]
    msg = err["msg"]
    if err["type"] == "missing":
        msg = "required key is missing"
    elif err["type"] == "literal_error":
        msg = f"unknown value {err['input']!r}; accepted: {', '.join(map(str, err['ctx']['expected'].replace(chr(39), '').split(' or ')))}"
    return f"{_loc(err, where)}: {msg}"


def validate(model: type[ConfigModel], raw: Any, *, where: str = "", context: dict | None = None) -> Any:
    """`model` validated from `raw` (a dict as read from TOML).

    Raises:
        ConfigError: one line naming the first bad key (prefixed by `where`) and what is accepted.
    """
    try:
        return model.model_validate(raw, context=context)
    except ValidationError as exc:
        raise ConfigError(format_error(exc, where) + misplaced_hint(exc, model)) from None


def misplaced_hint(exc: ValidationError, model: type[ConfigModel]) -> str:
    """"; `seed` is a top-level key: ..." where an unknown key inside a table is one of `model`'s own
    top-level keys: TOML puts every key written after a [table] header into that table, so a new
    user's `n_prompts = 256` below [grid] read "grid.n_prompts: unknown key" (a review)."""
    err = exc.errors(include_url=False)[0]
    unknown = (err.get("ctx") or {}).get("unknown")
    if err["type"] != "icl_key" or not err["loc"] or unknown is None:
        return ""
    return top_level_hint(unknown, model)


def top_level_hint(key: str, model: type[ConfigModel]) -> str:
    """The hint of misplaced_hint for `key`, or "" where `key` is not a top-level key of `model`."""
    top = [f.alias or name for name, f in model.model_fields.items() if not _is_table(f.annotation)]
    if key not in top:
        return ""
    return (f"; `{key}` is a top-level key: write it above the first [table] header (TOML puts every "
            "key after a header into that table)")


def _is_table(annotation) -> bool:
    """Whether a field's type is a config table: anything but a number, bool, text or list of
    them (a ConfigModel, a dict, a dataclass such as [data]'s; Optional[...] unwrapped)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Union and len(args) == 1:
        annotation = args[0]
    return not (annotation in (int, float, bool, str) or typing.get_origin(annotation) in (list, typing.Literal))


def read_toml(path: str | Path, key: str = "--config") -> dict:
    """The raw dict of a TOML file (a leading UTF-8 byte order mark, as some editors write, is skipped).

    Raises:
        ConfigError (naming `key`): the path is a folder, missing, unreadable, not UTF-8, not TOML,
            or nested too deeply for the parser (e.g. `seed = [[[[...` thousands of levels deep).
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{key}: {str(path)!r} is a folder; give a .toml file")
    if path.exists() and not path.is_file():  # /dev/null, a FIFO, a socket: exists, but no file to read
        raise ConfigError(f"{key}: {str(path)!r} is not a regular file (a device, pipe or socket); give a .toml file")
    if not path.is_file():
        raise ConfigError(f"{key}: no such file {str(path)!r}")
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8-sig"))  # utf-8-sig: drops a BOM, else UTF-8
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path.name} ({exc.strerror or type(exc).__name__})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{key}: {path.name} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{key}: {path.name} is not valid TOML ({exc})".replace("\n", " ")) from None
    except RecursionError:  # the parser recurses once per nested array / inline table
        raise ConfigError(f"{key}: {path.name} nests arrays or inline tables too deeply to read "
                          "(a config needs a few levels)") from None


# ---- field validators (raw TOML value -> checked Python value) ----

def integer(lo: int, hi: int | None = None) -> Callable[[Any], int]:
    """An int in [lo, hi] (bool is not an int here)."""
    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise problem(f"expected an integer >= {lo}, got {v!r}")
        if v < lo:
            raise problem(f"must be >= {lo} (got {v})")
        if hi is not None and v > hi:
            raise problem(f"must be <= {hi} (got {v})")
        return v
    return check


def number(*, gt: float | None = None, ge: float | None = None, lt: float | None = None,
           le: float | None = None) -> Callable[[Any], float]:
    """A finite float with optional bounds gt (>), ge (>=), lt (<), le (<=); ints are accepted.
    -0.0 is returned as 0.0: one value, one cell key and one prompt seed (bench/cells.py)."""
    bounds = " and ".join(b for b in (gt is not None and f"> {gt:g}", ge is not None and f">= {ge:g}",
                                      lt is not None and f"< {lt:g}", le is not None and f"<= {le:g}") if b)

    def check(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise problem(f"expected a number, got {v!r}")
        v = float(v)
        ok = math.isfinite(v) and (gt is None or v > gt) and (ge is None or v >= ge) and (lt is None or v < lt) \
            and (le is None or v <= le)
        if not ok:
            raise problem(f"must be finite{' and ' + bounds if bounds else ''} (got {v})")
        return v + 0.0  # -0.0 + 0.0 is +0.0
    return check


def choice(options: Iterable[str], what: str = "value") -> Callable[[Any], str]:
    """One of `options` (exact text); the message calls a wrong one an unknown `what`."""
    options = tuple(options)

    def check(v: Any) -> str:
        if v not in options:
            raise problem(f"unknown {what} {v!r}; accepted: {', '.join(o if o else repr(o) for o in options)}")
        return v
    return check


def flag(v: Any) -> bool:
    """true or false (TOML booleans only)."""
    if not isinstance(v, bool):
        raise problem(f"expected true or false, got {v!r}")
    return v


def text(v: Any) -> str:
    """A string (may be empty)."""
    if not isinstance(v, str):
        raise problem(f"expected text, got {v!r}")
    return v


def file_stem(v: Any) -> str:
    """A name that becomes a file stem: letters, digits, '-', '_', '.', not starting with '.'."""
    if not isinstance(v, str) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]*", v) or len(v) > 200:
        raise problem(f"bad name {v!r}; accepted: letters, digits, '-', '_', '.' (not first), at most 200")
    return v


def axis_list(item: Callable[[Any], Any], *, unique: bool = True,
              same: Callable[[Any], Any] | None = None) -> Callable[[Any], list]:
    """A grid axis: a scalar is a one-value list; every value checked by `item`; no repeats, nor
    (with `same`, a checked value -> its canonical form) two values of one canonical form."""
    def check(v: Any) -> list:
        values = v if isinstance(v, list) else [v]
        if not values:
            raise problem("empty list; give at least one value")
        out = [item(x) for x in values]
        if unique and len(set(out)) != len(out):
            raise problem(f"repeated values in {values!r}")
        seen: dict = {}
        for x in out if unique and same is not None else ():
            if same(x) in seen:
                how = f"print alike ({same(x)})" if isinstance(same(x), str) else "are the same value"
                raise problem(f"{seen[same(x)]!r} and {x!r} {how} in {values!r}; keep one")
            seen[same(x)] = x
        return out
    return check
