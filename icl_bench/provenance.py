"""Provenance of every number the suite writes: package versions, the git commit, the device.

The one place these are read; run folders (bench/store.py), checkpoints (solvers/checkpoint.py)
and published reports (report/publish.py) all record them through here.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import platform
import re
import shlex
import subprocess
import sys
import uuid
from importlib.metadata import PackageNotFoundError, distribution, packages_distributions, version
from pathlib import Path

import torch

PACKAGES = ("icl-bench", "torch", "numpy", "numba", "scipy", "pandas", "pyarrow", "matplotlib", "seaborn",
            "safetensors")
ARITHMETIC = ("torch", "numpy", "numba", "scipy")  # of PACKAGES, those whose version can move a cell's numbers


def command_line() -> str:
    """The command that started this process, as typed: `icl-bench run --out results/runs/default`
    for the CLI (its console script, or `python -m icl_bench`), `python -m <package> <args>` for another
    package run with -m (a test runner calling the Python API), else `python <argv>` (a script).
    Paths stay as typed: relative to where it was run."""
    argv = [str(a) for a in sys.argv]
    if not argv:
        return "python"
    first = Path(argv[0])
    if first.name == "icl-bench" or (first.name == "__main__.py" and first.parent.name == "icl_bench"):
        return shlex.join(["icl-bench", *argv[1:]])
    if first.name == "__main__.py":  # `python -m pytest ...`: argv[0] is this machine's path of the package
        return shlex.join(["python", "-m", first.parent.name, *argv[1:]])
    return shlex.join(["python", *argv])


def package_versions() -> dict[str, str]:
    """Installed versions of the packages the numbers depend on (plus Python)."""
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def git_commit(root: str | Path | None = None, ignore: tuple = ()) -> str:
    """HEAD of the git checkout around `root` (default: this package's source folder), with
    "-dirty" if tracked files other than the paths in `ignore` (the run's own output) have local
    changes; "unknown" outside a checkout, in a folder the checkout does not track (an installed
    package, even in a virtual environment inside some repository) or without git."""
    root = Path(root) if root is not None else Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD", "--show-toplevel"], cwd=root, capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        commit, top = (head.stdout.splitlines() + ["", ""])[:2]
        tracked = subprocess.run(["git", "ls-files", "--error-unmatch", "--", "."], cwd=root, capture_output=True,
                                 text=True, timeout=10)
        if tracked.returncode != 0:  # an installed package in a .venv inside the user's own repository: not ours
            return "unknown"
        inside = [q for q in (Path(p).resolve() for p in ignore) if top and q.is_relative_to(Path(top).resolve())]
        skip = [f":(top,exclude){q.relative_to(Path(top).resolve())}" for q in inside]  # (git refuses a path outside)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":/", *skip], cwd=root,
                                capture_output=True, text=True, timeout=10)
        dirty = status.returncode != 0 or bool(status.stdout.strip())  # (a status that failed: not called clean)
        return commit.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo's "model name"), else what platform knows
    (platform.processor() or the machine type, e.g. x86_64)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info() -> dict:
    """CPU and (if present) CUDA device names, thread count and torch build."""
    info = {
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "torch_cuda_build": torch.version.cuda,
    }
    if torch.cuda.is_available():
        info["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


NO_SOURCE = "no source file: "  # source_digest of a module with none: this prefix and a random id


@functools.cache
def source_digest(top: str) -> str:
    """sha256 (hex) over the relative paths and bytes of the source of the top-level package or
    module `top` as installed (a package: every .py file under it; a module: its file). A module
    that import cannot find but that is loaded (a script's `__main__`) is hashed from its
    `__file__`; one with no source file (an interactive session, `python -c`) gets a digest new in
    every process, so its cells are never reused from another process's store or cache. Computed
    once per process (and pinned when a solver registers: solvers/registry.py): the code a process
    runs is the code it imported."""
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):  # ValueError: loaded without a __spec__, as a script's __main__
        spec = None
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec is not None else []
    origin = spec.origin if spec is not None and not roots else None
    if not roots and not (origin and Path(origin).is_file()):  # no source import knows: the loaded module's
        origin = getattr(sys.modules.get(top), "__file__", None)
        if not (origin and Path(origin).is_file()):
            return f"{NO_SOURCE}{uuid.uuid4().hex}"
    return _digest_files(roots, origin)


@functools.cache
def module_digest(module: str) -> str:
    """source_digest of the top-level package that holds the loaded `module` (a solver class's
    __module__), found from the module's own file: "a.b.c" in .../a/b/c.py hashes .../a. Found by
    name instead, a folder `a` in the current directory (a plugin's checkout, on sys.path as '')
    shadowed the installed package, so the same code got another digest in another folder: false
    "worker's code differs" errors and resumes that recomputed cells (found by a review). A module
    not loaded, or without a file, falls back to source_digest of its top-level name."""
    mod = sys.modules.get(module)
    file = getattr(mod, "__file__", None)
    if not module or not file or not Path(file).is_file():
        return source_digest(module.split(".")[0])
    path = Path(file).resolve()
    depth = module.count(".") + (path.name == "__init__.py")  # folders between the file and the top package
    return _digest_files([path.parents[depth - 1]], None) if depth else _digest_files([], str(path))


def _digest_files(roots: list[Path], origin: str | None) -> str:
    """sha256 over the relative paths and bytes of every .py file under `roots`, or of the file `origin`."""
    files = sorted((f.relative_to(r).as_posix(), f) for r in roots for f in r.rglob("*.py")) if roots else \
        [(Path(origin).name, Path(origin))]
    h = hashlib.sha256()
    for rel, path in files:
        h.update(rel.encode() + b"\0")
        try:
            h.update(path.read_bytes())
        except OSError as exc:
            h.update(f"unreadable: {exc}".encode())
    return h.hexdigest()


@functools.cache
def _tops() -> dict[str, tuple[str, ...]]:
    """Top-level import name -> the distributions that install it (importlib.metadata; editable
    installs too, through their top_level.txt)."""
    return {top: tuple(dists) for top, dists in packages_distributions().items()}


@functools.cache
def distribution_parts(top: str) -> tuple[str, ...]:
    """What else a plugin's numbers may read, for the distribution(s) that install the top-level
    package `top` (none for icl-bench's own, whose code and ARITHMETIC versions code_digest has):
    "name:source_digest" of each of its other top-level packages (a helper package shipped beside
    the solver's) and "name=version" of each distribution it requires (markers for extras left
    out; "absent" when not installed). A plugin whose maths sat in a second package of its
    distribution got its old cells back from --cache and --resume after that package changed
    (a plugin author's review). Code imported from elsewhere is not seen (docs/design.md §10)."""
    parts = []
    for dist in sorted(d for d in _tops().get(top, ()) if d != "icl-bench"):
        for t in sorted(t for t, ds in _tops().items() if dist in ds and t != top and t.isidentifier()):
            # (a name guessed from RECORD for a file outside site-packages, '..', is no package; one
            # import cannot find would get a digest new in every process: never reused, and refused by Dask)
            digest = source_digest(t)
            parts.append(f"{t}:{'absent' if digest.startswith(NO_SOURCE) else digest}")
        try:
            requires = distribution(dist).requires or []
        except PackageNotFoundError:
            continue
        for req in requires:
            if re.search(r"\bextra\s*==", req):  # an optional extra's requirement
                continue
            name = re.split(r"[\s;<>=!~\[(@]", req.strip(), maxsplit=1)[0]
            try:
                parts.append(f"{name}={version(name)}")
            except PackageNotFoundError:
                parts.append(f"{name}=absent")
    return tuple(parts)


def code_digest(module: str) -> str:
    """sha256 (hex) of the code behind the numbers of a solver defined in `module` (its __module__):
    the sources of icl_bench and of the module's top-level package (source_digest), the versions of
    the ARITHMETIC packages and, for a plugin, its distribution's other packages and requirements
    (distribution_parts). Part of a cell's key (bench/cells.py), so a changed solver, reference or
    upgraded torch never gets a cached row of the old code."""
    versions = package_versions()
    parts = [source_digest("icl_bench"), module_digest(module) if module else ""]
    parts += [f"{name}={versions[name]}" for name in ARITHMETIC]
    parts += distribution_parts(module.split(".")[0]) if module else ()
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()
