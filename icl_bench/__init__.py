"""icl-bench: benchmark in-context learning algorithms for simple linear regression.

Public API (docs/design.md §3):
    sample_prompts, make_batch, PromptSpec, PromptBatch, Dist   -- the shared prompt generator
    Solver, Param, SkipCell, register_solver, get_solver, list_solvers -- solvers and registry
    run_matrix                                                   -- the benchmark matrix runner
"""
from icl_bench.prompts.generator import Dist, PromptBatch, PromptSpec, make_batch, sample_prompts
from icl_bench.solvers.registry import get_solver, list_solvers, register_solver
from icl_bench.solvers.base import Param, SkipCell, Solver

__version__ = "0.1.0"
__all__ = [
    "Dist", "PromptBatch", "PromptSpec", "make_batch", "sample_prompts",
    "Param", "SkipCell", "Solver", "get_solver", "list_solvers", "register_solver", "run_matrix",
]


def __getattr__(name):  # run_matrix pulls in pandas/pyarrow: import it only when asked for
    if name == "run_matrix":
        from icl_bench.bench.runner import run_matrix

        return run_matrix
    raise AttributeError(f"module 'icl_bench' has no attribute {name!r}")
