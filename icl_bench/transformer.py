"""The transformer every transformer solver shares (ln-closed-form, gd-lsa, the trained models).

Architecture (shared DESIGN.md section 4; the reference paper's model, after von Oswald et al.
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
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

KEY_SETS = ("masked", "query-in-context")
READOUTS = ("flatten", "query")


@dataclass(frozen=True)
class TransformerConfig:
    d_in: int = 3  # token width: (x, y, R)
    d_model: int = 4  # residual stream width
    n_layers: int = 2  # number of blocks L
    n_heads: int = 2  # heads per block
    layernorm: bool = True  # LN after attention in every block (False: plain LSA, as gd-lsa)
    keys: str = "masked"  # one of KEY_SETS
    readout: str = "query"  # one of READOUTS
    N: int | None = None  # context length; required by readout="flatten"
    ln_eps: float = 1e-5  # LayerNorm epsilon (added to the variance)

    def __post_init__(self):
        if self.keys not in KEY_SETS:
            raise ValueError(f"keys: unknown key set {self.keys!r}; accepted: {', '.join(KEY_SETS)}")
        if self.readout not in READOUTS:
            raise ValueError(f"readout: unknown readout {self.readout!r}; accepted: {', '.join(READOUTS)}")
        if self.readout == "flatten" and (self.N is None or self.N < 2):
            raise ValueError("N: readout='flatten' needs the context length N >= 2")
        for k in ("d_in", "d_model", "n_layers", "n_heads"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k}: must be >= 1 (got {getattr(self, k)})")

    def to_dict(self) -> dict:
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

    def forward(self, h: torch.Tensor, quadratic: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h (B, T, d) -> (new residual, attention output, LN output), each (B, T, d)."""
        a = self.attn.forward_quadratic(h) if quadratic else self.attn(h)
        n = self.ln(a) if self.ln is not None else a
        return h + n, a, n


class Transformer(nn.Module):
    """Embedding -> L blocks -> readout. See the module docstring.

    forward(tokens (B, N+1, d_in)) -> predictions (B,) in the module's dtype.
    """

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Linear(cfg.d_in, cfg.d_model, bias=False)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        width = cfg.d_model * (cfg.N + 1) if cfg.readout == "flatten" else cfg.d_model
        self.readout = nn.Linear(width, 1, bias=False)

    def _run(self, tokens: torch.Tensor, quadratic: bool, keep: bool):
        if self.cfg.readout == "flatten" and tokens.shape[1] != self.cfg.N + 1:
            raise ValueError(f"N: this model's flatten readout needs N={self.cfg.N}, got prompts with N={tokens.shape[1] - 1}")
        h = self.embed(tokens)  # (B, T, d)
        trace = {"embed": h} if keep else None
        for i, block in enumerate(self.blocks):
            h, a, n = block(h, quadratic)
            if keep:
                trace.update({f"layer{i}.attn": a, f"layer{i}.ln": n, f"layer{i}.resid": h})
        feats = h.flatten(1) if self.cfg.readout == "flatten" else h[:, -1]  # (B, T*d) or (B, d)
        return self.readout(feats).squeeze(-1), trace  # (B,)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._run(tokens, quadratic=False, keep=False)[0]

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
