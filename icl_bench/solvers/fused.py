"""Fused token-level forward of the shared transformer (numba, CPU): one kernel per prompt.

The computation is the eager forward's (icl_bench/solvers/transformer.py, docs/design.md §4), token by
token, so the float rounding stays of the same kind:

    embedding:  h_0(i) = W_E token_i, every token (the stream is kept channels-first, (d, T))
    layer l = 0 .. L-1:
        (l > 0) block l-1 on every token: a = P_{l-1} h; LayerNorm: c = a - mean(a),
                h <- (h + bias) + (c * gain) / sqrt(mean(c^2) + eps)   (no LN: h <- h + a)
        one pass over the key tokens j (M = N, or N+1 with keys "query-in-context"):
                k = W_K^k h_j, v = W_V^k h_j per head k;  acc_k += k v^T
        S_k = acc_k / M;  P_l = sum_k W_O^k S_k^T W_Q^k   (the layer's (d x d) map, per prompt)
    block L-1 on the query token (every token for readout "flatten"); readout w . h

The per-token code is generated for the model's (d_in, d_model, heads) with every small loop
unrolled, so the 2 * heads * d^2 accumulators are scalars and the loops over tokens vectorise.
Only the key-value pass, a reduction over tokens, may reassociate (numba fastmath "reassoc":
summed in vector lanes, as a batched matmul sums; "contract": fused multiply-adds, as in a
matmul); the embedding, the attention map and LayerNorm of each token run in program order
without fast-math, so the centring and division of docs/design.md §5 round as in the eager
path. NaN and inf propagate (no nnan / ninf), and a division by zero gives inf, not an error.

Prompts are split over min(num_threads(), B // MIN_PROMPTS_PER_THREAD) threads (the kernel
releases the GIL; num_threads() is THREADS, else torch.get_num_threads()). `fused_forward` returns None where it does not apply (numba missing or
disabled, non-CPU or non-float tensors, gradients wanted); `Transformer.forward` then runs its
eager path. Speed and accuracy, measured: docs/throughput.md.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

ENABLED = True  # False: every forward takes the eager path (comparisons, debugging)
FASTMATH = {"reassoc", "contract"}  # for the key-value reduction only; never nnan / ninf
PAD = 64  # key slots are zero-padded to a multiple of this (the vector loops' step: no scalar remainder)
PAD_SMALL = 16  # ... or of this when there are fewer than PAD keys (one vector; less padding at tiny N)
MIN_PROMPTS_PER_THREAD = 16  # fewer prompts per thread than this: fewer threads
THREADS: int | None = None  # threads of the fused kernels; None: torch.get_num_threads()
calls = 0  # fused forwards run so far in this process (the benchmarks tell transformer solvers by it)
numba = None  # the numba module, imported on first use (~0.5 s); False where it is missing
_KERNELS: dict[tuple, object] = {}
_LOCK = threading.Lock()
_POOL: ThreadPoolExecutor | None = None


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
        numba = nb
    return numba is not False


# ---- code generation: the per-token computation with every small loop unrolled ----------------

def _ind(lines: list[str], n: int) -> list[str]:
    return [" " * (4 * n) + s for s in lines]


def _block(d: int, ln: bool) -> list[str]:
    """h <- block(h): a = P h, then LayerNorm (gain g*, bias bb*) and the skip connection,
    in the order of Block.forward_channels."""
    lines = [f"a{r} = " + " + ".join(f"p_{r}_{c} * h{c}" for c in range(d)) for r in range(d)]
    if not ln:
        return lines + [f"h{r} = h{r} + a{r}" for r in range(d)]
    lines.append("mu = (" + " + ".join(f"a{r}" for r in range(d)) + ") / fd")
    lines += [f"c{r} = a{r} - mu" for r in range(d)]
    lines.append("var = (" + " + ".join(f"c{r} * c{r}" for r in range(d)) + ") / fd")
    lines.append("inv = one / np.sqrt(var + eps)")
    return lines + [f"h{r} = (h{r} + bb{r}) + (c{r} * g{r}) * inv" for r in range(d)]


def source(din: int, d: int, H: int, ln: bool) -> str:
    """Python source of the functions for one (d_in, d_model, heads, layernorm):

    embed(tok, b, We, scr, T, q): token i of prompt b -> h = W_E token in slot i (the query to slot q)
    block(scr, n, Pm, gain, bias, l, eps): slots 0 <= i < n of scr (a view) through block l
    keys(scr, Mp, Wkv, l, M, Sm): Sm[k] = (1/M) sum_{i < Mp} k_i v_i^T, layer l's heads
    kernel(tok, We, Wkv, WQ, WO, gain, bias, rw, eps, M, N, L, flatten, out, b0, b1): the whole
        forward of prompts b0 <= b < b1 into out[b]; tok is (B, T * d_in), token i of prompt b
        at tok[b, d_in*i : d_in*(i+1)] (2-D, so the compiler sees the unit stride).
    scr (d * (Mp + 1),) is the stream, token-major (slot i = scr[d*i : d*(i+1)], a 1-D array, so the
    compiler sees constant offsets and updates it in place in vector registers): key slots [0, M),
    zero slots up to Mp (a multiple of PAD, so the key pass runs whole vectors; zero keys and values
    add exactly 0), and the query in slot Mp when it is not a key (keys "masked").
    """
    L = ["def embed(tok, b, We, scr, T, q):"]
    L += _ind([f"we_{c}_{j} = We[{c}, {j}]" for c in range(d) for j in range(din)], 1)
    L += ["    for i in range(T - 1):"]
    L += _ind([f"t{j} = tok[b, {din} * i + {j}]" for j in range(din)], 2)
    L += _ind([f"scr[{d} * i + {c}] = " + " + ".join(f"we_{c}_{j} * t{j}" for j in range(din)) for c in range(d)], 2)
    L += _ind([f"t{j} = tok[b, {din} * (T - 1) + {j}]" for j in range(din)], 1)
    L += _ind([f"scr[{d} * q + {c}] = " + " + ".join(f"we_{c}_{j} * t{j}" for j in range(din)) for c in range(d)], 1)
    L += ["", "", "def block(scr, n, Pm, gain, bias, l, eps_in):",
          "    F = Pm.dtype.type",
          f"    one = F(1.0); fd = F({d}); eps = F(eps_in)"]
    L += _ind([f"p_{r}_{c} = Pm[l, {r}, {c}]" for r in range(d) for c in range(d)], 1)
    if ln:
        L += _ind([f"g{r} = gain[l, {r}]" for r in range(d)] + [f"bb{r} = bias[l, {r}]" for r in range(d)], 1)
    L += ["    for i in range(n):  # from 0: the compiler knows i >= 0 (no negative-index wrap)"]
    L += _ind([f"h{c} = scr[{d} * i + {c}]" for c in range(d)] + _block(d, ln) + [f"scr[{d} * i + {c}] = h{c}" for c in range(d)], 2)
    L += ["", "", "def keys(scr, Mp, Wkv, l, M, Sm):", "    F = Sm.dtype.type", "    fm = F(M)"]
    L += _ind([f"wk_{k}_{e}_{c} = Wkv[l, {k * d + e}, {c}]" for k in range(H) for e in range(d) for c in range(d)], 1)
    L += _ind([f"wv_{k}_{e}_{c} = Wkv[l, {H * d + k * d + e}, {c}]" for k in range(H) for e in range(d) for c in range(d)], 1)
    L += _ind([f"s_{k}_{e}_{f} = F(0.0)" for k in range(H) for e in range(d) for f in range(d)], 1)
    for k in range(H):  # one pass per head: its d^2 accumulators stay in vector registers
        kv = [f"h{c} = scr[{d} * i + {c}]" for c in range(d)]
        for e in range(d):
            kv.append(f"k{k}_{e} = " + " + ".join(f"wk_{k}_{e}_{c} * h{c}" for c in range(d)))
            kv.append(f"v{k}_{e} = " + " + ".join(f"wv_{k}_{e}_{c} * h{c}" for c in range(d)))
        kv += [f"s_{k}_{e}_{f} += k{k}_{e} * v{k}_{f}" for e in range(d) for f in range(d)]
        L += ["    for i in range(Mp):"] + _ind(kv, 2)
    L += _ind([f"Sm[{k}, {e}, {f}] = s_{k}_{e}_{f} / fm" for k in range(H) for e in range(d) for f in range(d)], 1)
    L += ["", "", "def kernel(tok, We, Wkv, WQ, WO, gain, bias, rw, eps, M, N, nL, flatten, out, b0, b1):",
          "    F = out.dtype.type",
          "    T = N + 1",
          f"    Mp = -(-M // {PAD}) * {PAD} if M >= {PAD} else -(-M // {PAD_SMALL}) * {PAD_SMALL}",
          "    q = T - 1 if M == T else Mp  # the query token's column",
          f"    scr = np.zeros({d} * (Mp + 1), dtype=out.dtype)",
          f"    Pm = np.empty((nL, {d}, {d}), dtype=out.dtype)",
          f"    Sm = np.empty(({H}, {d}, {d}), dtype=out.dtype)",
          f"    Xm = np.empty(({H}, {d}, {d}), dtype=out.dtype)",
          "    for b in range(b0, b1):",
          "        embed(tok, b, We, scr, T, q)",
          "        for l in range(nL):",
          "            if l > 0:  # every key slot, pads included (whole vectors), then the pads back to 0",
          "                block(scr, Mp, Pm, gain, bias, l - 1, eps)",
          f"                scr[{d} * M:{d} * Mp] = F(0.0)",
          "                if M < T:",
          f"                    block(scr[{d} * q:], 1, Pm, gain, bias, l - 1, eps)",
          "            keys(scr, Mp, Wkv, l, M, Sm)",
          "            # P_l = sum_k W_O^k S_k^T W_Q^k:  X_k[f, a] = sum_e S_k[e, f] W_Q^k[e, a]"] + _ind(_fold(d, H), 3) + [
          f"        block(scr[{d} * q:], 1, Pm, gain, bias, nL - 1, eps)",
          "        y = " + " + ".join(f"rw[N if flatten else 0, {c}] * scr[{d} * q + {c}]" for c in range(d)),
          "        if flatten:",
          "            block(scr, N, Pm, gain, bias, nL - 1, eps)",
          "            for i in range(N):",
          "                y += " + " + ".join(f"rw[i, {c}] * scr[{d} * i + {c}]" for c in range(d)),
          "        out[b] = y"]
    return "\n".join(L) + "\n"


UNROLL_FOLD = 2048  # unroll the per-prompt fold when H * d^3 multiply-adds are at most this


def _fold(d: int, H: int) -> list[str]:
    """P_l = sum_k W_O^k S_k^T W_Q^k: X_k[f, a] = sum_e S_k[e, f] W_Q^k[e, a], then
    P[g, a] = sum_k sum_f W_O^k[g, f] X_k[f, a], each sum in that order. Unrolled into scalar
    expressions for small shapes (it is a fixed cost per prompt and layer), small loops otherwise
    (compile time stays short for any shape); the two forms round identically."""
    if H * d ** 3 <= UNROLL_FOLD:
        lines = [f"x_{k}_{f}_{a} = " + " + ".join(f"Sm[{k}, {e}, {f}] * WQ[l, {k}, {e}, {a}]" for e in range(d))
                 for k in range(H) for f in range(d) for a in range(d)]
        return lines + [f"Pm[l, {g}, {a}] = " + " + ".join(f"WO[l, {k}, {g}, {f}] * x_{k}_{f}_{a}" for k in range(H) for f in range(d))
                        for g in range(d) for a in range(d)]
    return [f"for k in range({H}):",
            f"    for f in range({d}):",
            f"        for a in range({d}):",
            "            x = F(0.0)",
            f"            for e in range({d}):",
            "                x += Sm[k, e, f] * WQ[l, k, e, a]",
            "            Xm[k, f, a] = x",
            f"for g in range({d}):",
            f"    for a in range({d}):",
            "        x = F(0.0)",
            f"        for k in range({H}):",
            f"            for f in range({d}):",
            "                x += WO[l, k, g, f] * Xm[k, f, a]",
            "        Pm[l, g, a] = x"]


def _cache_dir() -> Path:
    """Where generated kernel sources live, so numba can cache their machine code on disk:
    $ICL_BENCH_KERNEL_DIR, else $XDG_CACHE_HOME/icl_bench/kernels, else ~/.cache/icl_bench/kernels."""
    env = os.environ.get("ICL_BENCH_KERNEL_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "icl_bench" / "kernels"


def _kernel(din: int, d: int, H: int, ln: bool):
    """The compiled kernel for one shape (numba specialises it per dtype on first call). Its
    source is written to a file (rewritten only when it changed) and imported, so numba's
    on-disk cache skips the compilation next time; with no writable folder it compiles in memory."""
    if not available():
        raise RuntimeError("icl_bench.fused: numba is not installed (or the fused path is disabled)")
    key = (din, d, H, ln)
    with _LOCK:
        if key in _KERNELS:
            return _KERNELS[key]
        text = (f"# generated by icl_bench.solvers.fused.source{key}; keys(): fastmath {sorted(FASTMATH)}, PAD {PAD}/{PAD_SMALL}\n"
                "import numpy as np\n\n\n" + source(din, d, H, ln))
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
        jit = lambda fast: numba.njit(fastmath=fast, error_model="numpy", nogil=True, cache=cache)  # noqa: E731
        for fname in ("embed", "block", "kernel"):  # per-token arithmetic as written: no fast-math
            ns[fname] = jit(False)(ns[fname])
        ns["keys"] = jit(FASTMATH)(ns["keys"])  # the reduction over tokens: in vector lanes
        _KERNELS[key] = ns["kernel"]
        return _KERNELS[key]


# ---- the torch side ---------------------------------------------------------------------------

def _weights(model, dtype: torch.dtype) -> tuple:
    """The model's weights as contiguous numpy arrays for the kernel, cached on the model while
    no parameter changes (keyed by each parameter's storage and version counter)."""
    params = list(model.parameters())
    key = (dtype, tuple((p.data_ptr(), p._version) for p in params))
    cached = getattr(model, "_fused_weights", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    cfg = model.cfg
    with torch.no_grad():
        blocks = model.blocks
        cast = lambda t: np.ascontiguousarray(t.detach().to(dtype).numpy())  # noqa: E731
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
    try:
        model._fused_weights = (key, arrays)
    except AttributeError:  # pragma: no cover - a module that refuses attributes: no cache
        pass
    return arrays


def applies(model, tokens: torch.Tensor) -> bool:
    """Whether `fused_forward` runs for these tokens: numba present and enabled, CPU float32 /
    float64 tokens in the model's dtype, and no gradient wanted."""
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


def fused_forward(model, tokens: torch.Tensor) -> torch.Tensor | None:
    """The model's output (B,) through the fused kernel, or None where it does not apply
    (see `applies`; the caller then runs the eager forward).

    Args:
        model: an icl_bench.solvers.transformer.Transformer (any config).
        tokens: (B, N+1, d_in) float32 / float64 CPU tensor in the model's dtype.
    Returns:
        (B,) tensor in the tokens' dtype (or None).
    """
    global calls
    if not applies(model, tokens):
        return None
    calls += 1
    cfg = model.cfg
    B, T, din = tokens.shape
    N = T - 1
    M = N if cfg.keys == "masked" else T
    out = torch.empty(B, dtype=tokens.dtype)
    if B == 0:
        return out
    arrays = _weights(model, tokens.dtype)
    kern = _kernel(din, cfg.d_model, cfg.n_heads, cfg.layernorm)
    threads = max(1, min(num_threads(), B // MIN_PROMPTS_PER_THREAD))
    tok = tokens.detach().contiguous().reshape(B, T * din).numpy()  # 2-D: unit stride known
    args = (tok, *arrays, float(cfg.ln_eps), M, N, cfg.n_layers, cfg.readout == "flatten", out.numpy())
    if threads == 1:
        kern(*args, 0, B)
        return out
    edges = [t * B // threads for t in range(threads + 1)]
    list(pool(threads).map(lambda t: kern(*args, edges[t], edges[t + 1]), range(threads)))
    return out


def num_threads() -> int:
    """Threads the fused kernels use: THREADS if set, else torch.get_num_threads()."""
    return THREADS if THREADS is not None else torch.get_num_threads()


def pool(threads: int) -> ThreadPoolExecutor:
    """A shared pool of `threads` workers (the kernel releases the GIL)."""
    global _POOL
    with _LOCK:
        if _POOL is None or _POOL._max_workers != threads:
            if _POOL is not None:
                _POOL.shutdown(wait=False)
            _POOL = ThreadPoolExecutor(threads, thread_name_prefix="icl_bench-fused")
        return _POOL
