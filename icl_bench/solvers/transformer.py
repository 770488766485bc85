"""The transformer every transformer solver shares (ln-closed-form, gd-lsa, the trained models).

Architecture (docs/design.md §4; the reference paper's model, after von Oswald et al.
2023 for the linear self-attention):

    tokens (B, T=N+1, 3) --embed--> h (B, T, d_model)
    L blocks:  h <- h + LN(MHA(h))        (LayerNorm optional: gd-lsa runs without it)
    readout:   "flatten" -> Linear(T*d_model, 1) on the whole stream (the paper's; fixes N)
               "query"   -> Linear(d_model, 1) on the query token only (N-free)

Multi-head *linear* self-attention, head k, token i, key set J of size M:

    A_k(h)_i = (1/M) sum_{j in J} (W_Q^k h_i . W_K^k h_j) W_O^k W_V^k h_j

computed associatively: S_k = (1/M) sum_j (W_K^k h_j)(W_V^k h_j)^T, a (d x d) matrix per prompt,
then A_k(h)_i = W_O^k S_k^T W_Q^k h_i. Cost O(T * heads * d^2) per prompt, never (T x T).
Key sets: "masked" = the N context tokens (M = N); "query-in-context" = all N+1 tokens.

Two equal implementations of the associative form: `_run` / `probe` (token-major (B, T, d),
nn.LayerNorm; the readable reference) and `forward` (the fast path: channels-first (B, d, T) so
every op runs along the tokens, each layer's heads folded into two small matrices per call, the
last block computed for the query token only, CPU prompts in cache-sized chunks; same per-token
keys, values and LayerNorm centring, so the same kind of float rounding). forward_quadratic is
the O(N^2) score-matrix reference.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass

import torch
from torch import nn

from icl_bench.solvers.fused import fused_forward

KEY_SETS = ("masked", "query-in-context")
READOUTS = ("flatten", "query")
MAX_SIZE = 4096  # d_in, d_model, n_layers, n_heads (gd-lsa's K layers reach 4096)
MAX_ATTENTION_WEIGHTS = 2**30  # 4 n_layers n_heads d_model^2 (training caps it far lower: training/config.py)
LN_SUMS = ("torch", "slots")  # order of LayerNorm's mean over the d_model slots in `forward` (see Block)


@dataclass(frozen=True)
class TransformerConfig:
    """Shape and options of a `Transformer` (docs/design.md §4); frozen, so it can key caches.

    Raises ValueError (one line naming the field and the accepted values) for an unknown `keys`,
    `readout` or `ln_sum`, a size (or N) that is not an int, a `layernorm` that is not a bool, a size below 1 or above MAX_SIZE, more than MAX_ATTENTION_WEIGHTS attention weights, a "flatten" readout without N >= 2, or an `ln_eps`
    that is not a finite number >= 0.
    """

    d_in: int = 3  # token width: (x, y, R)
    d_model: int = 4  # residual stream width
    n_layers: int = 2  # number of blocks L
    n_heads: int = 2  # heads per block
    layernorm: bool = True  # LN after attention in every block (False: plain LSA, as gd-lsa)
    keys: str = "masked"  # one of KEY_SETS
    readout: str = "query"  # one of READOUTS
    N: int | None = None  # context length; required by readout="flatten"
    ln_eps: float = 1e-5  # LayerNorm epsilon (added to the variance)
    ln_sum: str = "torch"  # one of LN_SUMS: "slots" sums LN's mean slot 0, 1, 2, ... in order (forward only)

    def __post_init__(self):
        if self.keys not in KEY_SETS:
            raise ValueError(f"keys: unknown key set {self.keys!r}; accepted: {', '.join(KEY_SETS)}")
        if self.readout not in READOUTS:
            raise ValueError(f"readout: unknown readout {self.readout!r}; accepted: {', '.join(READOUTS)}")
        if self.ln_sum not in LN_SUMS:
            raise ValueError(f"ln_sum: unknown order {self.ln_sum!r}; accepted: {', '.join(LN_SUMS)}")
        for k in ("d_in", "d_model", "n_layers", "n_heads", "N"):  # (a checkpoint's JSON: 4.0 or true was a
            v = getattr(self, k)  # TypeError deep in torch, "yes" a LayerNorm; found by a review)
            if (v is not None or k != "N") and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
                raise ValueError(f"{k}: must be an integer (got {v!r})")
        if not isinstance(self.layernorm, bool):
            raise ValueError(f"layernorm: must be true or false (got {self.layernorm!r})")
        if self.readout == "flatten" and (self.N is None or self.N < 2):
            raise ValueError("N: readout='flatten' needs the context length N >= 2")
        for k in ("d_in", "d_model", "n_layers", "n_heads"):
            if not 1 <= getattr(self, k) <= MAX_SIZE:  # (a checkpoint JSON's n_layers = 10**9 hung in torch)
                raise ValueError(f"{k}: must be >= 1 and <= {MAX_SIZE} (got {getattr(self, k)})")
        if 4 * self.n_layers * self.n_heads * self.d_model ** 2 > MAX_ATTENTION_WEIGHTS:
            raise ValueError(f"d_model: 4 * n_layers * n_heads * d_model^2 = "
                             f"{4 * self.n_layers * self.n_heads * self.d_model ** 2} attention weights exceed "
                             f"{MAX_ATTENTION_WEIGHTS}")
        eps = self.ln_eps
        ok = isinstance(eps, (int, float)) and not isinstance(eps, bool)
        try:
            ok = ok and math.isfinite(float(eps)) and eps >= 0
        except OverflowError:  # an int beyond float range
            ok = False
        if not ok:
            raise ValueError(f"ln_eps: must be a finite number >= 0 (got {eps!r})")

    def check_prompts(self, T: int) -> None:
        """Raise ValueError (one line) when prompts of T = N + 1 tokens do not fit this model: a
        "flatten" readout has one row of weights per token of its own N."""
        if self.readout == "flatten" and T != self.N + 1:
            raise ValueError(f"N: this model's flatten readout needs N={self.N}, got prompts with N={T - 1}")

    def to_dict(self) -> dict:
        """The fields by name (plain Python values), as checkpoint metadata stores them."""
        return asdict(self)


class LinearSelfAttention(nn.Module):
    """Multi-head linear self-attention (no softmax), computed associatively.

    Weights: W_Q, W_K, W_V, W_O each (heads, d_model, d_model); head k maps h -> W @ h.
    """

    def __init__(self, d_model: int, n_heads: int, keys: str):
        super().__init__()
        self.keys = keys
        shape = (n_heads, d_model, d_model)
        self.W_Q = nn.Parameter(torch.zeros(shape))
        self.W_K = nn.Parameter(torch.zeros(shape))
        self.W_V = nn.Parameter(torch.zeros(shape))
        self.W_O = nn.Parameter(torch.zeros(shape))

    def key_tokens(self, h: torch.Tensor) -> torch.Tensor:
        """The tokens attended to: (B, M, d) with M = N (masked) or N+1."""
        return h[:, :-1] if self.keys == "masked" else h

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h (B, T, d) -> attention output (B, T, d), O(T * heads * d^2)."""
        hk = self.key_tokens(h)  # (B, M, d)
        k = torch.einsum("bmd,hed->bmhe", hk, self.W_K)  # (B, M, H, d)
        v = torch.einsum("bmd,hed->bmhe", hk, self.W_V)  # (B, M, H, d)
        S = torch.einsum("bmhe,bmhf->bhef", k, v) / hk.shape[1]  # (B, H, d, d): mean_j k_j v_j^T
        q = torch.einsum("btd,hed->bthe", h, self.W_Q)  # (B, T, H, d)
        z = torch.einsum("bthe,bhef->bthf", q, S)  # (B, T, H, d): sum_j (q.k_j) W_V h_j / M
        return torch.einsum("bthf,hgf->btg", z, self.W_O)  # (B, T, d): sum over heads of W_O z

    def folded_map(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights of `forward_channels`, built once per forward call.

        Returns (W_kv, K): W_kv (2*H*d, d) stacks every head's W_K, then every head's W_V, so
        one product gives all keys and values; K (d*d, (H*d)^2) maps the keys' and values' mean
        outer product S (H*d x H*d; head k's S_k = (1/M) sum_j k_j v_j^T is its k-th diagonal
        block) to the layer's per-prompt map P = sum_k W_O^k S_k^T W_Q^k, row-major:
        P_ga = sum_{k,e,f} W_O[k,g,f] W_Q[k,e,a] S[(k,e),(k,f)]; the other blocks get weight 0.
        """
        H, d, _ = self.W_O.shape
        W_kv = torch.cat([self.W_K.reshape(H * d, d), self.W_V.reshape(H * d, d)])  # (2Hd, d)
        per_head = torch.einsum("hgf,hea->gahef", self.W_O, self.W_Q)  # (d, d, H, d, d)
        eye = torch.eye(H, dtype=per_head.dtype, device=per_head.device)
        K = torch.einsum("gahef,hk->gahekf", per_head, eye)  # (d, d, H, d, H, d): zero off the diagonal
        return W_kv, K.reshape(d * d, (H * d) ** 2)

    def forward_channels(self, hT: torch.Tensor, maps: tuple, query_only: bool = False) -> torch.Tensor:
        """`forward` on a channels-first stream hT (B, d, T) -> (B, d, T), maps = folded_map().

        The same order as `forward` (per-token keys and values, their mean outer product S_k,
        docs/design.md §4), so the float rounding is of the same kind; each op runs along the
        tokens. query_only=True returns the last token's output only (B, d, 1).
        """
        W_kv, K = maps
        b, d, _ = hT.shape
        Hd = W_kv.shape[0] // 2
        hk = hT[:, :, :-1] if self.keys == "masked" else hT  # (B, d, M): the key tokens, a view
        kv = torch.bmm(W_kv.expand(b, -1, -1).contiguous(), hk)  # (B, 2Hd, M): keys, then values
        S = torch.bmm(kv[:, :Hd], kv[:, Hd:].transpose(1, 2)) / kv.shape[2]  # (B, Hd, Hd)
        P = (S.view(b, Hd * Hd) @ K.T).view(b, d, d)  # (B, d, d)
        h = hT[:, :, -1:] if query_only else hT  # (B, d, T')
        return torch.bmm(P, h)

    def forward_quadratic(self, h: torch.Tensor) -> torch.Tensor:
        """The same map through the explicit (T x M) score matrix, O(T * M * d): a reference."""
        hk = self.key_tokens(h)  # (B, M, d)
        q = torch.einsum("btd,hed->bhte", h, self.W_Q)  # (B, H, T, d)
        k = torch.einsum("bmd,hed->bhme", hk, self.W_K)  # (B, H, M, d)
        v = torch.einsum("bmd,hed->bhme", hk, self.W_V)  # (B, H, M, d)
        scores = q @ k.transpose(-1, -2) / hk.shape[1]  # (B, H, T, M)
        z = scores @ v  # (B, H, T, d)
        return torch.einsum("bhtf,hgf->btg", z, self.W_O)


class Block(nn.Module):
    """h <- h + LN(MHA(h)); LN is the identity when layernorm=False."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.attn = LinearSelfAttention(cfg.d_model, cfg.n_heads, cfg.keys)
        self.ln = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps) if cfg.layernorm else None
        self.ln_sum = cfg.ln_sum

    def forward(self, h: torch.Tensor, quadratic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h (B, T, d) -> (new residual, attention output, LN output), each (B, T, d)."""
        a = self.attn.forward_quadratic(h) if quadratic else self.attn(h)
        n = self.ln(a) if self.ln is not None else a
        return h + n, a, n

    def forward_channels(self, hT: torch.Tensor, maps: tuple, query_only: bool = False) -> torch.Tensor:
        """`forward` on a channels-first stream hT (B, d, T) -> (B, d, T) (B, d, 1 if query_only).

        maps = self.attn.folded_map(). LayerNorm is written out over d: mean and variance of the
        attention output a per token, then (gain * (a - mean)) / sqrt(var + eps) + bias, so
        the centring is done on the data as nn.LayerNorm does it (its float rounding is part of
        the mechanism, docs/design.md §5). With d as the inner axis every op would run 4 numbers
        at a time; here they run along the tokens. ln_sum="slots" forms the mean's sum in slot
        order ((a_0 + a_1) + a_2) + ..., so a pair +-B placed in slots 0 and 1 cancels exactly; torch's
        own reduction order varies with d and with the token count (docs/ln-closed-form-multivariate.md).
        """
        h = hT[:, :, -1:] if query_only else hT  # (B, d, T')
        a = self.attn.forward_channels(hT, maps, query_only)  # (B, d, T')
        if self.ln is None:
            return h + a
        d = a.shape[1]
        if self.ln_sum == "slots":
            total = a[:, 0:1] + a[:, 1:2] if d > 1 else a[:, 0:1].clone()  # (B, 1, T')
            for j in range(2, d):
                total = total + a[:, j:j + 1]
        else:
            total = a.sum(dim=1, keepdim=True)  # (B, 1, T')
        c = a - total / d  # (B, d, T'): centred over d
        var = c.square().sum(dim=1, keepdim=True) / d  # (B, 1, T')
        # 1 / LN std; + var * 0 is exactly 0, but NaN where the variance overflowed to inf: its 1 / std of 0
        # turned every slot into the bias alone, a finite wrong answer (ln-closed-form at R >= 2e19 in float32)
        inv = torch.rsqrt(var + self.ln.eps) + var * 0  # (B, 1, T')
        gc = c if self.ln.weight is None else c * self.ln.weight[:, None]  # gain * centred
        base = h if self.ln.bias is None else h + self.ln.bias[:, None]
        return torch.addcmul(base, gc, inv)  # h + gain * (a - mean) / std + bias


class Transformer(nn.Module):
    """Embedding -> L blocks -> readout. See the module docstring.

    forward(tokens (B, N+1, d_in)) -> predictions (B,) in the module's dtype.
    """

    CHUNK_TOKENS = 65536  # CPU forward: prompts per chunk = this // (N+1), at least 1 (cache-sized)
    MAPS_AT_ONCE = 2**25  # folded-map values held at once (256 MiB in float64); beyond, layer by layer

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Linear(cfg.d_in, cfg.d_model, bias=False)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        width = cfg.d_model * (cfg.N + 1) if cfg.readout == "flatten" else cfg.d_model
        self.readout = nn.Linear(width, 1, bias=False)

    def _run(self, tokens: torch.Tensor, quadratic: bool, keep: bool):
        self.cfg.check_prompts(tokens.shape[1])
        h = self.embed(tokens)  # (B, T, d)
        trace = {"embed": h} if keep else None
        for i, block in enumerate(self.blocks):
            h, a, n = block(h, quadratic)
            if keep:
                trace.update({f"layer{i}.attn": a, f"layer{i}.ln": n, f"layer{i}.resid": h})
        feats = h.flatten(1) if self.cfg.readout == "flatten" else h[:, -1]  # (B, T*d) or (B, d)
        return self.readout(feats).squeeze(-1), trace  # (B,)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, N+1, d_in) -> (B,); the same function as `_run` (tests: 1e-12 in float64).

        On CPU tensors without gradients it runs the fused numba kernel of icl_bench/solvers/fused.py
        (the same per-token computation, docs/throughput.md); otherwise `forward_eager`. That
        kernel keeps the weights it read until a parameter changes (its storage or version counter):
        after writes through `parameter.data`, call `icl_bench.solvers.fused.forget(self)`.
        Fast path: the stream runs channels-first (B, d, T) so every op is vectorised along
        the tokens; each block's weights are folded into one small matrix once per call; with the
        "query" readout the last block computes the query token only; on the CPU the prompts go
        through in chunks of about CHUNK_TOKENS tokens so the stream stays in cache. O(B*N*d^2).
        """
        return self.forward_extremes(tokens)[0]

    def forward_extremes(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, and where the fused kernel ran, each prompt's (x_min, x_max, y_min, y_max)
        (B, 4) over its context tokens' slots 0 and 1, read by the kernel on its way (see
        fused_forward's `extremes`; what icl_bench.solvers.base.screens needs); else None."""
        self.cfg.check_prompts(tokens.shape[1])
        wanted = tokens.device.type == "cpu" and self.cfg.d_in >= 2  # x and y slots to read
        ext = torch.empty(tokens.shape[0], 4, dtype=tokens.dtype) if wanted else None  # (B, 4)
        out = fused_forward(self, tokens, extremes=ext)  # (B,): CPU, no gradient, the fused kernel
        if out is None:  # the fused path does not apply (CUDA, gradients, numba missing)
            return self.forward_eager(tokens), None
        return out, ext

    def forward_eager(self, tokens: torch.Tensor) -> torch.Tensor:
        """`forward` in torch ops (any device, differentiable): the channels-first fast path below.
        Chunk by chunk, every layer's folded map held at once; where those maps would exceed
        MAPS_AT_ONCE values (they grow as layers * H^2 d^4: the d = 64 ln-closed-form's 65 layers took
        42 GB), layer by layer over the chunks instead, one map at a time: the same arithmetic."""
        B, T = tokens.shape[:2]
        step = max(1, self.CHUNK_TOKENS // T) if tokens.device.type == "cpu" else max(B, 1)
        chunks = [tokens[i:i + step] for i in range(0, B, step)] or [tokens]  # B = 0: once, for shape and dtype
        H, d, L = self.cfg.n_heads, self.cfg.d_model, len(self.blocks)
        query_only = [i == L - 1 and self.cfg.readout == "query" for i in range(L)]  # the last block: the query alone
        if L * d * d * (H * d) ** 2 <= self.MAPS_AT_ONCE:
            maps = [block.attn.folded_map() for block in self.blocks]
            hs = []
            for c in chunks:  # chunk-major: each chunk's stream stays in cache through the layers
                hT = self._embed(c)
                for i, (block, K) in enumerate(zip(self.blocks, maps)):
                    hT = block.forward_channels(hT, K, query_only=query_only[i])
                hs.append(hT)
        else:
            hs = [self._embed(c) for c in chunks]
            for i, block in enumerate(self.blocks):
                K = block.attn.folded_map()
                hs = [block.forward_channels(h, K, query_only=query_only[i]) for h in hs]
                del K
        outs = [self._readout(h) for h in hs]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (b, T, d_in) -> the channels-first stream (b, d, T)."""
        W = self.embed.weight  # (d, d_in)
        return torch.bmm(W.expand(tokens.shape[0], -1, -1).contiguous(), tokens.transpose(1, 2))

    def _readout(self, hT: torch.Tensor) -> torch.Tensor:
        """The last stream (b, d, T) or its query token (b, d, 1) -> predictions (b,)."""
        feats = hT.transpose(1, 2).flatten(1) if self.cfg.readout == "flatten" else hT[:, :, -1]
        return self.readout(feats).squeeze(-1)  # (b,)

    def forward_quadratic(self, tokens: torch.Tensor) -> torch.Tensor:
        """The same model with quadratic (score-matrix) attention: the O(N^2) reference."""
        return self._run(tokens, quadratic=True, keep=False)[0]

    @torch.no_grad()
    def probe(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """Intermediates by name, each (B, N+1, d_model): "embed", and per block i
        "layer{i}.attn" (attention output), "layer{i}.ln" (LayerNorm output, = attn without LN)
        and "layer{i}.resid" (residual stream after the block)."""
        return self._run(tokens, quadratic=False, keep=True)[1]

    def weight_matrices(self) -> dict[str, torch.Tensor]:
        """Every parameter by its dotted name (matrices and LayerNorm gains / biases)."""
        return {k: v.detach() for k, v in self.named_parameters()}
