"""Mechanism analysis of a transformer: is it sparse, and does it run the LayerNorm closed form?

`analyze(model, R)` returns one flat dict of headline numbers (the l1 sweep's table rows):

    sparsity, l1, hoyer          over every weight; "per_matrix": the same per parameter (JSON text)
    similarity                   weight-space similarity to the construction, invariant to the
                                 exact symmetries of docs/design.md §7 (icl_bench.analysis.similarity)
    similarity.<component>       its cosines: embed, layer{i}.out, layer{i}.gram, readout
    alignment                    JSON text: the residual-slot alignment that similarity found
    repr.layer{i}.r2.s{j}        representation space (docs/design.md §7): R^2 of construction slot j
                                 after block i, linearly decoded from the model's residual stream;
                                 .query_r2 the same at the query token, .token_r2 from the raw tokens
    repr.layer{i}.gp             how close that linear map is to a generalized permutation (1 = one)
    probe.*                      LayerNorm probes (icl_bench.analysis.probes): layer 1 vs centred x, y; the
                                 query's layer-2 LN output vs b_hat (u - x_bar) (passed by any accurate model)
    ln.*, ln.state               functional LayerNorm tests and the state they name (analysis/lnfunc.py)
    fp.*, fp.verdict             behavioural fingerprint under affine maps (analysis/fingerprint.py)
    mse_vs_ols                   the model's error on the analysis prompts

Sparsity: fraction of entries with |w| < 1e-3 max|w| (docs/design.md §3; per parameter relative to
its own max, overall relative to the global max, as the runner's weight_sparsity), the l1 norm,
and Hoyer's sparsity (Hoyer 2004, "Non-negative matrix factorization with sparseness constraints",
eq. 1): (sqrt(n) - ||w||_1 / ||w||_2) / (sqrt(n) - 1), 0 for a flat vector, 1 for a single spike.
The method and what the numbers mean: docs/analysis.md.
"""
from __future__ import annotations

import copy
import json
import math
import warnings
from pathlib import Path

import torch

from icl_bench.analysis.fingerprint import default_prompts, fingerprint
from icl_bench.analysis.lnfunc import ln_functional
from icl_bench.analysis.probes import mechanism_probes
from icl_bench.analysis.representation import representation_similarity
from icl_bench.analysis.similarity import alignment_json, similarity
from icl_bench.bench.metrics import prediction_metrics
from icl_bench.errors import ConfigError
from icl_bench.files import blocking_file, cannot_create, jsonable
from icl_bench.prompts.generator import MAX_VALUES, PromptSpec, sample_prompts
from icl_bench.solvers.checkpoint import load_checkpoint, read_meta, stem_of
from icl_bench.solvers.ln_closed_form import build_construction
from icl_bench.solvers.sparsity import hoyer, weight_l1, weight_sparsity
from icl_bench.solvers.transformer import Transformer

DEFAULT_N = 20  # context length of the analysis prompts when the model's readout does not fix it; the
# mechanism tests (ln.*, fp.*) always run at it, where their thresholds are calibrated (docs/analysis.md)
FEW_PROMPTS = 512  # below this, a warning: the known positive's state read 'neither' at 64 prompts (a review)
DEFAULT_NOISE = 0.1  # label noise of the analysis prompts (the evaluation setting)
INACCURATE = 0.1  # ln.rel_mse above this: a warning that the verdicts describe a model that does not solve the
# task (every model of results/mechanism/seeds.csv read 'layer-2 division' at <= 0.015; 'neither' went up to 0.52)


def sparsity_report(model: Transformer) -> dict:
    """Sparsity, l1 norm and Hoyer sparsity over every weight (Transformer.weight_matrices:
    embedding, W_Q/W_K/W_V/W_O, LayerNorm gains and biases, readout), and per parameter.

    Returns: {"sparsity", "l1", "hoyer": floats, "per_matrix": JSON text of
    {name: {"sparsity", "l1", "hoyer"}} (NaN as null; an all-zero tensor has sparsity 1, one with a
    NaN or inf entry NaN)}.
    """
    w = model.weight_matrices()
    per = {}
    for name, t in w.items():  # (NaN with a NaN or inf entry, as the whole: 'all zero' had read 1; a review)
        per[name] = {"sparsity": weight_sparsity({name: t}), "l1": weight_l1({name: t}), "hoyer": hoyer(t)}
    return {"sparsity": weight_sparsity(w), "l1": weight_l1(w),
            "hoyer": hoyer(torch.cat([t.reshape(-1).double().cpu() for t in w.values()])),
            "per_matrix": json.dumps(jsonable(per))}


def probe_report(model: Transformer, tokens: torch.Tensor) -> dict[str, float]:
    """The LayerNorm probes of icl_bench.analysis.probes (centering after block 1, division in block 2's
    LN at the query) as flat numbers: probe.<name>.{r2, slope, r2_stream, slot}; NaN when the
    model has no such layer (e.g. one block)."""
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
        N: context length of the prediction, representation and probe measures; default: the
            model's N for a flatten readout, else 20. The mechanism tests (ln.*, fp.*) run at
            N = 20 (flatten: the model's N) whatever N is: their thresholds are calibrated there.
        seed: seeds the prompts and the alignment search.
        noise: label noise of the prompts.
    Returns:
        flat dict of floats, ints and strings (alignment / assignments as JSON text): sparsity,
        l1, hoyer (+ per parameter), similarity (+ per component), alignment, repr.*, probe.*,
        mse_vs_ols, ln.*, fp.*, and the settings R, N, mechanism_N, noise, n_prompts, seed. Values that cannot be computed
        for this model (e.g. similarity of a 3-block model) are NaN, with the reason in
        "alignment".
    Raises:
        ConfigError: bad R, n_prompts, N or noise, or N that the model's flatten readout rejects.
    """
    if isinstance(n_prompts, bool) or not isinstance(n_prompts, int) or n_prompts < 8:
        raise ConfigError(f"n_prompts: must be an integer >= 8 (got {n_prompts!r})")
    if not isinstance(noise, (int, float)) or not math.isfinite(noise) or noise < 0:
        raise ConfigError(f"noise: must be a finite number >= 0 (got {noise!r})")
    cfg = model.cfg
    if N is None:
        N = cfg.N if cfg.readout == "flatten" else DEFAULT_N
    if isinstance(N, bool) or not isinstance(N, int) or N < 2:
        raise ConfigError(f"N: must be an integer >= 2 (got {N!r})")
    if n_prompts * (N + 1) > MAX_VALUES:
        raise ConfigError(f"n_prompts: n_prompts * (N + 1) = {n_prompts * (N + 1)} prompt values exceed "
                          f"{MAX_VALUES}; lower --n-prompts or --N")
    if cfg.readout == "flatten" and N != cfg.N:
        raise ConfigError(f"N: this model's flatten readout fixes N={cfg.N} (got {N})")
    if n_prompts < FEW_PROMPTS:
        warnings.warn(f"n_prompts = {n_prompts}: the mechanism tests' thresholds were calibrated on 1024-4096 "
                      f"prompts; below {FEW_PROMPTS} ln.state and fp.verdict can flip with the seed (the construction "
                      "itself read 'neither' at 64)", stacklevel=2)
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
    mechanism_N = cfg.N if cfg.readout == "flatten" else DEFAULT_N  # not N: the thresholds' own length
    if mechanism_N != DEFAULT_N:  # a flatten model runs at its own N, where they do not hold (a review)
        warnings.warn(f"this flatten-readout model fixes N = {mechanism_N}; the mechanism tests' thresholds are "
                      f"calibrated at N = {DEFAULT_N} (the construction's own ln.state reads 'neither' at N = 40), so "
                      "ln.state and fp.verdict are uncalibrated here", stacklevel=2)
    out["mechanism_N"] = mechanism_N
    out.update(mechanism_report(m, float(R), N=mechanism_N, n_prompts=n_prompts, seed=seed, noise=float(noise)))
    rel = out.get("ln.rel_mse", math.nan)
    if not rel <= INACCURATE:  # (NaN too: a model that answers NaN or inf)
        size = f"error is {rel:.0%} of the spread of the OLS answers" if math.isfinite(rel) else "answers include NaN or inf"
        warnings.warn(f"ln.rel_mse = {rel:.3g} > {INACCURATE:g}: this model's {size}, so it does not solve the task "
                      "and ln.state / fp.verdict describe a poor fit, not an algorithm (docs/analysis.md)", stacklevel=2)
    return out


def mechanism_report(model: Transformer, R: float, *, N: int, n_prompts: int, seed: int, noise: float) -> dict:
    """What the model does (not its weights): the functional LayerNorm tests and the state
    (icl_bench.analysis.lnfunc; keys "ln.*", "ln.state") and the behavioural fingerprint under
    affine maps of the prompt (icl_bench.analysis.fingerprint; keys "fp.*", "fp.verdict").
    Their thresholds are calibrated at N = 20 (DEFAULT_N; a flatten model: its own N), where
    `analyze` runs them whatever its own N: at N = 40 the construction's freeze (0.025) is below
    the state's 0.03, and the known positive read 'neither'.
    Used by `analyze` and callable on any Transformer (e.g. a published checkpoint); docs/analysis.md."""
    out = {f"ln.{k}": v for k, v in ln_functional(model, R, N=N, n_prompts=n_prompts, noise=noise, seed=seed).items()}
    dtype = next(model.parameters()).dtype

    class _Bare:  # the fingerprint needs only predict(batch)
        predict = staticmethod(lambda batch: model(batch.tokens.to(dtype)))

    fp = fingerprint(_Bare(), default_prompts(N=N, R=R, n_prompts=min(n_prompts, 1024), noise=noise, seed=seed))
    return {**out, **fp.row()}


def check_out(out: str) -> None:
    """`analyze --out`: a .json file that can be written and is no checkpoint's metadata.

    Raises:
        ConfigError (naming --out): another suffix, a folder, a parent that is a file, a folder
            that takes no new files (read-only, /proc), or an existing file that reads as a
            checkpoint's JSON half (writing the analysis over it
            would destroy that checkpoint: `analyze m --out m.json`).
    """
    if Path(out).suffix != ".json":
        raise ConfigError(f"--out: must name a .json file (got {out!r})")
    if Path(out).is_dir():
        raise ConfigError(f"--out: {out} is a folder; give a .json file")
    blocked = blocking_file(out)
    if blocked is not None:  # checked before the analysis runs, not after
        raise ConfigError(f"--out: {blocked} is a file, so {out} cannot be written; give another path")
    why = cannot_create(out)
    if why is not None:  # a read-only folder used to fail only after the analysis, naming a temporary file
        raise ConfigError(f"--out: cannot write {out} ({why}); give another path")
    try:
        read_meta(out)
    except ConfigError:
        return  # not a checkpoint's metadata (or not there): free to write
    raise ConfigError(f"--out: {out} is the metadata of checkpoint {stem_of(out)}; writing the analysis there would "
                      "destroy it; give another file")


def analyze_checkpoint(path: str | Path, **kwargs) -> dict:
    """`analyze` of a saved checkpoint (icl_bench.solvers.checkpoint), at the R stored in its metadata and,
    unless N is given, the training N stored there when it is one length (`train` stores a list:
    [40] -> 40); trained on several lengths (the shipped [10, 20, 40]), N = 20. A flatten readout
    fixes N. The mechanism tests run at N = 20 either way (`analyze`).

    Args:
        path: the checkpoint (either file of the .safetensors / .json pair, or the stem).
        kwargs: passed to `analyze` (n_prompts, N, seed, noise).
    Returns:
        analyze's dict plus "checkpoint" (the path as given).
    Raises:
        ConfigError: a missing or bad checkpoint, metadata without a finite R > 0, bad kwargs.
    """
    model, meta = load_checkpoint(path)
    R = meta.get("R")
    if isinstance(R, bool) or not isinstance(R, (int, float)) or not math.isfinite(R) or R <= 0:
        raise ConfigError(f"checkpoint: {path} metadata has no valid R (got {R!r})")
    N = meta.get("N")
    N = N[0] if isinstance(N, list) and len(N) == 1 else N  # train's list of lengths (this branch never fired)
    if kwargs.get("N") is None and model.cfg.readout == "query" and isinstance(N, int) and not isinstance(N, bool) and N >= 2:
        kwargs["N"] = N  # the context length it was trained on
    return {"checkpoint": str(path), **analyze(model, float(R), **kwargs)}


# the few numbers a table or a console line should show (analyze returns many more)
HEADLINE = ("mse_vs_ols", "sparsity", "l1", "hoyer", "similarity", "repr.layer0.r2_mean", "repr.layer1.r2_mean",
            "repr.layer1.query_r2.s3", "repr.layer1.gp", "probe.centering.x.r2", "probe.centering.y.r2",
            "probe.division.r2", "probe.division.slope", "ln.rel_mse", "ln.ln0.slope", "ln.ln0.r2", "ln.ln0.freeze",
            "ln.ln1.slope", "ln.ln1.r2", "ln.ln1.r2_raw", "ln.ln1.freeze", "ln.effective_R", "fp.identity", "fp.x*10", "fp.x+5", "fp.y*10")
# printed beside a headline number: probes that every accurate model passes are not mechanism tests
LABELS = {k: "(passed by any accurate model: not a mechanism test)" for k in ("probe.division.r2", "probe.division.slope")}
LABELS["ln.ln1.r2_raw"] = "(R^2 on log mean x^2: must stay below ln.ln1.r2 for a division by Cxx)"
