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
import os
import re
import sys
import threading
import unicodedata
from dataclasses import dataclass
from importlib.metadata import entry_points

from icl_bench.errors import ConfigError, cell_message
from icl_bench.provenance import module_digest
from icl_bench.solvers.base import Param, Solver

ENTRY_POINT_GROUP = "icl_bench.solvers"

# Built-in solvers: name -> module that registers it on import.
BUILTINS: dict[str, str] = {
    "ln-closed-form": "icl_bench.solvers.ln_closed_form",
    "gd-lsa": "icl_bench.solvers.gd_lsa",
    "trained-l1": "icl_bench.solvers.trained",
    "trained-nol1": "icl_bench.solvers.trained",
    "trained-lsa": "icl_bench.solvers.trained",
    "trained-l1-noaug": "icl_bench.solvers.trained",
}


class UnknownSolverError(ValueError):
    """An unknown solver name (message lists the known names and the closest match)."""


class SolverLoadError(RuntimeError):
    """A known solver whose module or plugin failed to import."""


@dataclass(frozen=True)
class SolverInfo:
    """One line of `icl-bench list`."""

    name: str
    origin: str  # "built-in (module)" or "plugin module:attr (dist version)"
    params: dict  # name -> Param (empty when broken)
    doc: str  # first docstring line
    error: str | None = None  # import error of a broken plugin


class Registry:
    """Solver classes by name, loaded lazily: built-ins (BUILTINS) on first use, plugins from the
    entry-point group. Thread-safe; `unregister` and `reset` exist for tests and notebooks."""

    def __init__(self, builtins: dict[str, str], group: str):
        self.builtins = dict(builtins)  # name -> module that registers it on import
        self.group = group
        self._lock = threading.RLock()
        self._classes: dict[str, type[Solver]] = {}
        self._origins: dict[str, str] = {}
        self._broken: dict[str, str] = {}  # name -> import error
        self._loading: set[str] = set()  # names whose entry point is being imported (its module may register them)

    def add(self, name: str, cls, origin: str, *, declared: bool = False) -> None:
        """Register `cls` under `name`. `declared`: `cls` is what the name's entry point loads.

        Raises:
            TypeError: `cls` is not a Solver subclass, or its `params` is not a dict of icl_bench.Param
                whose defaults are bool, int, float or str and pass their own checks.
            ValueError: `name` is already taken by another class, is a built-in name or an installed
                plugin's, differs from a built-in name only in case or Unicode form, has surrounding
                spaces, or mixes Latin letters with look-alike ones of another script (`_taken`).
        """
        if not (isinstance(cls, type) and issubclass(cls, Solver)):  # named without repr's memory address, which
            what = f"{type(cls).__name__} {getattr(cls, '__module__', None) or '?'}.{getattr(cls, '__qualname__', '?')}"
            raise TypeError(f"solver {name!r}: {what} is not a subclass of icl_bench.Solver")  # made the rows differ
        params = getattr(cls, "params", {})  # (a plain default, {"shift": 0.0}, crashed `list`; a tryout)
        if not isinstance(params, dict):
            raise TypeError(f"solver {name!r}: params must be a dict of name -> icl_bench.Param (got {type(params).__name__})")
        for k, v in params.items():  # a TOML key each, with a default its own check accepts (a review)
            if not (isinstance(k, str) and k.isidentifier()):
                raise TypeError(f"solver {name!r}: parameter name {k!r} must be an identifier (a config key)")
            if not isinstance(v, Param):
                raise TypeError(f"solver {name!r}: params[{k!r}] must be an icl_bench.Param (got {v!r})")
            if type(v.default) not in (bool, int, float, str):  # a config's list is a grid of values, and TOML has
                # no None: a list or None default was listed but no config could set it (a review)
                raise TypeError(f"solver {name!r}: the default of {k!r} must be a bool, int, float or str, the values "
                                f"a config can give (got {type(v.default).__name__} {v.default!r})")
            try:
                v.check(name, k, v.default)
            except ConfigError as exc:
                raise TypeError(f"solver {name!r}: the default of {k!r} fails its own check ({exc})") from None
        with self._lock:
            if name in self._classes and self._classes[name] is not cls:
                raise ValueError(f"solver {name!r}: already registered by {self._origins[name]}")
            taken = None if name in self._classes else self._taken(name, cls, declared)
            if taken:
                raise ValueError(f"solver {name!r}: {taken}; choose another name")
            cls.name = name
            self._classes[name] = cls
            self._origins[name] = origin

    def _taken(self, name: str, cls, declared: bool) -> str | None:
        """Why `name` may not be given to `cls` before it is loaded, or None. A class registered
        from Python under `ols` or `gd-lsa` used to replace the built-in whenever it came before the
        built-in's first use (a review): its rows read as the reference's."""
        package = str(getattr(cls, "__module__", "") or "").split(".")[0]
        if not isinstance(name, str) or not name.strip() or name != name.strip():  # `ols ` merged with `ols` in the
            return "a name must be non-empty text without leading or trailing spaces"  # tables (a review)
        if not name.isprintable():  # a zero-width space or a newline: an invisible or table-breaking name
            return "a name must be printable text (no control, format or zero-width characters)"
        scripts = _scripts(name)
        if "LATIN" in scripts and len(scripts) > 1:  # 'оls' with a Cyrillic 'о' read as `ols` in every table
            others = " and ".join(sorted(scripts - {"LATIN"}))
            return f"mixes Latin letters with {others} ones, which include look-alikes of Latin letters"
        if name in self.builtins:
            module = self.builtins[name]
            return None if cls.__module__ == module else f"a built-in name (of {module})"
        twin = _case_twin(name, self._reserved())
        if twin is not None:
            return f"differs from the built-in name {twin!r} only in case or Unicode form"
        ep = None if declared or name in self._loading else self.entry_points().get(name)
        if ep is not None and ep.module.split(".")[0] != package:  # (a plugin's own decorator: its package)
            return f"a built-in name (of {ep.module})" if _dist_name(ep) == "icl-bench" else f"declared by {_ep_origin(ep)}"
        return None

    def _reserved(self, eps=None) -> set[str]:
        """The built-in names: BUILTINS and icl-bench's own entry points (its baselines), from `eps`
        (the group's entry points, when the caller has read them already)."""
        eps = entry_points(group=self.group) if eps is None else eps
        return set(self.builtins) | {ep.name for ep in eps if _dist_name(ep) == "icl-bench"}

    def unregister(self, name: str) -> None:
        """Forget `name` (class, origin and any load error); a later lookup loads it again."""
        with self._lock:
            for d in (self._classes, self._origins, self._broken):
                d.pop(name, None)

    def reset(self) -> None:
        """Forget every registration and load error; built-ins and plugins load again on their
        next use (a built-in whose module was imported before is found in that module)."""
        with self._lock:
            self._classes.clear()
            self._origins.clear()
            self._broken.clear()

    def origin(self, name: str) -> str | None:
        """Where `name` came from ("built-in (module)" / "plugin module:Class (distribution version)";
        a plugin that failed to load: the same with ", broken"), None if neither registered nor a
        broken plugin (its version is worth keeping: its cells are error rows; a review)."""
        if name in self._origins:
            return self._origins[name]
        ep = self.entry_points().get(name) if name in self._broken else None
        return f"{_ep_origin(ep)}, broken" if ep is not None else None

    def _ordered(self) -> list:
        """The group's entry points in the order that decides a clash of names: icl-bench's own
        (its baselines, declared like a plugin) first, then by the sys.path entry that holds the
        distribution, then by distribution name. importlib.metadata lists one folder's
        distributions in the file system's order, which differs between machines."""
        paths = {os.path.abspath(p or "."): i for i, p in reversed(list(enumerate(sys.path)))}

        def key(ep) -> tuple:
            dist, name = getattr(ep, "dist", None), _dist_name(ep)
            if name == "icl-bench":
                return (0, 0, "", ep.value)
            try:
                where = paths.get(os.path.abspath(str(dist.locate_file(""))), len(paths))
            except Exception:  # noqa: BLE001 - a distribution without a location sorts last
                where = len(paths)
            return (1, where, name, ep.value)

        return sorted(entry_points(group=self.group), key=key)

    def entry_points(self) -> dict:
        """name -> entry point; icl-bench's own declarations win, then the distribution earliest on
        sys.path, then the one whose name sorts first (`_ordered`; the others: `conflicts`)."""
        out: dict = {}
        eps = self._ordered()
        reserved = self._reserved(eps)
        for ep in eps:
            if ep.name not in out and _dist_name(ep) != "icl-bench" and _case_twin(ep.name, reserved) is not None:
                continue  # `OLS` beside `ols`: ignored (conflicts)
            out.setdefault(ep.name, ep)
        return out

    def _load(self, name: str) -> None:
        """Import whatever provides `name`; record a failure instead of raising."""
        with self._lock:
            if name in self._classes or name in self._broken:
                return
            try:
                if name in self.builtins:
                    module = importlib.import_module(self.builtins[name])
                    if name not in self._classes:  # imported before a reset(): register its class again
                        for cls in vars(module).values():
                            if isinstance(cls, type) and issubclass(cls, Solver) and cls.__dict__.get("name") == name:
                                self.add(name, cls, origin=f"built-in ({cls.__module__})")
                    return
                ep = self.entry_points().get(name)
                if ep is None:
                    return
                self._loading.add(name)  # a decorator in the modules it imports registers `name` for it
                try:
                    _set_vector_width()
                    cls = ep.load()
                finally:
                    self._loading.discard(name)
                if self._classes.get(name, cls) is not cls:  # another class took the name while it loaded: the
                    self._classes.pop(name)  # entry point's class is the one declared (a review)
                    self._origins.pop(name, None)
                self.add(name, cls, origin=_ep_origin(ep), declared=True)
                _pin_code(cls)
            except KeyboardInterrupt:  # Ctrl-C while a plugin imports stops the command
                raise
            except BaseException as exc:  # a broken plugin (SystemExit, GeneratorExit too) must not break anything else
                self._broken[name] = cell_message(exc, prefix=f"{type(exc).__name__}: ")  # one short line
                self._classes.pop(name, None)  # (a class its imports registered before it failed is not it)
                self._origins.pop(name, None)

    def conflicts(self) -> list[str]:
        """One line per plugin entry point that is ignored because its name is taken: a built-in
        name (built-ins win) or a name that icl-bench itself, a distribution earlier on sys.path
        or, in the same folder, one whose name sorts first already declared (`_ordered`)."""
        seen: dict[str, str] = {}
        out = []
        eps = self._ordered()
        reserved = self._reserved(eps)
        for ep in eps:
            dist = ep.dist.name if getattr(ep, "dist", None) else "unknown distribution"
            twin = _case_twin(ep.name, reserved) if _dist_name(ep) != "icl-bench" else None
            if ep.name in self.builtins:
                out.append(f"plugin {ep.value} ({dist}) declares {ep.name!r}, a built-in name: ignored")
            elif twin is not None:
                out.append(f"plugin {ep.value} ({dist}) declares {ep.name!r}, the built-in name {twin!r} "
                           "in other case: ignored")
            elif ep.name in seen and seen[ep.name] != ep.value:
                out.append(f"plugin {ep.value} ({dist}) declares {ep.name!r}, already declared by {seen[ep.name]}: ignored")
            else:
                seen.setdefault(ep.name, ep.value)
        return out

    def known_names(self) -> list[str]:
        """Every solver name that is registered, built in, or declared by an installed plugin."""
        return sorted(set(self._classes) | set(self.builtins) | set(self.entry_points()))

    def get_class(self, name: str) -> type[Solver]:
        """The Solver subclass registered as `name`.

        Raises:
            UnknownSolverError: no such name (message names the known ones and the closest match).
            SolverLoadError: the name is known but its module or plugin failed to import.
        """
        self._load(name)
        if name in self._classes:
            return self._classes[name]
        if name in self._broken:
            raise SolverLoadError(f"solver {name!r} failed to load: {self._broken[name]}")
        names = self.known_names()
        close = difflib.get_close_matches(name, names, n=1) or [n for n in names if n.lower() == name.lower()]
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise UnknownSolverError(f"solver: unknown name {name!r}; known: {', '.join(names)}{hint}")

    def describe(self) -> list[SolverInfo]:
        """Load every built-in and plugin and describe each; broken ones carry their error."""
        for name in self.known_names():
            self._load(name)
        out = []
        plugins = self.entry_points()
        for name in self.known_names():
            if name in self._classes:
                cls = self._classes[name]
                doc = (cls.__doc__ or "").strip().splitlines()
                out.append(SolverInfo(name, self._origins[name], dict(cls.params), doc[0] if doc else ""))
            else:
                origin = _ep_origin(plugins[name]) if name in plugins else f"built-in ({self.builtins.get(name)})"
                out.append(SolverInfo(name, origin, {}, "", self._broken.get(name, "not loaded")))
        return out


REGISTRY = Registry(BUILTINS, ENTRY_POINT_GROUP)  # the suite's one registry


def _dist_name(ep) -> str:
    """The normalized name of the distribution that declares entry point `ep` ("" if none)."""
    dist = getattr(ep, "dist", None)
    return re.sub(r"[-_.]+", "-", dist.name).lower() if dist is not None and dist.name else ""


def _case_twin(name: str, reserved) -> str | None:
    """The name in `reserved` that equals `name` up to case, surrounding spaces and Unicode
    compatibility forms (NFKC: fullwidth 'ｏｌｓ' is 'ols'; a review) but is not it, or None.
    Look-alike letters of other scripts mixed with Latin ones (a Cyrillic 'о') are refused by
    `_scripts`; a name written wholly in another script is not compared (that needs a confusables table)."""
    key = lambda s: unicodedata.normalize("NFKC", str(s).strip()).casefold()  # noqa: E731
    return next((r for r in sorted(reserved) if r != name and key(r) == key(name)), None)


LOOKALIKE_SCRIPTS = ("LATIN", "CYRILLIC", "GREEK", "ARMENIAN", "CHEROKEE", "COPTIC")


def _scripts(name: str) -> set[str]:
    """The scripts among LOOKALIKE_SCRIPTS of the letters in `name`, read from the first word of each
    letter's Unicode name ('CYRILLIC SMALL LETTER O'). A name mixing Latin with one of the others is
    refused: their look-alike letters ('о', 'ο') pass NFKC and case folding unchanged. Letters whose
    name starts otherwise (ª, µ, ℓ, ʼ, CJK, kana) are not counted: they are no look-alike of a Latin
    letter, and the first word of their name is no script ('FEMININE ORDINAL INDICATOR'; a review)."""
    return {w for w in (unicodedata.name(ch, "?").split()[0] for ch in name if ch.isalpha()) if w in LOOKALIKE_SCRIPTS}


def _ep_origin(ep) -> str:
    """"plugin module:Class (distribution version)" of an entry point."""
    dist = f"{ep.dist.name} {ep.dist.version}" if getattr(ep, "dist", None) else "unknown distribution"
    return f"plugin {ep.value} ({dist})"


def _pin_code(cls) -> None:
    """Hash the code of the script or package that defines `cls` now, as it registers (the digest
    is cached per process: provenance.module_digest): a file edited later during the run must not
    lend its digest to this code's cells. icl_bench itself is hashed when a cell key first asks."""
    module = getattr(cls, "__module__", "")
    if module.split(".")[0] != "icl_bench":
        module_digest(module)


def register_solver(name: str):
    """Class decorator: register a Solver subclass under `name` (the built-ins, a notebook's or a
    script's own solver; an installed plugin declares an entry point instead).

    Raises:
        TypeError: the class is not a Solver subclass.
        ValueError: `name` is already taken by another class, is a built-in name (`ols`, `gd-lsa`,
            ...) or one an installed plugin declares, or differs from a built-in name only in case or Unicode form.
    """

    def decorate(cls):
        REGISTRY.add(name, cls, origin=f"built-in ({cls.__module__})")
        _pin_code(cls)
        return cls

    return decorate


def get_solver_class(name: str) -> type[Solver]:
    """The Solver subclass registered as `name` (see Registry.get_class)."""
    return REGISTRY.get_class(name)


def get_solver(name: str, /, **params) -> Solver:
    """An instance of solver `name` with `params` (defaults for the rest; `name` is positional only,
    so a solver may have a parameter called name: a review).

    Raises:
        UnknownSolverError, SolverLoadError: see Registry.get_class.
        ConfigError (a ValueError): an unknown parameter or a value of the wrong type / out of range.
        Whatever else the solver's constructor raises.
    """
    return REGISTRY.get_class(name)(**params)


def _set_vector_width() -> None:
    """fused.available() before a plugin is imported: numba's vector width is fixed when it makes
    its code generator, which a plugin's first @njit does (icl_bench/solvers/fused_cpu.py). A numba
    that fails to import is the fused path's concern (it says so there), not the plugin's."""
    from icl_bench.solvers import fused  # (lazy: numba's import costs ~0.5 s)

    try:
        fused.available()
    except Exception:  # noqa: BLE001 - not this plugin's error: it must still load
        pass


def known_names() -> list[str]:
    """Every solver name that is registered, built in, or declared by an installed plugin."""
    return REGISTRY.known_names()


def list_solvers() -> list[SolverInfo]:
    """Every solver, loaded and described (broken plugins carry their error)."""
    return REGISTRY.describe()


def conflicts() -> list[str]:
    """Plugin entry points ignored because their name is taken (see Registry.conflicts)."""
    return REGISTRY.conflicts()
