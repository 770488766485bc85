"""Source of the fused forward's numba kernels (icl_bench/solvers/fused.py compiles and runs them).

The per-token computation is the eager forward's (icl_bench/solvers/transformer.py,
docs/design.md §4), written out for one model shape with every small loop unrolled:

    embedding:  h_0(i) = W_E token_i
    layer l = 0 .. L-1:
        (l > 0) block l-1 on every token: a = P_{l-1} h; LayerNorm: c = a - mean(a),
                h <- (h + bias) + (c * gain) / sqrt(mean(c^2) + eps)   (no LN: h <- h + a)
        over the key tokens (M = N, or N+1 with keys "query-in-context"), per group of heads:
                k = W_K^k h_j, v = W_V^k h_j;  acc_k += k v^T
        S_k = acc_k / M;  P_l = sum_k W_O^k S_k^T W_Q^k   (the layer's (d x d) map, per prompt)
    block L-1 on the query token (every token for readout "flatten"); readout w . h

**Layout and order.** The stream of one prompt lives in a blocked scratch: LANES = 16 tokens per
block, each slot's 16 values contiguous, so the loops over a block read and write whole vectors
(no gathers, scatters or shuffles). A layer's block and the next layer's key-value products run
in one pass (the embedding and layer 0's likewise) when that loop stays short (FUSE_MAX
products: the sparse constructions); longer ones, as in a dense model, run the block in a loop
of its own, which measured 13-16 % faster there (fewer values live at once: AVX2 has 16 vector
registers). Each key-value sum is kept as 16 lane sums (lane j adds tokens j, j + 16, ... in
order) and the lanes are added in order at the end: a fixed order, the same on every machine,
compiled without fast-math like every other sum here.

**Sparsity.** `source` takes a `Pattern` (icl_bench/solvers/fused_pattern.py): which weights are
exactly zero. A product with a zero weight is left out of the generated sums, and so is every
term that is zero by structure (a key or value row whose weights are all zero, the entries of
S_k and P_l they feed). For finite values this changes no rounding: a + 0 = a exactly, and the
remaining terms are summed in the same order (only signs of zero may differ), so the sparse and
dense kernels agree bit for bit (tests/test_fused.py). The constructions then do 26
(ln-closed-form) and 113 (gd-lsa, 16 layers) multiplications per token instead of 220 and 1020.
What a left-out product would still have done is turn an inf or NaN into NaN (0 * inf): a sparse
kernel therefore returns NaN for a prompt with a non-finite token or a non-finite key-value sum,
as the dense products do. (One case is not caught: a value that overflows inside a token's
stream, |h| near the dtype's maximum, in a slot that no later non-zero weight reads; there the
eager path's 0 * inf gives NaN and the sparse kernel a finite answer.)
"""
from __future__ import annotations

from itertools import product

from icl_bench.solvers.fused_extremes import extremes_function, lanes_setup, screen_lines
from icl_bench.solvers.fused_pattern import Pattern, dense, layer_structure

UNROLL_FOLD = 128  # unroll the per-prompt fold when that writes at most this many multiplications
ACC_PER_PASS = 16  # accumulators of one key-value pass: heads are grouped into passes up to this
SPLIT_MAX = 32  # up to this many key-value products (H d^2), whole blocks get their own unmasked loops
LANES = 16  # the scratch is blocked: LANES tokens per block, each slot's LANES values contiguous
FUSE_MAX = 32  # a block (or the embedding) shares its loop with the first key-value pass up to this many products


def _sum(terms: list[str], zero: str = "zero") -> str:
    """Left-to-right sum of the terms (program order), or the zero when there are none."""
    return " + ".join(terms) if terms else zero


def _ind(lines: list[str], n: int) -> list[str]:
    return [" " * (4 * n) + s for s in lines]


# ---- per-token code: the body of a loop over one block's LANES tokens (o, j), or of token i ----

def _at(d: int, c: int, blocked: bool, i: str = "i") -> str:
    """Address of slot c of a token in the blocked scratch: in a loop over blocks (variables o, j)
    or of the one token i (scalar code)."""
    return f"o + {c * LANES} + j" if blocked else f"({i} // {LANES}) * {LANES * d} + {i} % {LANES} + {c * LANES}"


def _loops(bodies: list[list[str]], d: int, k0: str, k1: str, offset: bool = False) -> list[str]:
    """One loop nest over blocks k0 <= blk < k1 and their LANES tokens j per body. offset (k0 not
    a literal 0: the pad block's loops): count blk = k0 + n from 0 after a k0 >= 0 test, else LLVM
    keeps numba's negative-index wrap-around and runs the loop scalar (docs/throughput.md)."""
    out = [f"if {k0} < 0:  # never: lets the compiler see that no index is negative", "    return"] if offset else []
    for body in bodies:
        out += [f"for n in range({k1} - {k0}):", f"    blk = {k0} + n"] if offset else [f"for blk in range({k0}, {k1}):"]
        out += [f"    o = blk * {LANES * d}", f"    for j in range({LANES}):"]
        out += _ind(body, 2)
    return out


class _Embed:
    """h_0 = W_E token: token i of prompt b into slot dst."""

    def __init__(self, p: Pattern, din: int, d: int):
        self.rows = [[j for j in range(din) if p.we[c][j]] for c in range(d)]
        self.din, self.d = din, d

    def head(self) -> list[str]:
        return ["zero = scr.dtype.type(0.0)"] + [f"we_{c}_{j} = We[{c}, {j}]" for c in range(self.d) for j in self.rows[c]]

    def body(self, blocked: bool, dst: str = "i", masked: bool = False, tail: bool = False) -> list[str]:
        """masked: lanes of key slot M or beyond (pads) read 0 instead of a token, so their
        slots are W_E 0 = 0 exactly. tail: the same for the one block that holds pads, read from
        a copy of that block's tokens with zeros for the pads (`tok` row b: the kernel's `tt`, row
        0), so the loads need no condition and the loop vectorises. blocked: also the extremes of
        the context's x and y (token slots 0 and 1) into the lanes `ex`
        (icl_bench/solvers/fused_extremes.py)."""
        src = f"{self.din} * j" if tail else f"{self.din} * (blk * {LANES} + j)" if blocked else f"{self.din} * i"
        when = f" if blk * {LANES} + j < M else zero" if masked and not tail else ""
        screen = blocked and self.din >= 2  # (tokens one value wide have no x and y: no extremes)
        used = {j for r in self.rows for j in r} | ({0, 1} if screen else set())
        out = [f"t{j} = tok[b, {src} + {j}]{when}" for j in sorted(used)]
        out += [f"scr[{_at(self.d, c, blocked, dst)}] = " + _sum([f"we_{c}_{j} * t{j}" for j in self.rows[c]])
                for c in range(self.d)]
        return out + (screen_lines(masked, LANES) if screen else [])


class _Block:
    """h <- block(h) of one layer pattern: a = P h, then LayerNorm and the skip connection, in the
    order of Block.forward_channels; structurally zero terms left out. Weights of layer `lb`."""

    def __init__(self, P: list, gain: tuple, bias: tuple, d: int, ln: bool):
        self.P, self.gain, self.bias, self.d, self.ln = P, gain, bias, d, ln
        self.rows = [r for r in range(d) if any(P[r])]

    def head(self) -> list[str]:
        d, P = self.d, self.P
        out = ["F = Pm.dtype.type", f"zero = F(0.0); one = F(1.0); fd = F({d}); eps = F(eps_in)"]
        out += [f"p_{r}_{c} = Pm[lb, {r}, {c}]" for r in range(d) for c in range(d) if P[r][c]]
        if self.ln:
            out += [f"g{r} = gain[lb, {r}]" for r in range(d) if self.gain[r]]
            out += [f"bb{r} = bias[lb, {r}]" for r in range(d) if self.bias[r]]
        return out

    def body(self, blocked: bool, masked: bool = False) -> list[str]:
        """masked: lanes of key slot M or beyond (pads) are stored as 0, so they add nothing to
        the next key-value sums."""
        d, rows, gain, bias = self.d, self.rows, self.gain, self.bias
        when = f" if blk * {LANES} + j < M else zero" if masked else ""
        at = lambda c: _at(d, c, blocked)
        out = [f"h{c} = scr[{at(c)}]" for c in range(d)]
        out += [f"a{r} = " + _sum([f"p_{r}_{c} * h{c}" for c in range(d) if self.P[r][c]]) for r in rows]
        if self.ln:
            out.append("mu = (" + _sum([f"a{r}" for r in rows]) + ") / fd")
            out += [f"c{r} = a{r} - mu" if r in rows else f"c{r} = -mu" for r in range(d)]
            out.append("var = (" + " + ".join(f"c{r} * c{r}" for r in range(d)) + ") / fd")
            out.append("inv = one / np.sqrt(var + eps) + var * zero")  # NaN where var overflowed (the eager path's)
            new = {r: (f"(h{r} + bb{r})" if bias[r] else f"h{r}") + (f" + (c{r} * g{r}) * inv" if gain[r] else "")
                   for r in range(d) if bias[r] or gain[r]}
        else:
            new = {r: f"h{r} + a{r}" for r in rows}
        return out + [f"scr[{at(r)}] = {e}{when}" if not when else f"scr[{at(r)}] = ({e}){when}" for r, e in new.items()]


class _Keys:
    """One layer pattern's key-value sums: per token k = W_K^k h, v = W_V^k h, and for every
    structural (k, e, f) acc[n * LANES + j] += k_e v_f, LANES partial sums per accumulator (lane j
    sums tokens j, j + LANES, ... in order; `sums` adds the lanes in order). Heads are grouped
    into passes of at most ACC_PER_PASS accumulators (one pass per head when dense)."""

    def __init__(self, s: dict, d: int, H: int):
        self.kin, self.vin, self.S, self.d, self.H = s["kin"], s["vin"], s["s"], d, H
        self.acc = [[(e, f) for e in range(d) for f in range(d) if self.S[k][e][f]] for k in range(H)]
        self.slot = {(k, e, f): n for n, (k, e, f) in enumerate((k, e, f) for k in range(H) for e, f in self.acc[k])}
        passes, cur = [], []
        for k in (k for k in range(H) if self.acc[k]):
            if cur and sum(len(self.acc[j]) for j in cur) + len(self.acc[k]) > ACC_PER_PASS:
                passes.append(cur)
                cur = []
            cur.append(k)
        self.passes = passes + ([cur] if cur else [])

    def head(self) -> list[str]:
        d, H, S = self.d, self.H, self.S
        out = [f"wk_{k}_{e}_{c} = Wkv[l, {k * d + e}, {c}]" for k in range(H) for e in range(d)
               for c in self.kin[k][e] if any(S[k][e])]
        return out + [f"wv_{k}_{f}_{c} = Wkv[l, {H * d + k * d + f}, {c}]" for k in range(H) for f in range(d)
                      for c in self.vin[k][f] if any(S[k][e][f] for e in range(d))]

    def bodies(self) -> list[list[str]]:
        """One blocked-loop body per pass."""
        out = []
        for heads in self.passes:
            es = {k: sorted({e for e, _ in self.acc[k]}) for k in heads}
            fs = {k: sorted({f for _, f in self.acc[k]}) for k in heads}
            cols = sorted({c for k in heads for e in es[k] for c in self.kin[k][e]}
                          | {c for k in heads for f in fs[k] for c in self.vin[k][f]})
            body = [f"h{c} = scr[{_at(self.d, c, True)}]" for c in cols]
            for k in heads:
                body += [f"k{k}_{e} = " + " + ".join(f"wk_{k}_{e}_{c} * h{c}" for c in self.kin[k][e]) for e in es[k]]
                body += [f"v{k}_{f} = " + " + ".join(f"wv_{k}_{f}_{c} * h{c}" for c in self.vin[k][f]) for f in fs[k]]
            out.append(body + [f"acc[{self.slot[k, e, f] * LANES} + j] += k{k}_{e} * v{k}_{f}"
                               for k in heads for e, f in self.acc[k]])
        return out

    def sums(self, name: str) -> list[str]:
        """def name(acc, Sm, M): Sm[k, e, f] = (sum of the lanes, in order) / M, 0 where zero by
        structure; the lanes are reset to 0 for the next layer."""
        L = [f"def {name}(acc, Sm, M):", "    F = Sm.dtype.type", "    fm = F(M)"]
        for k, e, f in product(range(self.H), range(self.d), range(self.d)):
            if (k, e, f) in self.slot:
                n = self.slot[k, e, f] * LANES
                L += ["    s = F(0.0)", f"    for j in range({LANES}):", f"        s += acc[{n} + j]",
                      f"        acc[{n} + j] = F(0.0)", f"    Sm[{k}, {e}, {f}] = s / fm"]
            else:
                L.append(f"    Sm[{k}, {e}, {f}] = F(0.0)")
        return L


def _function(name: str, args: str, head: list[str], body: list[str]) -> list[str]:
    return ["", "", f"def {name}({args}):"] + _ind(head + body or ["pass  # nothing to do: every weight of it is 0"], 1)


def _fold(name: str, s: dict, wq: tuple, wo: tuple, d: int, H: int) -> list[str]:
    """P_l = sum_k W_O^k S_k^T W_Q^k: X_k[f, a] = sum_e S_k[e, f] W_Q^k[e, a], then
    P[g, a] = sum_k sum_f W_O^k[g, f] X_k[f, a], each sum in that order. Unrolled into scalar
    expressions, structurally zero terms left out, when that writes at most UNROLL_FOLD
    multiplications (a sparse pattern's fold: a fixed cost per prompt and layer); small loops
    otherwise (zero terms are then multiplied): a long unrolled fold costs more compile time
    than it saves (a dense d_model 4 / 2-head kernel compiled in 28 s with it, 14 s without).
    The two forms round identically."""
    L = [f"def {name}(Sm, WQ, WO, Pm, Xm, l):", "    F = Pm.dtype.type", "    zero = F(0.0)"]
    S, X = s["s"], s["x"]
    unrolled = [f"x_{k}_{f}_{a} = " + " + ".join(f"Sm[{k}, {e}, {f}] * WQ[l, {k}, {e}, {a}]" for e in range(d)
                                                 if S[k][e][f] and wq[k][e][a])
                for k in range(H) for f in range(d) for a in range(d) if X[k][f][a]]
    unrolled += [f"Pm[l, {g}, {a}] = " + _sum([f"WO[l, {k}, {g}, {f}] * x_{k}_{f}_{a}" for k in range(H)
                                               for f in range(d) if wo[k][g][f] and X[k][f][a]])
                 for g in range(d) for a in range(d)]
    if products("\n".join(unrolled)) <= UNROLL_FOLD:
        return L + _ind(unrolled, 1)
    return L + _ind([f"for k in range({H}):",
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
                     "        Pm[l, g, a] = x"], 1)


def _ids(items: list) -> tuple[list[int], list]:
    """Per layer the index of its item among the distinct ones (layers alike share one function)."""
    distinct: list = []
    for it in items:
        if it not in distinct:
            distinct.append(it)
    return [distinct.index(it) for it in items], distinct


def _dispatch(table: str, ids: list[int], call: str, index: str) -> list[str]:
    """Call `call.format(j)` for the function of layer `index`: direct when all layers share it."""
    if len(set(ids)) == 1:
        return [call.format(ids[0])]
    out = []
    for j in sorted(set(ids)):
        out += [f"{'if' if not out else 'elif'} {table}[{index}] == {j}:", "    " + call.format(j)]
    return out


def source(din: int, d: int, H: int, ln: bool, pattern: Pattern | None = None) -> str:
    """Python source of the kernel for one (d_in, d_model, heads, LayerNorm) and zero pattern
    (None: dense, any number of layers; a `uniform` pattern: any number of layers alike; else
    the pattern's layers):

    kernel(tok, We, Wkv, WQ, WO, gain, bias, rw, eps, M, N, L, flatten, out, ext, b0, b1): the
        whole forward of prompts b0 <= b < b1 into out[b], and the extremes of their context's
        x and y (token slots 0 and 1, read by the embedding loop; icl_bench/solvers/fused_extremes.py)
        into ext[b] = (x_min, x_max, y_min, y_max), ext (B, 4); tok is (B, T * d_in), token i of
        prompt b at tok[b, d_in*i : d_in*(i+1)] (2-D, so the compiler sees the unit stride).

    The scratch scr (d * (Mp + LANES),) holds the stream blocked: token i's slot c at
    (i // LANES) * LANES * d + c * LANES + i % LANES, so a loop over a block's LANES tokens reads
    and writes every slot with unit stride (whole vectors: no gathers, scatters or shuffles).
    Key slots [0, M), zero slots up to Mp (whole blocks; zero keys and values add exactly 0), and
    the query in slot Mp when it is not a key (keys "masked"). Each layer is one pass over the
    key blocks: the previous layer's block fused with this layer's key-value products (ekeys: the
    embedding and layer 0's products; in loops of their own above FUSE_MAX); the block holding
    pads runs with a lane mask (pads read and store 0), in loops of its own when
    H d^2 <= SPLIT_MAX (its embedding then reads a copy of its tokens padded with zeros, `tt`, so
    that no load is conditional and the loop vectorises), else the masked loops serve every
    block. Helpers, one per distinct layer pattern: sums_j (lanes -> S), fold_j (S -> P),
    block_j / block_j1 (whole blocks / one token), bkeys_n[_m] (pair n of consecutive layers:
    block of layer l - 1 then keys of layer l), embed1 (one token), extremes (lanes -> ext[b]);
    for sparse patterns nonfinite and zsum (0 for finite values, NaN otherwise).
    """
    p = pattern or dense(din, d, H)
    layers = [layer_structure(p, l) for l in range(p.layers)]
    kid, kd = _ids([(x["kin"], x["vin"], x["s"]) for x in layers])
    fid, fdist = _ids([(x["s"], x["x"], p.wq[l], p.wo[l]) for l, x in enumerate(layers)])
    bid, bdist = _ids([(x["P"], p.gain[l], p.bias[l]) for l, x in enumerate(layers)])
    pid, pairs = _ids([(bid[l - 1], kid[l]) for l in range(1, p.layers)] or [(0, 0)])
    keys = [_Keys({"kin": kin, "vin": vin, "s": s}, d, H) for kin, vin, s in kd]
    blocks = [_Block(P, g, bb, d, ln) for P, g, bb in bdist]
    emb = _Embed(p, din, d)
    bodies = [k.bodies() for k in keys]  # per key pattern, one loop body per pass

    def fused(first: list[str], j: int) -> list[list[str]]:  # `first` in the first pass's loop, if short
        head = (bodies[j][:1] or [[]])[0]
        if products("\n".join(first + head)) <= FUSE_MAX:
            return [first + head] + bodies[j][1:]
        return [first] + bodies[j]

    blk_args = "Pm, gain, bias, lb, eps_in"
    L = []
    split = H * d * d <= SPLIT_MAX  # unmasked loops for the whole blocks, masked for the last one
    variants = ("", "_m") if split else ("_m",)  # (else masked loops throughout: half the code)
    for m in variants:
        L += _function(f"ekeys{m}", "tok, b, We, scr, k0, k1, Wkv, l, acc, M, N, ex", emb.head() + keys[kid[0]].head(),
                       _loops(fused(emb.body(True, masked=bool(m), tail=bool(m) and split), kid[0]), d, "k0", "k1",
                              offset=bool(m) and split))
        for n, (a, b) in enumerate(pairs):
            L += _function(f"bkeys_{n}{m}", f"scr, k0, k1, {blk_args}, Wkv, l, acc, M",
                           blocks[a].head() + keys[b].head(),
                           _loops(fused(blocks[a].body(True, masked=bool(m)), b), d, "k0", "k1",
                                  offset=bool(m) and split))
    L += _function("embed1", "tok, b, We, scr, i, dst", emb.head(), emb.body(False, "dst"))
    L += ["", ""] + extremes_function(LANES)
    for j, k in enumerate(keys):
        L += ["", ""] + k.sums(f"sums_{j}")
    for j, (s, x, wq, wo) in enumerate(fdist):
        L += ["", ""] + _fold(f"fold_{j}", {"s": s, "x": x}, wq, wo, d, H)
    for j, blk in enumerate(blocks):
        L += _function(f"block_{j}", f"scr, k0, k1, {blk_args}", blk.head(), _loops([blk.body(True)], d, "k0", "k1"))
        L += _function(f"block_{j}1", f"scr, i, {blk_args}", blk.head(), blk.body(False))
    if p.sparse:
        L += ["", "", "def nonfinite(a, b):  # 0 when row b of a is finite, else NaN (0 * inf, 0 * NaN)",
              "    z = a.dtype.type(0.0)", "    for i in range(a.shape[1]):", "        z += a[b, i] * a.dtype.type(0.0)",
              "    return z", "", "", "def zsum(a):  # 0 when every entry of the 1-D a is finite, else NaN",
              "    z = a.dtype.type(0.0)", "    for i in range(a.shape[0]):",
              "        z += a[i] * a.dtype.type(0.0)", "    return z"]
    L += ["", "", f"KL = {tuple(kid)}", f"FL = {tuple(fid)}", f"BL = {tuple(bid)}", f"PL = {tuple([-1] + pid)}"]
    rw = [c for c in range(d) if p.rw[c]]
    last = "nL - 1" if pattern is None or pattern.uniform else str(p.layers - 1)
    at = lambda c, i: _at(d, c, False, i)
    chk = lambda line: [line] if p.sparse else []
    prev = "Pm, gain, bias, l - 1, eps"
    L += ["", "", "def kernel(tok, We, Wkv, WQ, WO, gain, bias, rw, eps, M, N, nL, flatten, out, ext, b0, b1):",
          "    F = out.dtype.type",
          "    T = N + 1",
          f"    Mp = -(-M // {LANES}) * {LANES}",
          f"    nb = Mp // {LANES}  # blocks holding key slots",
          f"    nk = M // {LANES}  # blocks holding only keys",
          f"    ne = N // {LANES}  # blocks holding only context tokens (the query is a key when M = T)",
          "    q = T - 1 if M == T else Mp  # the query token's slot",
          f"    scr = np.zeros({d} * (Mp + {LANES}), dtype=out.dtype)",
          f"    Pm = np.empty((nL, {d}, {d}), dtype=out.dtype)",
          f"    Sf = np.empty({H * d * d}, dtype=out.dtype)  # S of every head, flat for zsum",
          f"    Sm = Sf.reshape(({H}, {d}, {d}))  # the same memory, (head, e, f)",
          f"    Xm = np.empty(({H}, {d}, {d}), dtype=out.dtype)",
          f"    acc = np.zeros({H * d * d * LANES}, dtype=out.dtype)  # the lane sums (sums_j resets them)"]
    if split:
        L += [f"    tt = np.zeros((1, {LANES * din}), dtype=out.dtype)  # a copy of the block of tokens that holds pads"]
    L += _ind(lanes_setup(LANES), 1) + ["    for b in range(b0, b1):"]
    body = chk("chk = nonfinite(tok, b)")
    ranges = {"": "0, nk", "_m": "nk, nb" if split else "0, nb"}  # blocks of each variant
    if split:  # the block of context tokens that holds the query or pads, as a copy padded with zeros
        body += ["ekeys(tok, b, We, scr, 0, ne, Wkv, 0, acc, M, N, ex)",
                 "if nb > ne:  # (the pads of tt stay 0: every prompt writes the same tokens)",
                 f"    for i in range(ne * {LANES * din}, M * {din}):",
                 f"        tt[0, i - ne * {LANES * din}] = tok[b, i]",
                 "    ekeys_m(tt, 0, We, scr, ne, nb, Wkv, 0, acc, M, N, ex)"]
    else:
        body += ["ekeys_m(tok, b, We, scr, 0, nb, Wkv, 0, acc, M, N, ex)"]
    body += [  # layer 0
             "extremes(ex, ext, b)"] + [
             "if M < T:  # the query, when it is not a key",
             "    embed1(tok, b, We, scr, T - 1, q)",
             f"sums_{kid[0]}(acc, Sm, M)"] + chk("chk += zsum(Sf)") + [
             f"fold_{fid[0]}(Sm, WQ, WO, Pm, Xm, 0)",
             "for l in range(1, nL):  # block of layer l - 1 and key-value products of layer l, one pass"]
    for m in variants:
        body += _ind(_dispatch("PL", pid, "bkeys_{}" + m + f"(scr, {ranges[m]}, " + prev + ", Wkv, l, acc, M)", "l"), 1)
    body += _ind(["if M < T:"], 1) + _ind(_dispatch("BL", bid, "block_{}1(scr, q, " + prev + ")", "l - 1"), 2)
    body += _ind(_dispatch("KL", kid, "sums_{}(acc, Sm, M)", "l") + chk("chk += zsum(Sf)")
                 + _dispatch("FL", fid, "fold_{}(Sm, WQ, WO, Pm, Xm, l)", "l"), 1)
    fin = "Pm, gain, bias, nL - 1, eps)"
    body += _dispatch("BL", bid, "block_{}1(scr, q, " + fin, last)
    body += ["y = " + _sum([f"rw[N if flatten else 0, {c}] * scr[{at(c, 'q')}]" for c in rw], "F(0.0)"),
             "if flatten:  # every context token through the last block (whole blocks, then one by one)"]
    body += _ind(_dispatch("BL", bid, f"block_{{}}(scr, 0, N // {LANES}, " + fin, last), 1)
    body += _ind([f"for i in range(N // {LANES} * {LANES}, N):"], 1)
    body += _ind(_dispatch("BL", bid, "block_{}1(scr, i, " + fin, last), 2)
    body += _ind(["for i in range(N):", "    y += " + _sum([f"rw[i, {c}] * scr[{at(c, 'i')}]" for c in rw], "F(0.0)")], 1)
    body += ["if chk != F(0.0):  # a non-finite token or key-value sum: NaN, as 0 * inf gives", "    y = F(np.nan)"] if p.sparse else []
    L += _ind(body + ["out[b] = y"], 2)
    return "\n".join(L) + "\n"


def products(text: str) -> int:
    """Multiplications written in a generated source: its size, which sets how long numba takes
    to compile it (icl_bench.solvers.fused.MAX_PRODUCTS bounds it)."""
    return text.count(" * ")


def functions(text: str) -> list[str]:
    """Names of the generated functions in `text` (def lines), for compiling each."""
    return [line[4:line.index("(")] for line in text.splitlines() if line.startswith("def ")]


__all__ = ["ACC_PER_PASS", "FUSE_MAX", "LANES", "UNROLL_FOLD", "Pattern", "functions", "products", "source"]
