"""Mechanism analysis of a transformer: is it sparse, and does it run the LayerNorm closed form?

`analyze(model, R)` returns one flat dict of headline numbers (the l1 sweep's table rows):

    sparsity, l1, hoyer          over every weight; "per_matrix": the same per parameter (JSON text)
    similarity                   weight-space similarity to the construction, invariant to the
                                 exact symmetries of shared DESIGN.md section 7 (icl_bench.symmetry)
    similarity.<component>       its cosines: embed, layer{i}.out, layer{i}.gram, readout
    alignment                    JSON text: the residual-slot alignment that similarity found
    repr.layer{i}.r2.s{j}        representation space (DESIGN section 7): R^2 of construction slot j
                                 after block i, linearly decoded from the model's residual stream;
                                 .query_r2 the same at the query token, .token_r2 from the raw tokens
    repr.layer{i}.gp             how close that linear map is to a generalized permutation (1 = one)
    probe.*                      LayerNorm probes (icl_bench.probes): layer 1 vs centred x, y; the
                                 query's layer-2 LN output vs b_hat (u - x_bar)
    mse_vs_ols                   the model's error on the analysis prompts

Sparsity: fraction of entries with |w| < 1e-3 max|w| (DESIGN section 3; per parameter relative to
its own max, overall relative to the global max, as the runner's weight_sparsity), the l1 norm,
and Hoyer's sparsity (Hoyer 2004, "Non-negative matrix factorization with sparseness constraints",
eq. 1): (sqrt(n) - ||w||_1 / ||w||_2) / (sqrt(n) - 1), 0 for a flat vector, 1 for a single spike.
The method and what the numbers mean: docs/analysis.md.
"""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import scipy.optimize
import torch

from icl_bench.errors import ConfigError
from icl_bench.metrics import SPARSITY_REL_THRESHOLD, prediction_metrics, weight_l1, weight_sparsity
from icl_bench.prompts import PromptSpec, sample_prompts
from icl_bench.symmetry import alignment_json, similarity
from icl_bench.transformer import Transformer

DEFAULT_N = 20  # context length of the analysis prompts when the model's readout does not fix it
DEFAULT_NOISE = 0.1  # label noise of the analysis prompts (the evaluation setting)


def hoyer(w: torch.Tensor) -> float:
    """Hoyer sparsity of all entries of w (any shape): (sqrt(n) - l1/l2) / (sqrt(n) - 1) in [0, 1].
    NaN for fewer than 2 entries or an all-zero tensor."""
    v = w.detach().reshape(-1).double().cpu()
    n, l2 = v.numel(), float(v.norm())
    if n < 2 or l2 == 0.0:
        return math.nan
    return (math.sqrt(n) - float(v.abs().sum()) / l2) / (math.sqrt(n) - 1.0)


def sparsity_report(model: Transformer) -> dict:
    """Sparsity, l1 norm and Hoyer sparsity over every weight (Transformer.weight_matrices:
    embedding, W_Q/W_K/W_V/W_O, LayerNorm gains and biases, readout), and per parameter.

    Returns: {"sparsity", "l1", "hoyer": floats, "per_matrix": JSON text of
    {name: {"sparsity", "l1", "hoyer"}} (NaN as null; an all-zero tensor has sparsity 1)}.
    """
    w = model.weight_matrices()
    per = {}
    for name, t in w.items():
        a = t.detach().abs().double()
        top = float(a.max()) if a.numel() else 0.0
        per[name] = {"sparsity": float((a < SPARSITY_REL_THRESHOLD * top).double().mean()) if top > 0 else 1.0,
                     "l1": float(a.sum()), "hoyer": _finite_or_none(hoyer(t))}
    return {"sparsity": weight_sparsity(w), "l1": weight_l1(w),
            "hoyer": hoyer(torch.cat([t.reshape(-1).double().cpu() for t in w.values()])),
            "per_matrix": json.dumps(per)}


def _finite_or_none(v: float):
    return v if math.isfinite(v) else None


def _r2_per_column(pred: np.ndarray, target: np.ndarray) -> np.ndarray:
    """(d,) R^2 of each target column; NaN where the target is constant (variance <= 1e-20 of
    its mean square, e.g. the construction's R slot)."""
    var = target.var(axis=0)
    ss_res = ((target - pred) ** 2).mean(axis=0)
    const = var <= 1e-20 * np.maximum((target ** 2).mean(axis=0), 1e-300)
    return np.where(const, np.nan, 1.0 - ss_res / np.where(const, 1.0, var))


def linear_map_fit(source: torch.Tensor, target: torch.Tensor) -> dict:
    """Fit target ~ source @ W (no intercept: the symmetries are linear) on the first half of the
    rows, score it on the second half.

    Args:
        source: (n, d_s) the model's activations; target: (n, d_t) the construction's.
    Returns:
        {"r2": (d_t,) held-out R^2 per target slot (NaN: constant slot), "gp": closeness of the
        map to a generalized permutation in [0, 1], "assignment": target slot -> source column
        (-1: slot left out), "W": (d_t, d_s) the map, target ~ source @ W.T (numpy float64)}.
        gp: rows of W (one per non-zero target slot; source columns scaled to unit RMS) are
        normalised, a one-to-one slot -> column matching maximises the sum of squared entries
        (scipy.optimize.linear_sum_assignment), gp = that sum / number of rows: 1 exactly when
        each slot reads a single column, 1/d_s for a perfectly flat map.
    Raises:
        ConfigError: row counts that differ, or fewer than 4 rows with finite values.
    """
    X, Y = source.detach().double().cpu().numpy(), target.detach().double().cpu().numpy()
    if X.shape[0] != Y.shape[0] or X.shape[0] < 4:
        raise ConfigError(f"source: need the same number (>= 4) of rows as target (got {X.shape[0]}, {Y.shape[0]})")
    ok = np.isfinite(X).all(1) & np.isfinite(Y).all(1)
    X, Y = X[ok], Y[ok]
    if X.shape[0] < 4:
        raise ConfigError(f"source: need >= 4 rows with finite values (got {X.shape[0]})")
    rms = np.sqrt((X ** 2).mean(axis=0))
    X = X / np.where(rms > 0, rms, 1.0)  # (n, d_s): unit-RMS columns
    half = X.shape[0] // 2
    W, *_ = np.linalg.lstsq(X[:half], Y[:half], rcond=None)  # (d_s, d_t)
    r2 = _r2_per_column(X[half:] @ W, Y[half:])
    W = W.T  # (d_t, d_s)
    live = np.flatnonzero(np.sqrt((Y ** 2).mean(axis=0)) > 0)  # slots that are not identically 0
    norms = np.linalg.norm(W[live], axis=1, keepdims=True)
    U = (W[live] / np.where(norms > 0, norms, 1.0)) ** 2  # (d_live, d_s) squared unit rows
    rows, cols = scipy.optimize.linear_sum_assignment(-U)
    assignment = np.full(Y.shape[1], -1)
    assignment[live[rows]] = cols
    gp = float(U[rows, cols].sum() / max(len(live), 1))
    return {"r2": r2, "gp": gp, "assignment": assignment.tolist(), "W": W / np.where(rms > 0, rms, 1.0)}


@torch.no_grad()
def representation_similarity(model: Transformer, construction: Transformer, tokens: torch.Tensor) -> dict:
    """Representation-space comparison (DESIGN section 7): for each block i, linear maps from the
    model's residual stream after it to the construction's (`linear_map_fit`), fitted on the
    first half of the prompts and scored on the second half, two ways:
      all tokens  one map for every token (the symmetries are one map for the whole stream);
      query       a map for the query token alone: the only token the readout reads, so after
                  the last block the context tokens are free (the construction's slot 3 there is
                  b_hat x~_i ~ y~_i, which any stream holding y predicts).
    Baseline: the all-token fit from the raw tokens (x, y, R), what needs no computation at all
    (x alone predicts x - x_bar with R^2 ~ 1 - 1/N).

    Args:
        model, construction: Transformers with the same number of blocks (float64 advised).
        tokens: (B, N+1, 3) prompts both read, B >= 8.
    Returns:
        flat {"repr.layer{i}.r2.s{j}", "repr.layer{i}.query_r2.s{j}", "repr.layer{i}.token_r2.s{j}"
        (held-out R^2 per construction slot j; NaN for a constant slot), "repr.layer{i}.r2_mean"
        (over non-constant slots, all tokens), "repr.layer{i}.gp", "repr.layer{i}.query_gp"
        (closeness to a generalized permutation), "repr.layer{i}.assignment" (JSON: slot ->
        model coordinate of the all-token map)}.
    Raises:
        ConfigError: different numbers of blocks, or fewer than 8 prompts.
    """
    if len(model.blocks) != len(construction.blocks):
        raise ConfigError(f"model: has {len(model.blocks)} blocks, the construction {len(construction.blocks)}")
    B, T, _ = tokens.shape
    if B < 8:
        raise ConfigError(f"tokens: need at least 8 prompts (got {B})")
    tm = model.probe(tokens.to(next(model.parameters()).dtype))
    tc = construction.probe(tokens.to(next(construction.parameters()).dtype))
    h = B // 2  # prompts per half: rows are prompt-major, so each half holds whole prompts
    out = {}
    for i in range(len(model.blocks)):
        key = f"layer{i}.resid"
        hm, hc = tm[key][: 2 * h].double().cpu(), tc[key][: 2 * h].double().cpu()  # (2h, T, d) each
        fit = linear_map_fit(hm.reshape(2 * h * T, -1), hc.reshape(2 * h * T, -1))
        query = linear_map_fit(hm[:, -1], hc[:, -1])  # (2h, d): the query token only
        base = linear_map_fit(tokens[: 2 * h].reshape(2 * h * T, -1), hc.reshape(2 * h * T, -1))
        for j in range(hc.shape[-1]):
            out[f"repr.layer{i}.r2.s{j}"] = float(fit["r2"][j])
            out[f"repr.layer{i}.query_r2.s{j}"] = float(query["r2"][j])
            out[f"repr.layer{i}.token_r2.s{j}"] = float(base["r2"][j])
        finite = fit["r2"][np.isfinite(fit["r2"])]
        out[f"repr.layer{i}.r2_mean"] = float(finite.mean()) if finite.size else math.nan
        out[f"repr.layer{i}.gp"] = fit["gp"]
        out[f"repr.layer{i}.query_gp"] = query["gp"]
        out[f"repr.layer{i}.assignment"] = json.dumps(fit["assignment"])
    return out


def probe_report(model: Transformer, tokens: torch.Tensor) -> dict[str, float]:
    """The LayerNorm probes of icl_bench.probes (centering after block 1, division in block 2's
    LN at the query) as flat numbers: probe.<name>.{r2, slope, r2_stream, slot}; NaN when the
    model has no such layer (e.g. one block)."""
    from icl_bench.probes import mechanism_probes

    names = ("centering.x", "centering.y", "division")
    try:
        fits = mechanism_probes(model.probe(tokens), tokens)
    except ConfigError:
        return {f"probe.{n}.{f}": math.nan for n in names for f in ("r2", "slope", "r2_stream", "slot")}
    return {f"probe.{n}.{f}": float(getattr(fits[n], f)) for n in names for f in ("r2", "slope", "r2_stream", "slot")}


def analyze(model: Transformer, R: float, *, n_prompts: int = 2048, N: int | None = None, seed: int = 0,
            noise: float = DEFAULT_NOISE) -> dict:
    """Every headline number of the mechanism analysis, as one flat dict (module docstring).

    Args:
        model: any Transformer (a float64 copy is analysed; the model is not modified).
        R: the embedding constant the model was trained for; the construction is built for it,
            with the model's key set (masked / query-in-context), and the prompts carry it.
        n_prompts: analysis prompts (>= 8; half fit, half score the representation maps).
        N: context length; default: the model's N for a flatten readout, else 20.
        seed: seeds the prompts and the alignment search.
        noise: label noise of the prompts.
    Returns:
        flat dict of floats, ints and strings (alignment / assignments as JSON text): sparsity,
        l1, hoyer (+ per parameter), similarity (+ per component), alignment, repr.*, probe.*,
        mse_vs_ols, and the settings R, N, noise, n_prompts, seed. Values that cannot be computed
        for this model (e.g. similarity of a 3-block model) are NaN, with the reason in
        "alignment".
    Raises:
        ConfigError: bad R, n_prompts, N or noise, or N that the model's flatten readout rejects.
    """
    from icl_bench.ln_closed_form import build_construction

    if isinstance(n_prompts, bool) or not isinstance(n_prompts, int) or n_prompts < 8:
        raise ConfigError(f"n_prompts: must be an integer >= 8 (got {n_prompts!r})")
    if not isinstance(noise, (int, float)) or not math.isfinite(noise) or noise < 0:
        raise ConfigError(f"noise: must be a finite number >= 0 (got {noise!r})")
    cfg = model.cfg
    if N is None:
        N = cfg.N if cfg.readout == "flatten" else DEFAULT_N
    if isinstance(N, bool) or not isinstance(N, int) or N < 2:
        raise ConfigError(f"N: must be an integer >= 2 (got {N!r})")
    from icl_bench.config import MAX_VALUES  # the run matrix's memory bound, for the same reason

    if n_prompts * (N + 1) > MAX_VALUES:
        raise ConfigError(f"n_prompts: n_prompts * (N + 1) = {n_prompts * (N + 1)} prompt values exceed "
                          f"{MAX_VALUES}; lower --n-prompts or --N")
    if cfg.readout == "flatten" and N != cfg.N:
        raise ConfigError(f"N: this model's flatten readout fixes N={cfg.N} (got {N})")
    construction = build_construction(R, variant=cfg.keys, dtype=torch.float64)  # ConfigError for bad R
    m = copy.deepcopy(model).to(device="cpu", dtype=torch.float64).eval()
    batch = sample_prompts(PromptSpec(N=N, noise=float(noise), R=float(R)), n_prompts, seed=seed, dtype="float64")
    out: dict = {"R": float(R), "N": N, "noise": float(noise), "n_prompts": n_prompts, "seed": seed}
    with torch.no_grad():
        out["mse_vs_ols"] = prediction_metrics(m(batch.tokens), batch)["mse_vs_ols"]
    out.update(sparsity_report(model))
    try:
        score, align = similarity(m, construction, seed=seed)
        out["similarity"] = score
        out.update({f"similarity.{k}": v for k, v in align["components"].items()})
        out["alignment"] = alignment_json(align)
    except ConfigError as exc:
        out["similarity"] = math.nan
        out["alignment"] = json.dumps({"error": str(exc)})
    try:
        out.update(representation_similarity(m, construction, batch.tokens))
    except ConfigError:
        pass  # a different number of blocks: no slot-by-slot comparison
    out.update(probe_report(m, batch.tokens))
    out.update(mechanism_report(m, float(R), N=N, n_prompts=n_prompts, seed=seed, noise=float(noise)))
    return out


def mechanism_report(model: Transformer, R: float, *, N: int, n_prompts: int, seed: int, noise: float) -> dict:
    """What the model does (not its weights): the functional LayerNorm tests and the state
    (icl_bench.lnfunc, keys "ln.*", "ln.state") and the behavioural fingerprint under affine
    maps of the prompt (icl_bench.fingerprint, keys "fp.*", "fp.verdict"); docs/analysis.md."""
    from icl_bench.fingerprint import default_prompts, fingerprint
    from icl_bench.lnfunc import ln_functional

    out = {f"ln.{k}": v for k, v in ln_functional(model, R, N=N, n_prompts=n_prompts, noise=noise, seed=seed).items()}

    class _Bare:  # the fingerprint needs only predict(batch)
        predict = staticmethod(lambda batch: model(batch.tokens.to(next(model.parameters()).dtype)))

    fp = fingerprint(_Bare(), default_prompts(N=N, R=R, n_prompts=min(n_prompts, 1024), noise=noise, seed=seed))
    return {**out, **fp.row()}


def analyze_checkpoint(path: str | Path, **kwargs) -> dict:
    """`analyze` of a saved checkpoint (icl_bench.checkpoint), at the R stored in its metadata and,
    unless N is given, the training N stored there (query readout; a flatten readout fixes N).

    Args:
        path: the checkpoint (either file of the .safetensors / .json pair, or the stem).
        kwargs: passed to `analyze` (n_prompts, N, seed, noise).
    Returns:
        analyze's dict plus "checkpoint" (the path as given).
    Raises:
        ConfigError: a missing or bad checkpoint, metadata without a finite R > 0, bad kwargs.
    """
    try:
        from icl_bench.checkpoint import load_checkpoint
    except ImportError:
        raise ConfigError("checkpoint: icl_bench.checkpoint is not available in this install") from None
    model, meta = load_checkpoint(path)
    R = meta.get("R")
    if isinstance(R, bool) or not isinstance(R, (int, float)) or not math.isfinite(R) or R <= 0:
        raise ConfigError(f"checkpoint: {path} metadata has no valid R (got {R!r})")
    N = meta.get("N")
    if kwargs.get("N") is None and model.cfg.readout == "query" and isinstance(N, int) and not isinstance(N, bool) and N >= 2:
        kwargs["N"] = N  # the context length it was trained on
    return {"checkpoint": str(path), **analyze(model, float(R), **kwargs)}


def to_json(result: dict) -> str:
    """A result dict as strict JSON text (NaN / inf -> null), keys sorted."""
    clean = {k: (_finite_or_none(v) if isinstance(v, float) else v) for k, v in result.items()}
    return json.dumps(clean, indent=2, sort_keys=True)


# the few numbers a table or a console line should show (analyze returns many more)
HEADLINE = ("mse_vs_ols", "sparsity", "l1", "hoyer", "similarity", "repr.layer0.r2_mean", "repr.layer1.r2_mean",
            "repr.layer1.query_r2.s3", "repr.layer1.gp", "probe.centering.x.r2", "probe.centering.y.r2",
            "probe.division.r2", "probe.division.slope", "ln.rel_mse", "ln.ln0.slope", "ln.ln0.r2", "ln.ln0.freeze",
            "ln.ln1.slope", "ln.ln1.r2", "ln.ln1.freeze", "ln.effective_R", "fp.identity", "fp.x*10", "fp.x+5", "fp.y*10")
LABELS = {"probe.division.r2": "(passed by any accurate model: not a mechanism test)",
          "probe.division.slope": "(passed by any accurate model: not a mechanism test)"}


def run_cli(checkpoint: str, *, out: str | None = None, n_prompts: int = 2048, seed: int = 0,
            N: int | None = None) -> int:
    """`icl-bench analyze CHECKPOINT [--out FILE.json]`: print the headline numbers, the sparsity
    per parameter and the alignment; write every number to --out as JSON. Returns the exit code
    (0); bad input raises ConfigError (the CLI prints it as one line, exit 2)."""
    if out is not None and Path(out).suffix != ".json":
        raise ConfigError(f"--out: must name a .json file (got {out!r})")
    result = analyze_checkpoint(checkpoint, n_prompts=n_prompts, seed=seed, N=N)
    fmt = lambda v: "nan" if v is None else f"{v:.4g}"  # noqa: E731
    for k in HEADLINE:
        print(f"{k:26s} {fmt(_finite_or_none(float(result[k])) if k in result else None)} {LABELS.get(k, '')}".rstrip())
    print(f"{'state (functional LN)':26s} {result.get('ln.state')}\n{'fingerprint verdict':26s} {result.get('fp.verdict')} "
          f"(closest gd: K={result.get('fp.gd_steps')}, distance {fmt(result.get('fp.gd_distance'))})")
    print(f"{'per matrix':26s} sparsity   l1         hoyer")
    for name, v in json.loads(result["per_matrix"]).items():
        print(f"  {name:24s} {fmt(v['sparsity']):10s} {fmt(v['l1']):10s} {fmt(v['hoyer'])}")
    print(f"{'alignment':26s} {result['alignment']}")
    if out is not None:
        from icl_bench.rundir import write_atomic

        Path(out).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(Path(out), (to_json(result) + "\n").encode())  # an old file survives a crash intact
        print(f"wrote {out}")
    return 0
