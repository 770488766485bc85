"""icl-bench: benchmark in-context learning algorithms for simple linear regression.

Public API (docs/design.md §3):
    sample_prompts, make_batch, PromptSpec, PromptBatch, Dist   -- the shared prompt generator
    Solver, Param, SkipCell, register_solver, get_solver, list_solvers -- solvers and registry
    run_matrix                                                   -- the benchmark matrix runner

The names are imported on first use (PEP 562), so `import icl_bench` loads neither torch nor
pandas: the `icl-bench` command starts inside its own error handling (a Ctrl-C while torch loads
is "icl-bench: interrupted", not a traceback), and `from icl_bench import Solver` works as usual.
"""
from importlib import import_module as _import_module
from importlib.util import find_spec as _find_spec

__version__ = "0.1.0"
_HOME = {  # public name -> the module that defines it
    **dict.fromkeys(("Dist", "PromptBatch", "PromptSpec", "make_batch", "sample_prompts"), "icl_bench.prompts.generator"),
    **dict.fromkeys(("get_solver", "list_solvers", "register_solver"), "icl_bench.solvers.registry"),
    **dict.fromkeys(("Param", "SkipCell", "Solver"), "icl_bench.solvers.base"),
    "run_matrix": "icl_bench.bench.runner",
}
__all__ = [
    "Dist", "PromptBatch", "PromptSpec", "make_batch", "sample_prompts",
    "Param", "SkipCell", "Solver", "get_solver", "list_solvers", "register_solver", "run_matrix",
]


def __getattr__(name):
    if name in _HOME:
        value = getattr(_import_module(_HOME[name]), name)
        globals()[name] = value  # looked up once
        return value
    if not name.startswith("_") and _find_spec(f"{__name__}.{name}") is not None:  # a submodule
        if name in ("prompts", "solvers"):  # icl_bench.solvers.registry: what `import icl_bench` used to load
            for module in set(_HOME.values()) - {"icl_bench.bench.runner"}:
                _import_module(module)
        return _import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'icl_bench' has no attribute {name!r}")


def __dir__():
    return sorted([*__all__, "__version__"])
