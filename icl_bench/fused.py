"""Fused token-level forward of the shared transformer (numba, CPU): one kernel per prompt.

The computation is the eager forward's (icl_bench/transformer.py, DESIGN section 4), token by
token and in the same order, so the float rounding stays of the same kind:

    pass l = 0 .. L-1, over the key tokens j (M = N, or N+1 with keys "query-in-context"):
        h_l(j)  (embedding for l = 0; block l-1 applied to h_{l-1}(j) otherwise)
        k = W_K^k h, v = W_V^k h per head;  acc_k += k v^T       (key-value outer products)
    S_k = acc_k / M;  P_l = sum_k W_O^k S_k^T W_Q^k               (the layer's (d x d) map)
    block l: a = P_l h;  LN: c = a - mean(a), h <- (h + bias) + (gain * c) / sqrt(mean(c^2) + eps)
    query token: embedding, then every block with its P_l;  readout w . h_L(query)
    (readout "flatten": one more pass, sum_t w_t . h_L(t))

Each token is read once per layer: pass 1 recomputes the embedding from the token instead of
storing it, passes 2.. read the previous layer's stream from a per-thread (d, M) scratch that
stays in cache, and nothing of width d is written to memory for a 2-layer model. The per-token
code is generated for the model's (d_in, d_model, heads) with every small loop unrolled, so
the 2*heads*d^2 accumulators are scalars and the loop over tokens vectorises: the reductions
over tokens may be reassociated (`fastmath` reassoc: summed in vector lanes, as a batched
matmul sums) and multiply-adds may fuse; nothing else is relaxed (NaN and inf propagate).

Prompts run in parallel over numba threads (as many as torch.get_num_threads()).
`fused_forward` returns None where it does not apply (numba missing, CUDA or non-float
tensors, gradients wanted); `Transformer.forward` then runs its eager path.
Measured speed and accuracy: docs/throughput.md.
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

try:  # optional: without numba every forward is the eager one
    import numba
except ImportError:  # pragma: no cover - exercised by tests through monkeypatching
    numba = None

ENABLED = True  # set False to force the eager forward everywhere (tests, comparisons)
FASTMATH = {"reassoc", "contract"}  # reductions in vector lanes, fused multiply-adds; no nnan/ninf
_KERNELS: dict[tuple, object] = {}
_LOCK = threading.Lock()
_POOL: ThreadPoolExecutor | None = None
MIN_PROMPTS_PER_THREAD = 16  # fewer prompts per thread than this: run on one thread


def available() -> bool:
    """True when numba imported and the fused path is enabled."""
    return numba is not None and ENABLED


# ---- code generation: the per-token computation with every small loop unrolled ----------------

def _embed(din: int, d: int, ind: str, src: str) -> list[str]:
    """h_c = sum_j We[c, j] * t_j, the token read from `src` (e.g. tok[b, i, j])."""
    lines = [f"{ind}t{j} = {src.format(j=j)}" for j in range(din)]
    lines += [f"{ind}h{c} = " + " + ".join(f"we_{c}_{j} * t{j}" for j in range(din)) for c in range(d)]
    return lines


def _block(d: int, ln: bool, ind: str, P: str, g: str, bb: str) -> list[str]:
    """h <- block(h): a = P h, then LayerNorm (gain g*, bias bb*) and the skip connection."""
    lines = [f"{ind}a{r} = " + " + ".join(f"{P}_{r}_{c} * h{c}" for c in range(d)) for r in range(d)]
    if not ln:
        return lines + [f"{ind}h{r} = h{r} + a{r}" for r in range(d)]
    lines.append(f"{ind}mu = (" + " + ".join(f"a{r}" for r in range(d)) + ") / fd")
    lines += [f"{ind}c{r} = a{r} - mu" for r in range(d)]
    lines.append(f"{ind}var = (" + " + ".join(f"c{r} * c{r}" for r in range(d)) + ") / fd")
    lines.append(f"{ind}inv = one / np.sqrt(var + eps)")
    lines += [f"{ind}h{r} = (h{r} + {bb}{r}) + (c{r} * {g}{r}) * inv" for r in range(d)]
    return lines


def _kv(d: int, H: int, ind: str) -> list[str]:
    """Per head k: keys and values of h, and their outer product added to s_k_e_f."""
    lines = []
    for k in range(H):
        for e in range(d):
            lines.append(f"{ind}k{k}_{e} = " + " + ".join(f"wk_{k}_{e}_{c} * h{c}" for c in range(d)))
            lines.append(f"{ind}v{k}_{e} = " + " + ".join(f"wv_{k}_{e}_{c} * h{c}" for c in range(d)))
        lines += [f"{ind}s_{k}_{e}_{f} += k{k}_{e} * v{k}_{f}" for e in range(d) for f in range(d)]
    return lines


def _load_layer(d: int, H: int, ln: bool, ind: str, layer: str, kv: bool, prev: bool) -> list[str]:
    """Scalars of one layer's weights: W_K, W_V rows of `layer`; P, gain, bias of layer-1."""
    lines = []
    if kv:
        lines += [f"{ind}wk_{k}_{e}_{c} = Wkv[{layer}, {k * d + e}, {c}]" for k in range(H) for e in range(d) for c in range(d)]
        lines += [f"{ind}wv_{k}_{e}_{c} = Wkv[{layer}, {H * d + k * d + e}, {c}]" for k in range(H) for e in range(d) for c in range(d)]
    if prev:
        lines += [f"{ind}pp_{r}_{c} = Pm[{layer} - 1, {r}, {c}]" for r in range(d) for c in range(d)]
        if ln:
            lines += [f"{ind}gp{r} = gain[{layer} - 1, {r}]" for r in range(d)]
            lines += [f"{ind}bp{r} = bias[{layer} - 1, {r}]" for r in range(d)]
    return lines


def _fold(d: int, H: int, layer: str) -> list[str]:
    """P[layer] = sum_k W_O^k S_k^T W_Q^k with S_k = s_k / M: X_k[f, a] = sum_e S_k[e, f] W_Q^k[e, a],
    then P[g, a] = sum_k sum_f W_O^k[g, f] X_k[f, a] (loops: a fixed cost per prompt and layer)."""
    lines = [f"Sm[{k}, {e}, {f}] = s_{k}_{e}_{f} / fm" for k in range(H) for e in range(d) for f in range(d)]
    return lines + [
        f"for k in range({H}):",
        f"    for f in range({d}):",
        f"        for a in range({d}):",
        "            x = zero",
        f"            for e in range({d}):",
        f"                x += Sm[k, e, f] * WQ[{layer}, k, e, a]",
        "            Xm[k, f, a] = x",
        f"for g in range({d}):",
        f"    for a in range({d}):",
        "        x = zero",
        f"        for k in range({H}):",
        f"            for f in range({d}):",
        f"                x += WO[{layer}, k, g, f] * Xm[k, f, a]",
        f"        Pm[{layer}, g, a] = x"]


def _zero(d: int, H: int, ind: str) -> list[str]:
    return [f"{ind}s_{k}_{e}_{f} = zero" for k in range(H) for e in range(d) for f in range(d)]


def _ind(lines: list[str], n: int) -> list[str]:
    return [" " * (4 * n) + s for s in lines]


def source(din: int, d: int, H: int, ln: bool) -> str:
    """Python source of the kernel for one (d_in, d_model, heads, layernorm); see `_kernel`.

    kernel(tok (B, T * d_in) (token i of prompt b at tok[b, d_in*i : d_in*(i+1)]), We (d, d_in), Wkv (L, 2Hd, d), WQ, WO (L, H, d, d), gain, bias
    (L, d), rw (T or 1, d), eps, M, N, L, flatten, out (B,), b0, b1): out[b] = the model's
    output for prompts b0 <= b < b1.
    """
    block = _block(d, ln, "", "pp", "gp", "bp")
    kv, store = _kv(d, H, ""), [f"scr[{c}, i] = h{c}" for c in range(d)]
    get = [f"h{c} = scr[{c}, i]" for c in range(d)]
    prev = _load_layer(d, H, ln, "", "l", kv=False, prev=True)
    L = ["def kernel(tok, We, Wkv, WQ, WO, gain, bias, rw, eps_in, M, N, nL, flatten, out, b0, b1):",
         f"    one = F(1.0); zero = F(0.0); fd = F({d}); fm = F(M); eps = F(eps_in)",
         f"    Pm = np.empty((nL, {d}, {d}), dtype=F)",
         f"    Sm = np.empty(({H}, {d}, {d}), dtype=F)",
         f"    Xm = np.empty(({H}, {d}, {d}), dtype=F)",
         f"    scr = np.empty(({d}, M), dtype=F)  # the stream h_l of the key tokens, channels-first"]
    L += _ind([f"we_{c}_{j} = We[{c}, {j}]" for c in range(d) for j in range(din)], 1)
    body = ["acc = zero"]
    # pass 0: embedding, keys and values of layer 0
    body += _load_layer(d, H, ln, "", "0", kv=True, prev=False) + _zero(d, H, "")
    body += ["for i in range(M):"] + _ind(_embed(din, d, "", f"tok[b, {din} * i + {{j}}]") + kv + store, 1)
    body += _fold(d, H, "0")
    # passes l = 1 .. L-1: block l-1 applied to h_{l-1}, keys and values of layer l
    p = _load_layer(d, H, ln, "", "l", kv=True, prev=True) + _zero(d, H, "")
    p += ["for i in range(M):"] + _ind(get + block + kv + store, 1)
    body += ["for l in range(1, nL):"] + _ind(p + _fold(d, H, "l"), 1)
    # readout "flatten": the last block on every context token, dotted with its readout row
    f = ["l = nL"] + prev + ["for i in range(N):"]
    f += _ind(get + block + ["acc += " + " + ".join(f"rw[i, {c}] * h{c}" for c in range(d))], 1)
    body += ["if flatten:"] + _ind(f, 1)
    # the query token: embedding, every block, readout
    body += _embed(din, d, "", f"tok[b, {din} * N + {{j}}]")
    q = [f"pp_{r}_{c} = Pm[l, {r}, {c}]" for r in range(d) for c in range(d)]
    if ln:
        q += [f"gp{r} = gain[l, {r}]" for r in range(d)] + [f"bp{r} = bias[l, {r}]" for r in range(d)]
    body += ["for l in range(nL):"] + _ind(q + block, 1)
    body += ["yq = " + " + ".join(f"rw[N if flatten else 0, {c}] * h{c}" for c in range(d)),
             "out[b] = (acc + yq) if flatten else yq"]
    L += ["    for b in range(b0, b1):"] + _ind(body, 2)
    return "\n".join(L) + "\n"


def _cache_dir() -> Path:
    """Where generated kernel sources live, so numba can cache their machine code on disk:
    $ICL_BENCH_KERNEL_DIR, else $XDG_CACHE_HOME/icl_bench/kernels, else ~/.cache/icl_bench/kernels."""
    env = os.environ.get("ICL_BENCH_KERNEL_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "icl_bench" / "kernels"


def _kernel(din: int, d: int, H: int, ln: bool, dtype: np.dtype):
    """The compiled kernel for one shape and dtype: its source is written to a file (rewritten
    only if it changed) and imported, so numba's on-disk cache skips the compilation next time;
    where no cache folder is writable it is compiled in memory."""
    dt = np.dtype(dtype)
    key = (din, d, H, ln, dt.name)
    with _LOCK:
        if key in _KERNELS:
            return _KERNELS[key]
        text = f"# generated by icl_bench.fused.source{key}; njit{sorted(FASTMATH)}, error_model=numpy\nimport numpy as np\nF = np.{dt.name}\n\n" + source(din, d, H, ln)
        name = "icl_bench_kernel_" + hashlib.sha256(text.encode()).hexdigest()[:16]
        ns: dict = {}
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
            func, cache = module.kernel, True
        except OSError:
            exec(compile(text, f"<{name}>", "exec"), ns)  # noqa: S102 - our generated source
            func, cache = ns["kernel"], False
        _KERNELS[key] = numba.njit(fastmath=FASTMATH, error_model="numpy", nogil=True, cache=cache)(func)
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
        model: an icl_bench.transformer.Transformer (any config).
        tokens: (B, N+1, d_in) float32 / float64 CPU tensor in the model's dtype.
    Returns:
        (B,) tensor in the tokens' dtype (or None).
    """
    if not applies(model, tokens):
        return None
    cfg = model.cfg
    B, T, din = tokens.shape
    N = T - 1
    M = N if cfg.keys == "masked" else T
    out = torch.empty(B, dtype=tokens.dtype)
    if B == 0:
        return out
    arrays = _weights(model, tokens.dtype)
    kern = _kernel(din, cfg.d_model, cfg.n_heads, cfg.layernorm, tokens.numpy().dtype)
    threads = max(1, min(torch.get_num_threads(), B // MIN_PROMPTS_PER_THREAD))
    tok = tokens.detach().contiguous().reshape(B, T * din).numpy()  # 2-D: unit stride known
    args = (tok, *arrays, float(cfg.ln_eps), M, N, cfg.n_layers, cfg.readout == "flatten", out.numpy())
    if threads == 1:
        kern(*args, 0, B)
        return out
    edges = [t * B // threads for t in range(threads + 1)]
    list(_pool(threads).map(lambda t: kern(*args, edges[t], edges[t + 1]), range(threads)))
    return out


def _pool(threads: int) -> ThreadPoolExecutor:
    """A shared pool of `threads` workers (the kernel releases the GIL)."""
    global _POOL
    with _LOCK:
        if _POOL is None or _POOL._max_workers != threads:
            if _POOL is not None:
                _POOL.shutdown(wait=False)
            _POOL = ThreadPoolExecutor(threads, thread_name_prefix="icl_bench-fused")
        return _POOL
