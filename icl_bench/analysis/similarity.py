"""Weight-space similarity to the construction, invariant to the transformer's exact symmetries.

A model (docs/design.md §4 and §7) computes, per layer, with M_k = W_Q^kT W_K^k and
P_k = W_O^k W_V^k (both (d, d)), C = I - 11^T/d, G = diag(gamma):

    a_i = (1/M) sum_j sum_k (h_i^T M_k h_j) P_k h_j        (the LN input, a trilinear map of h)
    h_i <- h_i + G (C a_i) / std(C a_i) + beta             (without LayerNorm: h_i <- h_i + a_i)

Its function is unchanged by (docs/design.md §7): (c M_k, P_k / c) per head; permuting heads;
P_k -> P_k + 1 v^T (LN subtracts the mean); a positive scale of a layer's LN input; a sign flip
of the LN input together with gamma -> -gamma; and a residual-stream generalized permutation
h' = A h, A[i, sigma(i)] = delta_i (any signs and scales), which maps W_e -> A W_e,
M_k -> A^-T M_k A^-1, P_k -> Pi P_k A^-1 (the LN input is permuted by A's permutation Pi, so that
gamma -> A gamma stays elementwise), beta -> A beta, readout -> readout A^-1.
Note: P_k -> P_k A^-1 (without the permutation of the LayerNorm input) preserves predictions only when Pi = I.

Canonical form of one layer, invariant to all but A (tensors indexed [g, e, f, c], g = LN input):
    T[g,e,f,c] = sym_{f<->c} sum_k M_k[e,f] (C P_k)[g,c]     sum over heads: head order, (c, 1/c)
                                                              and mean shifts drop out; f<->c because
                                                              key and value read the same token
    T_hat = T / ||T||_F                                       positive LN-input scale drops out
    out   = [G T_hat (d, d^3) | beta (d, 1)]                  what reaches the residual; a sign
                                                              flip of the LN input drops out
    gram  = T_hat^T T_hat (d^3, d^3)                          what LN divides by (its std), including
                                                              LN-input slots with gamma = 0
Both are also invariant to an orthogonal map U (U 1 = +-1) of the LN input with G -> G U^T, which a
diagonal G allows among LN-input slots whose gain is 0 (e.g. swapping two of them).
A layer without LayerNorm is put in the same form with G = I, C = I, beta = 0 (it is then
compared with the construction's LN layers as it is: expect a low score).
Model components: embed (A W_e), per layer out and gram, readout; each compared with the
construction's by cosine similarity; the score is their mean, clipped to [0, 1], maximised over
the alignment A: all d! permutations x 2^d signs enumerated, the d positive scales optimised
(torch Adam on the log-scales of every candidate at once, then scipy L-BFGS-B on the best few).
"""
from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass

import numpy as np
import scipy.optimize
import torch

from icl_bench.errors import ConfigError
from icl_bench.files import dumps
from icl_bench.solvers.transformer import Transformer

LOG_SCALE_BOUND = math.log(1e6)  # |log scale| of each residual slot in the polished alignment


@dataclass
class Parts:
    """A transformer as the tensors its function depends on (float64, CPU).

    embed (d, d_in); per layer M, P (H, d, d), gamma and beta (d,) (ones / zeros without LN)
    and ln (bool); readout (T_r, d): T_r = 1 (query readout) or N+1 (flatten, one row per token).
    """

    embed: torch.Tensor
    M: list[torch.Tensor]
    P: list[torch.Tensor]
    gamma: list[torch.Tensor]
    beta: list[torch.Tensor]
    ln: list[bool]
    readout: torch.Tensor


def model_parts(model: Transformer) -> Parts:
    """Read (M_k, P_k, gamma, beta, embedding, readout) off a Transformer, in float64."""
    f = lambda t: t.detach().to("cpu", torch.float64)  # noqa: E731
    d = model.cfg.d_model
    Ms, Ps, gs, bs, lns = [], [], [], [], []
    for blk in model.blocks:
        a = blk.attn
        Ms.append(f(a.W_Q).transpose(1, 2) @ f(a.W_K))  # (H, d, d): W_Q^T W_K
        Ps.append(f(a.W_O) @ f(a.W_V))  # (H, d, d): W_O W_V
        lns.append(blk.ln is not None)
        gs.append(f(blk.ln.weight) if blk.ln is not None else torch.ones(d, dtype=torch.float64))
        bs.append(f(blk.ln.bias) if blk.ln is not None else torch.zeros(d, dtype=torch.float64))
    return Parts(f(model.embed.weight), Ms, Ps, gs, bs, lns, f(model.readout.weight).reshape(-1, d))


def _gather(p: Parts, sigma: torch.Tensor):
    """The model's parts with residual coordinates reordered for K permutations sigma (K, d):
    slot i of the construction reads model coordinate sigma[K, i]. Per layer, the head-summed
    tensor T (K, d_ln, d, d, d) = sym_{f<->c} sum_k M_k[e,f] (C P_k)[g,c] (the LN input index g
    stays in the model's frame), G (K, d, d_ln) with row i = gamma_sigma(i) e_sigma(i), beta (K, d).
    Also embed (K, d, d_in) and readout (K, T_r, d)."""
    emb = p.embed[sigma]  # (K, d, d_in)
    layers = []
    for M, P, g, b, ln in zip(p.M, p.P, p.gamma, p.beta, p.ln):
        if ln:
            P = P - P.mean(dim=1, keepdim=True)  # C P: LN drops the mean of its input
        T = torch.einsum("hef,hgc->gefc", M, P)  # (d_ln, d, d, d): heads summed
        T = 0.5 * (T + T.transpose(-1, -2))  # key and value read the same token: f <-> c
        T = T[:, sigma[:, :, None, None], sigma[:, None, :, None], sigma[:, None, None, :]]  # (d_ln, K, d, d, d)
        layers.append((T.movedim(0, 1), torch.diag_embed(g)[sigma], b[sigma]))
    return emb, layers, p.readout[:, sigma].permute(1, 0, 2)  # readout (K, T_r, d)


def _scale(gathered, delta: torch.Tensor):
    """Finish the alignment h_c[i] = delta[K, i] h_model[sigma[K, i]] (delta (K, d), nonzero):
    T's three residual indices take 1/delta, G's rows, beta and embed's rows delta, the readout's
    columns 1/delta. Shapes as in `_gather`."""
    emb, layers, ro = gathered
    inv = 1.0 / delta  # (K, d)
    inv3 = inv[:, :, None, None] * inv[:, None, :, None] * inv[:, None, None, :]  # (K, d, d, d)
    out = [(T * inv3[:, None], G * delta[..., None], b * delta) for T, G, b in layers]
    return emb * delta[..., None], out, ro * inv[:, None, :]


def _components(emb, layers, ro) -> dict[str, tuple[str, torch.Tensor]]:
    """Canonical components, name -> (kind, (K, ...)): kind "vec" (flattened) or "gram"
    (a (K, d, d^3) matrix X standing for X^T X, compared without forming it)."""
    comps = {"embed": ("vec", emb.flatten(1))}
    for i, (T, G, b) in enumerate(layers):
        T = T.flatten(2)  # (K, d_ln, d^3)
        # A norm that overflows (inf) or underflows (~0) for a nonzero T: divide by the largest entry first
        # (an inf entry gives NaN, the honest answer; weights x 1e60 had read 0.29: a review). The clamp is
        # 1e-150, not 1e-300, whose square underflowed: a zero T (a layer whose weights cancel, most shuffles)
        # made every gradient of the search NaN, and the score 0. Other T take the plain path, bit for bit.
        norm = T.flatten(1).norm(dim=1)  # (K,)
        peak = T.abs().flatten(1).amax(dim=1)  # (K,)
        odd = (~torch.isfinite(norm) | ((norm < 1e-150) & (peak > 0)))[:, None, None]
        T = torch.where(odd, T / peak.clamp_min(1e-300)[:, None, None], T)
        T = T / T.flatten(1).norm(dim=1).clamp_min(1e-150)[:, None, None]
        out = torch.cat([G @ T, b[..., None]], dim=2)  # (K, d, d^3 + 1)
        comps[f"layer{i}.out"] = ("vec", out.flatten(1))
        comps[f"layer{i}.gram"] = ("gram", T)
    comps["readout"] = ("vec", ro.flatten(1))
    return comps


def _cosine(kind: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(K,) cosine of a (K, ...) against b (1, ...); 1 if both are zero, 0 if only one is."""
    if kind == "vec":
        dot, na, nb = (a * b).sum(1), a.norm(dim=1), b.norm(dim=1)
    else:  # <A^T A, B^T B>_F = ||A B^T||_F^2 and ||A^T A||_F = ||A A^T||_F
        dot = (a @ b.transpose(1, 2)).square().sum((1, 2))
        na = torch.linalg.vector_norm(a @ a.transpose(1, 2), dim=(1, 2))  # (not sqrt of a sum of squares,
        nb = torch.linalg.vector_norm(b @ b.transpose(1, 2), dim=(1, 2))  # whose gradient at a zero T is NaN)
    tiny = 1e-150
    cos = dot / (na * nb).clamp_min(tiny)
    both0 = (na < tiny) & (nb < tiny)
    return torch.where(both0, torch.ones_like(cos), cos)


class _Objective:
    """Per-candidate component cosines of the model, aligned by permutations sigma (K, d) (fixed
    at construction), signs (K, d) and log-scales theta (K, d)."""

    def __init__(self, model: Parts, ref: Parts, sigma: torch.Tensor):
        d = ref.embed.shape[0]
        self.ref = _components(*_scale(_gather(ref, torch.arange(d)[None]), torch.ones(1, d, dtype=torch.float64)))
        self.gathered = _gather(model, sigma)  # once: only the scales change while optimising

    def subset(self, idx: torch.Tensor) -> "_Objective":
        """The same objective for candidates idx (K',) only."""
        sub = copy.copy(self)
        emb, layers, ro = self.gathered
        sub.gathered = emb[idx], [tuple(t[idx] for t in lay) for lay in layers], ro[idx]
        return sub

    def __call__(self, signs, theta) -> dict[str, torch.Tensor]:
        """Cosine per component, each (K,)."""
        comps = _components(*_scale(self.gathered, signs * theta.exp()))
        return {n: _cosine(kind, v, self.ref[n][1]) for n, (kind, v) in comps.items()}

    def mean(self, signs, theta) -> torch.Tensor:
        """(K,) mean cosine over the components: the score before clipping."""
        return sum(self(signs, theta).values()) / len(self.ref)


def _adam(obj: _Objective, signs, theta, steps: int, lr: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """`steps` Adam steps maximising every candidate's mean cosine over its log-scales theta
    (K, d) at once (the candidates' objectives are independent, and Adam's update is per
    coordinate, so each candidate moves as if alone). Returns (theta, mean cosine (K,))."""
    theta = theta.clone().requires_grad_()
    opt = torch.optim.Adam([theta], lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        (-obj.mean(signs, theta).sum()).backward()
        opt.step()
    theta = theta.detach().clamp(-LOG_SCALE_BOUND, LOG_SCALE_BOUND)
    with torch.no_grad():
        return theta, obj.mean(signs, theta)


def _polish(obj: _Objective, sign, theta) -> tuple[float, torch.Tensor]:
    """Refine one candidate's log-scales theta (d,) (obj and sign of K = 1) with scipy L-BFGS-B
    within +-LOG_SCALE_BOUND. Returns (mean cosine, theta)."""
    def f(x):
        th = torch.from_numpy(x)[None].requires_grad_()
        val = -obj.mean(sign[None], th).sum()
        val.backward()
        return float(val.detach()), th.grad[0].numpy().copy()

    res = scipy.optimize.minimize(f, theta.numpy(), jac=True, method="L-BFGS-B", options={"maxiter": 200},
                                  bounds=[(-LOG_SCALE_BOUND, LOG_SCALE_BOUND)] * len(theta))
    return -float(res.fun), torch.from_numpy(res.x)


def _check_comparable(model: Parts, ref: Parts) -> None:
    d = ref.embed.shape[0]
    if model.embed.shape != ref.embed.shape or len(model.M) != len(ref.M):
        raise ConfigError(
            f"model: similarity needs d_model={d}, d_in={ref.embed.shape[1]} and {len(ref.M)} layers "
            f"like the construction (got embed {tuple(model.embed.shape)}, {len(model.M)} layers)")
    if model.readout.shape[0] != ref.readout.shape[0]:
        if ref.readout.shape[0] != 1:
            raise ConfigError("model: the reference must use the query readout")
        pad = torch.zeros(model.readout.shape[0] - 1, d, dtype=torch.float64)
        ref.readout = torch.cat([pad, ref.readout], 0)  # flatten readout: query row only


def similarity(model: Transformer, construction: Transformer, *, steps: tuple[int, int] = (25, 60),
               keep: int = 16, polish: int = 3, seed: int = 0) -> tuple[float, dict]:
    """Symmetry-invariant weight-space similarity of `model` to `construction` (module docstring).

    The search: all K = d! 2^d (permutation, signs) candidates get steps[0] Adam steps on their
    log-scales (batched), the best `keep` get steps[1] more, the best `polish` are refined with
    scipy L-BFGS-B, and the best of those is returned. The score is a maximum found by local
    search, so it can only under-state the true maximum.

    Args:
        model: a Transformer with the construction's d_model, d_in and number of layers (any
            heads, LN or not, query or flatten readout).
        construction: the reference, e.g. `build_construction(R)` (query readout).
        steps, keep, polish: the search schedule above.
        seed: seeds the tiny jitter of the starting log-scales.
    Returns:
        (score in [0, 1], or NaN when a weight is NaN or inf, alignment) where alignment = {"sigma": construction slot i <- model
        coordinate sigma[i], "signs", "scales" (geometric mean 1): h_c[i] ~ sign_i scale_i
        h_model[sigma[i]], "components": cosine per component, "score"}.
    Raises:
        ConfigError: shapes that cannot be compared, or d_model > 6 (too many permutations).
    """
    if min(steps) < 0 or keep < 1 or polish < 1:
        raise ConfigError(f"similarity: steps must be >= 0, keep and polish >= 1 (got {steps}, {keep}, {polish})")
    mp, rp = model_parts(model), model_parts(construction)
    _check_comparable(mp, rp)
    d = rp.embed.shape[0]
    if d > 6:
        raise ConfigError(f"d_model: similarity enumerates d! permutations; d_model must be <= 6 (got {d})")
    perms = torch.tensor(list(itertools.permutations(range(d))))  # (d!, d)
    signs = torch.tensor(list(itertools.product([1.0, -1.0], repeat=d)), dtype=torch.float64)  # (2^d, d)
    sigma = perms.repeat_interleave(len(signs), 0)  # (K, d)
    sgn = signs.repeat(len(perms), 1)  # (K, d)
    obj = _Objective(mp, rp, sigma)
    gen = torch.Generator().manual_seed(seed)
    theta = 1e-3 * torch.randn(sigma.shape, generator=gen, dtype=torch.float64)  # (K, d)
    theta, val = _adam(obj, sgn, theta, steps[0])  # every candidate
    top = torch.argsort(val, descending=True)[:keep]  # (keep,)
    theta_top, val = _adam(obj.subset(top), sgn[top], theta[top], steps[1])  # the best `keep`
    best = []
    for j in torch.argsort(val, descending=True)[:polish].tolist():  # the best `polish`, one by one
        k = int(top[j])
        v, th = _polish(obj.subset(torch.tensor([k])), sgn[k], theta_top[j])
        best.append((v, k, th))
    _, k, th = max(best, key=lambda r: r[0])
    th = th - th.mean()  # the global scale is free: report geometric mean 1
    with torch.no_grad():
        cos = {n: float(v[0]) for n, v in obj.subset(torch.tensor([k]))(sgn[k:k + 1], th[None]).items()}
    mean = sum(cos.values()) / len(cos)
    score = min(1.0, max(0.0, mean)) if math.isfinite(mean) else math.nan  # (NaN weights: max() read 0, a
    # score below random weights' 0.35 that looked measured; found by a review)
    return score, {"sigma": sigma[k].tolist(), "signs": [int(v) for v in sgn[k].tolist()],
                   "scales": th.exp().tolist(), "components": cos, "score": score}


def alignment_json(alignment: dict) -> str:
    """The alignment as compact standard JSON text (floats rounded to 6 significant digits; NaN and
    inf as null, the JSON policy of icl_bench/files.py: a bare NaN token, which json.dumps writes,
    failed strict parsers such as JavaScript's JSON.parse)."""
    def r(v):
        return float(f"{v:.6g}") if isinstance(v, float) and math.isfinite(v) else v
    a = {k: ([r(x) for x in v] if isinstance(v, list) else {n: r(c) for n, c in v.items()} if isinstance(v, dict) else r(v))
         for k, v in alignment.items()}
    return dumps(a, sort_keys=True)


@torch.no_grad()
def transform(model: Transformer, *, sigma=None, delta=None, head_perm=None, head_scale=None,
              ln_shift=None, ln_scale=None) -> Transformer:
    """A copy of `model` moved by exact symmetries (for tests and docs); predictions unchanged.

    Args (all optional; per layer lists have one entry per block):
        sigma (d,), delta (d,) nonzero: residual map h'[i] = delta[i] h[sigma[i]] (A = D Pi).
        head_perm: per layer, a permutation of the heads.
        head_scale: per layer, (H,) nonzero c_k: W_Q^k -> c_k W_Q^k, W_O^k -> W_O^k / c_k.
        ln_shift: per layer, (H, d) u_k: W_O^k -> W_O^k + 1 u_k^T (LN layers only).
        ln_scale: per layer, s != 0: W_O -> s W_O, and gamma -> sign(s) gamma (LN layers only).
    Returns:
        a new Transformer (same dtype); the input is not modified.
    """
    m = copy.deepcopy(model)
    d = m.cfg.d_model
    for i, blk in enumerate(m.blocks):
        a, ln = blk.attn, blk.ln
        if head_perm is not None:
            for W in (a.W_Q, a.W_K, a.W_V, a.W_O):
                W.copy_(W[torch.as_tensor(head_perm[i])])
        if head_scale is not None:
            c = torch.as_tensor(head_scale[i], dtype=a.W_Q.dtype)[:, None, None]
            a.W_Q.mul_(c)
            a.W_O.div_(c)
        if ln is not None and ln_shift is not None:
            u = torch.as_tensor(ln_shift[i], dtype=a.W_O.dtype)  # (H, d)
            a.W_O.add_(u[:, None, :].expand(-1, d, -1))
        if ln is not None and ln_scale is not None:
            a.W_O.mul_(float(ln_scale[i]))
            ln.weight.mul_(math.copysign(1.0, float(ln_scale[i])))
    if sigma is not None:
        sg = torch.as_tensor(sigma)
        D = torch.as_tensor(delta, dtype=m.embed.weight.dtype)
        A = torch.zeros(d, d, dtype=D.dtype)
        A[torch.arange(d), sg] = D
        Pi = (A != 0).to(D.dtype)
        B = torch.linalg.inv(A)
        m.embed.weight.copy_(A @ m.embed.weight)
        for blk in m.blocks:
            a = blk.attn
            for W in (a.W_Q, a.W_K, a.W_V):
                W.copy_(W @ B)
            a.W_O.copy_((Pi if blk.ln is not None else A) @ a.W_O)
            if blk.ln is not None:
                blk.ln.weight.copy_(A @ blk.ln.weight)
                blk.ln.bias.copy_(A @ blk.ln.bias)
        r = m.readout.weight.reshape(-1, d) @ B
        m.readout.weight.copy_(r.reshape(1, -1))
    return m


def random_symmetry(model: Transformer, seed: int) -> tuple[Transformer, dict]:
    """`transform` with random arguments: a random generalized permutation (signs, scales in
    [0.2, 5] log-uniform), head permutations, head scales c in +-[0.2, 5], LN-input mean shifts
    and LN-input scales in +-[0.2, 5]. Returns (new model, the arguments drawn)."""
    rng = np.random.default_rng(seed)
    d, L, H = model.cfg.d_model, model.cfg.n_layers, model.cfg.n_heads
    mag = lambda *s: np.exp(rng.uniform(math.log(0.2), math.log(5.0), s))  # noqa: E731
    sgn = lambda *s: rng.choice([-1.0, 1.0], s)  # noqa: E731
    args = {"sigma": rng.permutation(d).tolist(), "delta": (sgn(d) * mag(d)).tolist(),
            "head_perm": [rng.permutation(H).tolist() for _ in range(L)],
            "head_scale": [(sgn(H) * mag(H)).tolist() for _ in range(L)],
            "ln_shift": [rng.normal(size=(H, d)).tolist() for _ in range(L)],
            "ln_scale": [float(sgn() * mag()) for _ in range(L)]}
    return transform(model, **args), args


def shuffle_entries(model: Transformer, seed: int) -> Transformer:
    """A matched null for the similarity of a trained model: a copy with the entries of each
    weight matrix (the embedding, W_Q, W_K, W_V, W_O per layer (H, d, d), the readout) permuted at
    random within that tensor; the LayerNorm gains and biases are kept. Same values, same count of
    exact zeros, no structure: what sparsity and the weights' magnitudes alone score."""
    gen = torch.Generator().manual_seed(seed)
    m = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name in ("embed.weight", "readout.weight") or ".attn." in name:
                flat = p.reshape(-1)
                p.copy_(flat[torch.randperm(flat.numel(), generator=gen)].reshape(p.shape))
    return m
