"""Fused token-level forward of the shared transformer (numba, CPU): one kernel per prompt.

The kernel's source is generated for the model's (d_in, d_model, heads, LayerNorm) and the zero
pattern of its weights (icl_bench/solvers/fused_source.py: the computation, unrolled, the blocked
scratch, and why leaving out zero products changes no rounding); this module compiles it, caches
it, and runs it from torch. It is the eager forward's (icl_bench/solvers/transformer.py,
docs/design.md §4) per-token computation in the same order, compiled without fast-math: every
sum runs in the order the code writes it (the key-value sums as 16 lane sums added in order), so
the centring and division of docs/design.md §5 round as in the eager path. Only the finiteness
checks of sparse kernels (sums of zeros) may reassociate. NaN and inf propagate, and a division
by zero gives inf, not an error.

A model with at least SPARSE_MIN of its matrix weights exactly zero (the constructions, l1-trained
models) gets a kernel specialised to its zero pattern; other models share the dense kernel of
their shape. A kernel whose generated source is larger than MAX_PRODUCTS multiplications is not
compiled (minutes of compile time): its model runs the dense kernel instead, or the eager
forward when that is too large as well (d_model 6 with 4 heads, 7 with 3, 8 with 2, and
beyond). Prompts are split over min(num_threads(), B (N + 1 + PROMPT_WORK) // MIN_WORK_PER_THREAD)
threads by `split` (the kernel releases the GIL; num_threads() is THREADS, else
torch.get_num_threads()). `fused_forward` returns None where it does not apply (numba missing or
disabled, non-CPU or non-float tensors, gradients wanted); `Transformer.forward` then runs its
eager path. Speed and accuracy, measured: docs/throughput.md.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from icl_bench.solvers import fused_cpu, fused_source
from icl_bench.solvers.fused_pattern import Pattern, kernel_key, pattern_of, zero_fraction
from icl_bench.solvers.fused_source import LANES

ENABLED = True  # False: every forward takes the eager path (comparisons, debugging)
FASTMATH = {"reassoc"}  # for the finiteness checks only (sums of zeros); never nnan / ninf
SPARSE_MIN = 0.25  # share of exactly-zero matrix weights from which a model gets its own sparse kernel
MAX_PRODUCTS = 1100  # larger generated kernels are not compiled: numba's compile time grows with their
#   size (one dtype, this 2-core machine: 14 s at 596 multiplications, the d_model 4 / 2-head dense
#   kernel; 33 s at 918, d_model 6 / 3 heads; 77 s at 1203; 104 s at 1938, d_model 8 / 4 heads)
MIN_WORK_PER_THREAD = 2**17  # fewer work units (tokens) per thread than this: fewer threads. Work of a
#   call: B (N + 1 + PROMPT_WORK); smaller shares lose to waking a thread. ln-closed-form, float32, two
#   threads forced against one (medians, lowest - highest of five runs, results/thread_ceiling.md):
#   N = 100 at 2^12 / 2^14 / 2^16 / 2^18 tokens: 0.43-0.62 / 0.55-0.74 / 0.91-0.95 / 1.04-1.40;
#   N = 10: 0.62-0.82 / 0.95-1.13 / 1.11-1.55 / 1.42-1.86. This threshold splits the last two of N = 10
#   and the last of N = 100.
PROMPT_WORK = 128  # a prompt's fixed cost in tokens' worth (ln-closed-form: ~0.4 us per prompt, ~3 ns per token)
THREADS: int | None = None  # threads of the fused kernels; None: torch.get_num_threads()
last_shares = 0  # threads the last `split` ran on (the benchmarks record it: a small call takes one)
calls = 0  # fused forwards run so far in this process (the benchmarks tell transformer solvers by it)
numba = None  # the numba module, imported on first use (~0.5 s); False where it is missing
_KERNELS: dict[tuple, object] = {}
_LOCK = threading.Lock()  # kernel compilation and the _KERNELS cache
_POOL_LOCK = threading.Lock()  # the shared pool: not _LOCK, which a compiling thread holds for seconds
_POOL: ThreadPoolExecutor | None = None
_POOL_NAME = "icl_bench-fused"  # its worker threads' name prefix
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (key, entry) of `_entry`
_ABOUT: dict = {}  # kernel -> its shape in words, for the line a compile logs (`_first_call`)


def available() -> bool:
    """True when the fused path is enabled and numba imports (it is optional)."""
    global numba
    if not ENABLED:
        return False
    if numba is None:
        try:
            import numba as nb
        except ImportError:
            nb = False
        else:
            fused_cpu.wide_vectors()  # before numba compiles anything
        numba = nb
    return numba is not False


def _cache_dir() -> Path:
    """Where generated kernel sources live, so numba can cache their machine code on disk:
    $ICL_BENCH_KERNEL_DIR, else $XDG_CACHE_HOME/icl_bench/kernels, else ~/.cache/icl_bench/kernels."""
    env = os.environ.get("ICL_BENCH_KERNEL_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "icl_bench" / "kernels"


def _kernel(din: int, d: int, H: int, ln: bool, pattern: Pattern | None = None):
    """The compiled kernel for one shape and zero pattern (None: dense; numba specialises it per
    dtype on first call), or None when its generated source writes more than MAX_PRODUCTS
    multiplications (fused_source.products). Its source is written to a file (rewritten only
    when it changed) and imported, so numba's on-disk cache skips the compilation next time;
    with no writable folder it compiles in memory."""
    if not available():
        raise RuntimeError("icl_bench.fused: numba is not installed (or the fused path is disabled)")
    key = (din, d, H, ln, pattern)
    with _LOCK:
        if key in _KERNELS:
            return _KERNELS[key]
        body = fused_source.source(din, d, H, ln, pattern)
        if fused_source.products(body) > MAX_PRODUCTS:
            _KERNELS[key] = None
            return None
        text = (f"# generated by icl_bench.solvers.fused_source.source{key[:4]}, "
                f"{'dense' if pattern is None else 'sparse'}; nonfinite, zsum: fastmath {sorted(FASTMATH)}; "
                f"LANES {LANES}\nimport numpy as np\n\n\n" + body)
        name = "icl_bench_kernel_" + hashlib.sha256(text.encode()).hexdigest()[:16]
        ns: dict = {"np": np}
        try:
            folder = _cache_dir()
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{name}.py"
            if not path.is_file() or path.read_text() != text:
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(text)
                os.replace(tmp, path)
            spec = importlib.util.spec_from_file_location(name, path)
            module = sys.modules.get(name) or importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # numba's cache re-imports the module by name
            spec.loader.exec_module(module)
            ns, cache = module.__dict__, True
        except OSError:
            exec(compile(text, f"<{name}>", "exec"), ns)  # noqa: S102 - our generated source
            cache = False
        for fname in fused_source.functions(text):  # helpers first: the kernel calls them
            fast = fname in ("nonfinite", "zsum")  # sums of zeros (or NaN): in vector lanes
            ns[fname] = _jit(ns[fname], FASTMATH if fast else False, cache)  # all arithmetic as written
        _KERNELS[key] = ns["kernel"]
        _ABOUT[ns["kernel"]] = (f"d_in {din}, d_model {d}, {H} head{'s' * (H > 1)}, {'' if ln else 'no '}LayerNorm, "
                                f"{'sparse' if pattern else 'dense'}, {fused_source.products(body)} products")
        return _KERNELS[key]


def _jit(fn, fastmath, cache: bool):
    """numba.njit(fn), with numba's on-disk cache when `cache`; where numba refuses to cache
    (RuntimeError: no writable cache folder for the module, e.g. a read-only kernel folder
    and a read-only home), compiled in memory instead."""
    opts = {"fastmath": fastmath, "error_model": "numpy", "nogil": True}
    if cache:
        try:
            return numba.njit(cache=True, **opts)(fn)
        except RuntimeError:
            pass
    return numba.njit(**opts)(fn)


# ---- the torch side ---------------------------------------------------------------------------

def _parameters(model) -> list[torch.Tensor]:
    """Every parameter of `model` and its submodules (a shared one once per place it is held), in
    a fixed order: what Module.parameters() walks, without its name strings and set of seen
    tensors. That walk ran on every forward and cost 2-4x this one (ln-closed-form 23 vs 12 us,
    gd-lsa's 66 parameters 172 vs 46 us, warm; several times more right after a large kernel)."""
    out, stack = [], [model]
    while stack:
        module = stack.pop()
        out += [p for p in module._parameters.values() if p is not None]
        stack += [m for m in module._modules.values() if m is not None]
    return out


def _entry(model, dtype: torch.dtype) -> dict:
    """The model's kernel inputs for `dtype`, cached (in _CACHE, beside the model: copies and
    pickles of it carry none) while its config and every parameter's storage address and version
    counter stay. One dict: "arrays", the weights as contiguous numpy copies; "pattern", their zero
    pattern after the cast; "zeros", its zero_fraction; "kernel", (SPARSE_MIN, MAX_PRODUCTS, the
    kernel chosen with them), filled by fused_forward; "storages", the parameters' storages, held so
    that no new tensor can take their addresses while the entry lives (`param.data = ...` moves no
    version counter, and a freed address reused by the next weights would match the key).
    An optimizer step, an in-place op on a parameter, a replaced parameter or `param.data = t`
    starts a new entry; an in-place write through `parameter.data` (e.g. `p.data.add_(...)`)
    bumps no version counter: call `forget(model)` after it, or the fused forward keeps the
    weights it read before."""
    params = _parameters(model)
    key = (dtype, model.cfg, tuple((p.data_ptr(), p._version) for p in params))
    cached = _CACHE.get(model)  # (an nn.Module takes weak references)
    if cached is not None and cached[0] == key:
        return cached[1]
    cfg = model.cfg
    with torch.no_grad():
        blocks = model.blocks
        cast = lambda t: np.array(t.detach().to(dtype).numpy(), order="C")  # noqa: E731  a copy, never a view
        att = [b.attn for b in blocks]
        Wkv = torch.stack([torch.cat([a.W_K.flatten(0, 1), a.W_V.flatten(0, 1)]) for a in att])  # (L, 2Hd, d)
        WQ = torch.stack([a.W_Q for a in att])  # (L, H, d, d)
        WO = torch.stack([a.W_O for a in att])
        d = cfg.d_model
        if cfg.layernorm:
            ones, zeros = torch.ones(d, dtype=dtype), torch.zeros(d, dtype=dtype)
            gain = torch.stack([b.ln.weight if b.ln.weight is not None else ones for b in blocks])  # (L, d)
            bias = torch.stack([b.ln.bias if b.ln.bias is not None else zeros for b in blocks])
        else:
            gain = bias = torch.zeros(len(blocks), d, dtype=dtype)
        rw = model.readout.weight.reshape(-1, d)  # (T or 1, d): row t = the weights of token t
        arrays = tuple(cast(t) for t in (model.embed.weight, Wkv, WQ, WO, gain, bias, rw))
    pattern = pattern_of(*arrays)
    entry = {"arrays": arrays, "pattern": pattern, "zeros": zero_fraction(pattern),
             "storages": [p.untyped_storage() for p in params]}
    _CACHE[model] = (key, entry)
    return entry


def _weights(model, dtype: torch.dtype) -> tuple[tuple, Pattern, float]:
    """The model's weights as contiguous numpy arrays for the kernel, their zero pattern (after the
    cast to `dtype`) and its zero_fraction (cached: see `_entry`)."""
    entry = _entry(model, dtype)
    return entry["arrays"], entry["pattern"], entry["zeros"]


def forget(model) -> None:
    """Drop the fused forward's cached weights of `model`, so the next forward reads them afresh:
    needed only after writes through `parameter.data`, which no version counter records."""
    _CACHE.pop(model, None)


def sparse_applies(cfg, pattern: Pattern, zeros: float, dtype: torch.dtype = torch.float64) -> bool:
    """Whether a model gets the kernel of its zero pattern: at least SPARSE_MIN of its matrix
    weights are zero, and leaving out its zero products cannot hide a NaN that the eager forward
    gives for a finite prompt. The one such case: with ln_eps = 0 in `dtype` (a float32 model
    rounds an eps below ~7e-46 to 0), a token whose attention output has zero variance gets
    1/std = inf, and a LayerNorm gain of exactly 0 turns that into 0 * inf = NaN in the eager
    (and dense) forward, while the sparse kernel leaves the product out. Such a model runs the
    dense kernel."""
    if zeros < SPARSE_MIN:
        return False
    eps_is_zero = torch.tensor(cfg.ln_eps, dtype=dtype).item() == 0
    return not (cfg.layernorm and eps_is_zero and not all(all(g) for g in pattern.gain))


TORCH_SUM_MAX_D = 4  # d_model up to which torch's sum over LayerNorm's slots adds them in slot order


def applies(model, tokens: torch.Tensor) -> bool:
    """Whether `fused_forward` runs for these tokens: numba present and enabled, CPU float32 /
    float64 tokens in the model's dtype, no gradient wanted, and a LayerNorm whose sum order the
    kernel keeps: it sums the mean slot by slot (ln_sum = "slots"), which is also torch's order
    (ln_sum = "torch", TransformerConfig's default) up to TORCH_SUM_MAX_D slots; above that torch's
    order changes with the token count (docs/ln-closed-form-multivariate.md, "Fragility"), so such
    a model runs the eager forward (the kernel had answered in slot order: a float32 experiment that
    contrasts the two orders measured the same number twice, found by a review)."""
    cfg = model.cfg
    if cfg.layernorm and cfg.ln_sum == "torch" and cfg.d_model > TORCH_SUM_MAX_D:
        return False
    if not available() or tokens.device.type != "cpu" or tokens.dtype not in (torch.float32, torch.float64):
        return False
    if tokens.ndim != 3 or tokens.shape[1] < 2 or tokens.shape[2] != model.cfg.d_in:
        return False
    w = model.embed.weight
    if w.dtype != tokens.dtype or w.device.type != "cpu":
        return False
    if torch.is_grad_enabled() and (tokens.requires_grad or any(p.requires_grad for p in model.parameters())):
        return False
    return True


def fused_forward(model, tokens: torch.Tensor, after=None,
                  extremes: torch.Tensor | None = None) -> torch.Tensor | None:
    """The model's output (B,) through the fused kernel, or None where it does not apply
    (see `applies`; the caller then runs the eager forward).

    Args:
        model: an icl_bench.solvers.transformer.Transformer (any config).
        tokens: (B, N+1, d_in) float32 / float64 CPU tensor in the model's dtype.
        after: optional callable after(b0, b1), run by each thread on the prompts b0 <= b < b1
            it has just computed (a solver's per-prompt screens, so they are split over the
            threads too); not run when the result is None.
        extremes: optional (B, 4) CPU tensor in the tokens' dtype, filled (when the result is not
            None) with each prompt's (x_min, x_max, y_min, y_max) over its N context tokens,
            x and y being token slots 0 and 1 (the univariate tokens of make_tokens), all four NaN
            where one of them is inf or NaN: what `icl_bench.solvers.base.screens` needs, read
            by the kernel's embedding pass instead of four more passes over x and y
            (icl_bench/solvers/fused_extremes.py).
    Returns:
        (B,) tensor in the tokens' dtype (or None).
    Raises:
        ValueError: a "flatten" readout model given prompts of another N than its own; `extremes`
            not a contiguous (B, 4) CPU tensor of the tokens' dtype, or tokens narrower than 2.
    """
    global calls
    if not applies(model, tokens):
        return None
    cfg = model.cfg
    B, T, din = tokens.shape
    N = T - 1
    M = N if cfg.keys == "masked" else T
    cfg.check_prompts(T)  # a flatten readout of another N: the kernel would read past its rows
    if extremes is None:
        ext = np.empty((B, 4), dtype=np.float32 if tokens.dtype == torch.float32 else np.float64)  # unused
    elif din < 2:
        raise ValueError(f"extremes: tokens of width d_in = {din} have no x and y slots (needs d_in >= 2)")
    elif (extremes.shape != (B, 4) or extremes.dtype != tokens.dtype or extremes.device.type != "cpu"
          or not extremes.is_contiguous()):
        layout = "" if extremes.is_contiguous() else ", not contiguous"
        raise ValueError(f"extremes: expected a contiguous ({B}, 4) {tokens.dtype} CPU tensor, got "
                         f"{tuple(extremes.shape)} {extremes.dtype} on {extremes.device.type}{layout}")
    else:
        ext = extremes.numpy()  # (B, 4), filled by the kernel
    out = torch.empty(B, dtype=tokens.dtype)
    if B == 0:  # nothing to compute (not counted in `calls`: no kernel ran)
        return out
    entry = _entry(model, tokens.dtype)
    limits = (SPARSE_MIN, MAX_PRODUCTS)  # what the choice depends on besides the weights
    first = entry.get("kernel", (None,))[0] != limits
    if first:  # chosen once per cached weights (~40 us a lookup)
        kern = None
        if sparse_applies(cfg, entry["pattern"], entry["zeros"], tokens.dtype):
            kern = _kernel(din, cfg.d_model, cfg.n_heads, cfg.layernorm, kernel_key(entry["pattern"]))
        if kern is None:  # not sparse enough, or its zero pattern's kernel too large: the dense kernel
            kern = _kernel(din, cfg.d_model, cfg.n_heads, cfg.layernorm)
        entry["kernel"] = (limits, kern)
    kern, arrays = entry["kernel"][1], entry["arrays"]
    if kern is None:  # the shape's dense kernel too large as well: the eager forward
        return None
    calls += 1
    threads = max(1, min(num_threads(), B * (T + PROMPT_WORK) // MIN_WORK_PER_THREAD))
    tok = tokens.detach().contiguous().reshape(B, T * din).numpy()  # 2-D: unit stride known
    args = (tok, *arrays, float(cfg.ln_eps), M, N, cfg.n_layers, cfg.readout == "flatten", out.numpy(), ext)
    if first:
        _first_call(kern, args, tokens.dtype)

    def share(b0: int, b1: int) -> None:
        kern(*args, b0, b1)
        if after is not None:
            after(b0, b1)

    split(share, B, threads)
    return out


def _first_call(kern, args: tuple, dtype: torch.dtype) -> None:
    """Call the kernel on no prompts (b0 = b1 = 0), so numba compiles it for these argument types
    or loads it from its disk cache now, and log one line when it compiled (numba's dispatcher
    stats count a cache miss): a first run compiles for minutes (docs/throughput.md, "Compile
    time"), which a progress bar alone does not explain; loading takes well under a second."""
    stats = getattr(kern, "stats", None)  # numba's _CompileStats; its counters are live
    if stats is None:  # (a numba without dispatcher stats: compile quietly)
        kern(*args, 0, 0)
        return
    before, t0 = sum(stats.cache_misses.values()), time.perf_counter()
    kern(*args, 0, 0)
    seconds = time.perf_counter() - t0
    if sum(stats.cache_misses.values()) > before:
        path = stats.cache_path
        later = (f"numba keeps it in {path}, so later runs load it" if path else
                 "compiled in memory (no writable kernel folder, $ICL_BENCH_KERNEL_DIR): each process compiles it")
        logging.getLogger(__name__).warning(f"icl-bench: compiled a fused kernel ({_ABOUT.get(kern, '?')}, "
                                            f"{str(dtype)[6:]}) in {seconds:.1f} s; {later}")


def split(work, B: int, threads: int) -> None:
    """Run work(b0, b1) on `threads` contiguous shares of the prompts 0 <= b < B at once: the
    calling thread takes the first share and the shared pool's threads - 1 workers the others
    (one wake-up fewer than handing every share to the pool, 34-82 us on the 2-vCPU machine of
    docs/throughput.md "Two threads on the Zen 3 machine"). Returns when every share is done; an
    exception of any share is raised after all have finished (none is left writing the output).
    Called from one of the pool's own workers (a share that splits again) it runs everything on
    that thread: its share would otherwise wait for the worker it occupies."""
    global last_shares
    if threads <= 1 or B <= 1 or threading.current_thread().name.startswith(_POOL_NAME):
        last_shares = 1
        work(0, B)
        return
    threads = last_shares = min(threads, B)
    edges = [t * B // threads for t in range(threads + 1)]  # (threads + 1,) share boundaries
    futures = []
    try:
        with _POOL_LOCK:  # no other call can replace the pool between taking it and submitting
            executor = _pool(threads - 1)
            futures += [executor.submit(work, edges[t], edges[t + 1]) for t in range(1, threads)]
        work(edges[0], edges[1])
    finally:
        for f in futures:
            f.exception()  # wait for it, even when this thread's share raised
    for f in futures:
        f.result()  # re-raise a worker's exception


def num_threads() -> int:
    """Threads the fused kernels use: THREADS if set, else torch.get_num_threads()."""
    return THREADS if THREADS is not None else torch.get_num_threads()


def _pool(workers: int) -> ThreadPoolExecutor:
    """The shared pool, with at least `workers` threads; call with _POOL_LOCK held. It only grows: a
    larger request replaces it (the old pool finishes what it was given, then its threads end),
    a smaller one uses the pool as it is (its threads start on demand and wait idle)."""
    global _POOL
    if _POOL is None or _POOL._max_workers < workers:
        if _POOL is not None:
            _POOL.shutdown(wait=False)  # submitted shares still run; no new ones go to it
        _POOL = ThreadPoolExecutor(workers, thread_name_prefix=_POOL_NAME)
    return _POOL
