"""The screens' extremes in the fused kernel (icl_bench/solvers/fused_source.py generates them into
its embedding loops): each prompt's least and largest context x and y, which is all that
`icl_bench.solvers.base.screens` needs to tell ill-posed prompts and prompts whose R is lost in
rounding (docs/throughput.md, "The solvers around the kernel"). The embedding loop loads every
context token anyway, so these cost a few comparisons per token instead of four torch reductions
reading x and y back from memory.

Lanes: `ex` (5 lanes,) per kernel call: x_min, x_max, y_min, y_max and a finiteness sum, `lanes`
values each (lane j sees tokens j, j + lanes, ...; lanes = fused_source.LANES); `extremes` folds
them into ext[b] and resets them for the next prompt.
"""
from __future__ import annotations


def lanes_setup(lanes: int) -> list[str]:
    """Kernel lines that allocate the lanes `ex`: +inf for the minima, -inf for the maxima, 0."""
    return [f"ex = np.zeros({5 * lanes}, dtype=out.dtype)  # lanes of the extremes (extremes resets them)",
            f"ex[:{lanes}] = np.inf; ex[{lanes}:{2 * lanes}] = -np.inf",
            f"ex[{2 * lanes}:{3 * lanes}] = np.inf; ex[{3 * lanes}:{4 * lanes}] = -np.inf"]


def screen_lines(masked: bool, lanes: int) -> list[str]:
    """Per lane j of an embedding loop: the least and largest x and y (token slots 0 and 1) of
    the context tokens into the lanes `ex`, and a finiteness sum, 0 or NaN (t - t is NaN for inf
    and NaN); `extremes` folds the lanes into the prompt's (x_min, x_max, y_min, y_max).
    Comparisons and t - t only: exact, no products of values (`fused_source.products`, which
    bounds FUSE_MAX and MAX_PRODUCTS, counts only the index product of `ctx`). masked: only
    tokens i < N count (the query and the pads do not; the unmasked loops hold context tokens
    only). `e + zero` where a lane keeps its value: storing the loaded value back let LLVM turn
    the store into a masked store, several times slower on AMD; it may turn -0 into +0, which no
    screen can tell."""
    ctx = "ctx & " if masked else ""
    out = [f"ctx = blk * {lanes} + j < N"] if masked else []
    out += [f"e0 = ex[j]; e1 = ex[{lanes} + j]; e2 = ex[{2 * lanes} + j]; e3 = ex[{3 * lanes} + j]"]
    for s, (t, op) in enumerate((("t0", "<"), ("t0", ">"), ("t1", "<"), ("t1", ">"))):
        out.append(f"ex[{s * lanes} + j] = {t} if {ctx}({t} {op} e{s}) else e{s} + zero")
    fin = "((t0 - t0) + (t1 - t1))"
    return out + [f"ex[{4 * lanes} + j] += {fin} if ctx else zero" if masked else f"ex[{4 * lanes} + j] += {fin}"]


def extremes_function(lanes: int) -> list[str]:
    """def extremes(ex, ext, b): lanes -> ext[b] = (x_min, x_max, y_min, y_max), each NaN when a
    context x or y is inf or NaN (as torch.amin / amax propagate NaN; an inf makes the same
    prompts ill-posed); the lanes are reset for the next prompt."""
    L = ["def extremes(ex, ext, b):", "    F = ext.dtype.type", "    bad = F(0.0)",
         f"    for j in range({lanes}):", f"        bad += ex[{4 * lanes} + j]", f"        ex[{4 * lanes} + j] = F(0.0)"]
    for s, (op, start) in enumerate((("<", "np.inf"), (">", "-np.inf"), ("<", "np.inf"), (">", "-np.inf"))):
        L += [f"    v = ex[{s * lanes}]", f"    ex[{s * lanes}] = F({start})",
              f"    for j in range(1, {lanes}):",
              f"        w = ex[{s * lanes} + j]",
              f"        v = w if w {op} v else v",
              f"        ex[{s * lanes} + j] = F({start})",
              f"    ext[b, {s}] = v + bad"]
    return L


__all__ = ["extremes_function", "lanes_setup", "screen_lines"]
