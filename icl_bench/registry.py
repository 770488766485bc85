"""Solver registry: built-ins by decorator, plugins by the `icl_bench.solvers` entry-point group.

Loading is lazy: a built-in module or a plugin is imported only when its solver is asked for
(or when everything is listed). A plugin that fails to import is recorded with its error and
never breaks the other solvers, `icl-bench list` or the runner.

Plugin authors declare, in their pyproject.toml:

    [project.entry-points."icl_bench.solvers"]
    my-solver = "my_package.module:MySolver"     # a Solver subclass
"""
from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass
from importlib.metadata import entry_points

from icl_bench.solver import Solver

ENTRY_POINT_GROUP = "icl_bench.solvers"

# Built-in solvers: name -> module that registers it on import.
BUILTINS: dict[str, str] = {
    "ln-closed-form": "icl_bench.ln_closed_form",
    "gd-lsa": "icl_bench.gd_lsa",
    "trained-l1": "icl_bench.trained",
    "trained-nol1": "icl_bench.trained",
    "trained-lsa": "icl_bench.trained",
}

_registered: dict[str, type[Solver]] = {}
_origin: dict[str, str] = {}
_broken: dict[str, str] = {}


class UnknownSolverError(ValueError):
    """An unknown solver name (message lists the known names and the closest match)."""


class SolverLoadError(RuntimeError):
    """A known solver whose module or plugin failed to import."""


def register_solver(name: str):
    """Class decorator: register a Solver subclass under `name` (used inside icl_bench).

    Raises:
        TypeError: the class is not a Solver subclass.
        ValueError: `name` is already taken by another class.
    """

    def decorate(cls):
        _add(name, cls, origin=f"built-in ({cls.__module__})")
        return cls

    return decorate


def _add(name: str, cls, origin: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Solver)):
        raise TypeError(f"solver {name!r}: {cls!r} is not a subclass of icl_bench.Solver")
    if name in _registered and _registered[name] is not cls:
        raise ValueError(f"solver {name!r}: already registered by {_origin[name]}")
    cls.name = name
    _registered[name] = cls
    _origin[name] = origin


def _plugins() -> dict:
    """name -> entry point; the first distribution on sys.path declaring a name wins (see conflicts)."""
    out: dict = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        out.setdefault(ep.name, ep)
    return out


def _load(name: str) -> None:
    """Import whatever provides `name`; record failures in _broken."""
    if name in _registered or name in _broken:
        return
    try:
        if name in BUILTINS:
            importlib.import_module(BUILTINS[name])
            return
        ep = _plugins().get(name)
        if ep is None:
            return
        cls = ep.load()
        dist = f"{ep.dist.name} {ep.dist.version}" if getattr(ep, "dist", None) else "unknown distribution"
        _add(name, cls, origin=f"plugin {ep.value} ({dist})")
    except (Exception, SystemExit) as exc:  # a broken plugin must not break anything else
        _broken[name] = f"{type(exc).__name__}: {exc}"


def conflicts() -> list[str]:
    """One line per plugin entry point that is ignored because its name is taken: a built-in
    name (built-ins win) or a name an earlier distribution on sys.path already declared."""
    seen: dict[str, str] = {}
    out = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if getattr(ep, "dist", None) else "unknown distribution"
        if ep.name in BUILTINS:
            out.append(f"plugin {ep.value} ({dist}) declares {ep.name!r}, a built-in name: ignored")
        elif ep.name in seen and seen[ep.name] != ep.value:
            out.append(f"plugin {ep.value} ({dist}) declares {ep.name!r}, already declared by {seen[ep.name]}: ignored")
        else:
            seen.setdefault(ep.name, ep.value)
    return out


def known_names() -> list[str]:
    """Every solver name that is registered, built in, or declared by an installed plugin."""
    return sorted(set(_registered) | set(BUILTINS) | set(_plugins()))


def get_solver_class(name: str) -> type[Solver]:
    """The Solver subclass registered as `name`.

    Raises:
        UnknownSolverError: no such name (message names the known ones and the closest match).
        SolverLoadError: the name is known but its module or plugin failed to import.
    """
    _load(name)
    if name in _registered:
        return _registered[name]
    if name in _broken:
        raise SolverLoadError(f"solver {name!r} failed to load: {_broken[name]}")
    names = known_names()
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise UnknownSolverError(f"solver: unknown name {name!r}; known: {', '.join(names)}{hint}")


def get_solver(name: str, **params) -> Solver:
    """An instance of solver `name` with `params` (defaults for the rest).

    Raises:
        UnknownSolverError, SolverLoadError: see get_solver_class.
        ValueError: an unknown parameter or a value of the wrong type / out of range.
    """
    return get_solver_class(name)(**params)


@dataclass(frozen=True)
class SolverInfo:
    """One line of `icl-bench list`."""

    name: str
    origin: str  # "built-in (module)" or "plugin module:attr (dist version)"
    params: dict  # name -> Param (empty when broken)
    doc: str  # first docstring line
    error: str | None = None  # import error of a broken plugin


def list_solvers() -> list[SolverInfo]:
    """Load every built-in and plugin and describe each; broken ones carry their error."""
    for name in known_names():
        _load(name)
    out = []
    for name in known_names():
        if name in _registered:
            cls = _registered[name]
            doc = (cls.__doc__ or "").strip().splitlines()
            out.append(SolverInfo(name, _origin[name], dict(cls.params), doc[0] if doc else ""))
        else:
            origin = f"plugin {_plugins()[name].value}" if name in _plugins() else f"built-in ({BUILTINS.get(name)})"
            out.append(SolverInfo(name, origin, {}, "", _broken.get(name, "not loaded")))
    return out
