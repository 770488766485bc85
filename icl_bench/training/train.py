"""Train the shared transformer to do in-context linear regression, with an optional l1 penalty.

The reference paper's experiment (docs/design.md §1, §4 and §8): a d_model-4, 2-layer,
2-head LSA + LayerNorm transformer is trained on prompts from the shared generator with the OLS
prediction as target, and an l1 penalty lambda * sum|w| on its weight matrices, so that one can
ask whether it learns the LayerNorm closed form (docs/design.md §5) or gradient descent.

    loss = mean_b (model(tokens_b) - target_b)^2  +  l1 * sum_{w in penalised matrices} |w|

Penalised: the embedding, every W_Q / W_K / W_V / W_O and the readout. Not penalised: the
LayerNorm gains and biases (docs/training.md explains why: the construction *needs* large LN
gains, R/sqrt(2) and K/sqrt(2), to undo LN's division by the std).

Recipe that leaves the R >= 10 plateau (docs/design.md §8, re-measured in docs/training.md):
Adam, one-cycle schedule (linear warm-up, cosine decay), gradient-norm clipping, the R column
of the embedding initialised at 1/R of the other columns (so h = W_e (x, y, R) starts O(1)), and,
for R >= 100, that column preconditioned (`precondition_R`): without it R = 1000 stays on the
MSE ~ 1 plateau. Sources: the reference paper (summarised in docs/design.md §1), von
Oswald et al. 2023 (LSA); one-cycle schedule after Smith & Topin 2017.
Affine augmentation and proximal l1 (the mechanism recipe): icl_bench/training/augment.py.
"""
from __future__ import annotations

import math
import random
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import parametrize
from tqdm.auto import tqdm

from icl_bench.prompts.generator import PromptSpec, resolve_dtype, sample_prompts
from icl_bench.errors import ConfigError
from icl_bench.solvers.checkpoint import beside, save_checkpoint, stem_of
from icl_bench.solvers.sparsity import weight_l1, weight_sparsity
from icl_bench.solvers.transformer import Transformer
from icl_bench.startup import torch_threads
from icl_bench.training.augment import ProxL1, training_batch
from icl_bench.training.config import TrainConfig, prox_window

EVAL_SEED_OFFSET = 1_000_003  # held-out prompts use seed + this, never a training step's seed


def init_model(cfg: TrainConfig) -> Transformer:
    """A Transformer with N(0, init_scale^2) weight matrices, LN gain 1 / bias 0, seeded.

    With embed_r_over_R the R column (index 2) of the embedding is divided by R, so the token
    (x, y, R) embeds to O(1) values: this is what lets training leave the R >= 10 plateau.
    The draws come from torch's global CPU generator seeded with cfg.seed, forked so that the caller's
    random stream is left as it was, and the modules are built in float32 whatever the process's
    default dtype: nn.Linear's own init draws a different number of values in float64, which
    shifted every later draw (another init for the same config and seed; a review).
    """
    default = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):  # (the CPU generator: the modules are built on the CPU)
        torch.default_generator.manual_seed(cfg.seed)
        torch.set_default_dtype(torch.float32)
        try:
            model = Transformer(cfg.transformer_config())
        finally:
            torch.set_default_dtype(default)
        model = model.to(resolve_dtype(cfg.dtype))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".ln." in name:
                    continue  # nn.LayerNorm's own init: gain 1, bias 0
                p.normal_(0.0, cfg.init_scale)
            if cfg.embed_r_over_R:
                model.embed.weight[:, 2] /= cfg.R
    return model


class ColumnScale(nn.Module):
    """Parametrization W = W' * scale (per column): the optimiser sees W', the model uses W."""

    def __init__(self, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("scale", scale)  # (d_in,)

    def forward(self, w: torch.Tensor) -> torch.Tensor:  # w' (d_model, d_in) -> W
        return w * self.scale


def precondition(model: Transformer, cfg: TrainConfig) -> None:
    """Store the embedding's R column as R/precondition_R times the real one during training.

    The function, the loss and the l1 penalty are unchanged (they see the real W); only Adam's
    steps on that column shrink by precondition_R/R in function space, so training at R = 1000
    behaves like training at R = precondition_R. `unprecondition` folds it back before saving.
    """
    if not cfg.precondition_R or "parametrizations" in dict(model.embed.named_children()):
        return
    scale = torch.ones(model.cfg.d_in, dtype=model.embed.weight.dtype)
    scale[2] = cfg.precondition_R / cfg.R
    with torch.no_grad():
        model.embed.weight[:, 2] /= scale[2]
    parametrize.register_parametrization(model.embed, "weight", ColumnScale(scale))


def unprecondition(model: Transformer) -> None:
    """Remove the parametrization, keeping the real weights (plain Transformer state_dict)."""
    if parametrize.is_parametrized(model.embed):
        parametrize.remove_parametrizations(model.embed, "weight", leave_parametrized=True)


def real_weights(model: Transformer) -> dict[str, torch.Tensor]:
    """weight_matrices() with the real embedding even while preconditioned (for sparsity)."""
    w = {k: v for k, v in model.weight_matrices().items() if not k.startswith("embed.")}
    return {"embed.weight": model.embed.weight.detach(), **w}


def penalised(model: Transformer) -> list[torch.Tensor]:
    """The tensors the l1 penalty acts on: every weight matrix, not the LayerNorm gains/biases."""
    mats = [m.weight for m in (model.embed, model.readout)]  # the real W even when preconditioned
    return mats + [p for name, p in model.named_parameters() if ".attn." in name]


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """Multiplier of cfg.lr at `step` (0-based) for the configured schedule."""
    if cfg.schedule == "constant":
        return 1.0
    warm = int(cfg.warmup_frac * cfg.steps) if cfg.schedule == "onecycle" else 0
    if step < warm:
        return (step + 1) / warm
    t = (step - warm) / max(1, cfg.steps - warm)
    return 0.5 * (1 + math.cos(math.pi * t)) * (1 - 1e-3) + 1e-3


@torch.no_grad()
def evaluate(model: Transformer, held_out: list) -> dict[str, float]:
    """Held-out MSE vs OLS (absolute and divided by var(OLS)), averaged over the training N.

    Runs the eager forward, not the fused kernels (icl_bench/solvers/fused.py): with l1 or proximal
    l1 the weights' zero pattern changes between evaluations, and each new pattern would compile a
    kernel of its own (seconds to a minute each) for one small batch."""
    mse, rel = [], []
    for batch in held_out:
        ols = batch.ols_prediction
        err = (model.forward_eager(batch.tokens).double() - ols) ** 2  # (B,) float64
        ok = torch.isfinite(err)
        if not bool(ok.any()):  # every prediction NaN / inf (a diverged model): no mean to take
            mse.append(math.nan), rel.append(math.nan)
            continue
        mse.append(float(err[ok].mean()))
        rel.append(mse[-1] / float(ols[ok].var()))
    return {"eval_mse_vs_ols": sum(mse) / len(mse), "eval_rel_mse": sum(rel) / len(rel)}


def train(cfg: TrainConfig, model: Transformer | None = None) -> tuple[Transformer, list[dict]]:
    """Train a model as configured.

    Args:
        cfg: the TrainConfig (validated on construction).
        model: optional model to continue from (default: `init_model(cfg)`).
    Returns:
        (model in eval mode, history): history is one dict per evaluation with step, loss
        (MSE + penalty on the last training batch), train_mse, eval_mse_vs_ols, eval_rel_mse
        (held-out MSE vs OLS / var(OLS prediction)), sparsity (docs/design.md §3 threshold), lr,
        elapsed_s and steps_per_s. Evaluation happens every eval_every steps, at step 0 and at
        the end. Training stops at cfg.steps or once eval_rel_mse <= stop_rel_mse.
    Reproducibility: the same cfg (and thread count) gives the same weights; step t trains on
        sample_prompts(seed = cfg.seed * 1_000_000 + t).
    """
    flushing = _flushing()
    torch.set_flush_denormal(True)  # denormals slow CPU training > 10x (docs/design.md §8)
    try:
        with torch_threads(cfg.threads):  # restored after: it stayed at cfg.threads for the whole process
            return _train(cfg, model)
    finally:  # process-wide: left on, every later computation of the process flushed subnormals to 0
        torch.set_flush_denormal(flushing)  # (float32 OLS of subnormal x read NaN after a training; a review)


def _flushing() -> bool:
    """Whether torch flushes subnormal floats to zero now (torch.set_flush_denormal has no getter)."""
    return float((torch.tensor([2.0 ** -1070], dtype=torch.float64) * 1.0).item()) == 0.0


def _train(cfg: TrainConfig, model: Transformer | None) -> tuple[Transformer, list[dict]]:
    """train's body, with denormals flushed."""
    dtype = resolve_dtype(cfg.dtype)
    model = init_model(cfg) if model is None else model
    precondition(model, cfg)
    model.train()
    specs = {n: PromptSpec(N=n, noise=cfg.noise, R=float(cfg.R)) for n in cfg.N}
    held_out = [sample_prompts(specs[n], cfg.eval_prompts, seed=cfg.seed + EVAL_SEED_OFFSET, dtype=dtype) for n in cfg.N]
    pick_n = random.Random(cfg.seed)  # which N each step trains on
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(cfg, s))
    if cfg.l1_prox > 0 and not prox_window(cfg):  # e.g. a config's window under a --steps override
        warnings.warn(f"{cfg.name}: proximal l1 never acts: (l1_start, l1_stop] x steps = "
                      f"({cfg.l1_start * cfg.steps:g}, {cfg.l1_stop * cfg.steps:g}] holds no step", stacklevel=2)
    prox = ProxL1(model, cfg)  # proximal l1 and the masked fine-tuning after it (no-op when l1_prox = 0)
    history: list[dict] = []
    start = time.perf_counter()

    def record(step, loss, mse):
        row = {"step": step, "loss": loss, "train_mse": mse, **evaluate(model, held_out),
               "sparsity": weight_sparsity(real_weights(model)), "lr": opt.param_groups[0]["lr"],
               "elapsed_s": time.perf_counter() - start}
        row["steps_per_s"] = step / row["elapsed_s"] if step else math.nan
        history.append(row)
        return row

    row = record(0, math.nan, math.nan)
    bar = tqdm(range(1, cfg.steps + 1), desc=cfg.name, disable=not cfg.progress, mininterval=2.0)
    for step in bar:
        batch = sample_prompts(specs[pick_n.choice(cfg.N)], cfg.batch_size, seed=cfg.seed * 1_000_000 + step, dtype=dtype)
        target = batch.ols_prediction.to(dtype) if cfg.target == "ols" else batch.y_query  # (B,)
        tokens, target = training_batch(cfg, batch.tokens, target, step)  # x, u -> s x + t; y -> c y + d
        pred = model(tokens)  # (B,)
        mse = ((pred - target) ** 2).mean()
        loss = mse + cfg.l1 * sum(p.abs().sum() for p in penalised(model)) if cfg.l1 > 0 else mse
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        prox(step, opt.param_groups[0]["lr"])
        sched.step()
        if step % cfg.eval_every == 0 or step == cfg.steps:
            row = record(step, loss.item(), mse.item())
            bar.set_postfix(loss=f"{row['loss']:.2e}", mse_ols=f"{row['eval_mse_vs_ols']:.2e}", sparsity=f"{row['sparsity']:.2f}")
            if not math.isfinite(row["loss"]):
                break  # diverged: keep the history, let the caller see the NaN
            if cfg.stop_rel_mse and row["eval_rel_mse"] <= cfg.stop_rel_mse:
                break
    bar.close()
    unprecondition(model)
    model.eval()
    return model, history


@torch.no_grad()
def fresh_metrics(model: Transformer, R: float, Ns=(10, 30, 100, 300), *, noise=0.1, n_prompts=4096, seed=2_000_000_000) -> dict:
    """MSE vs OLS and its ratio to var(OLS prediction) on fresh prompts, per N (query readout)
    or at the model's N (flatten readout). Returns {"N=<n>": {"mse_vs_ols", "rel_mse"}}."""
    if model.cfg.readout == "flatten":
        Ns = (model.cfg.N,)
    dtype = next(model.parameters()).dtype
    out = {}
    for n in Ns:
        batch = sample_prompts(PromptSpec(N=n, noise=noise, R=float(R)), n_prompts, seed=seed + n, dtype=dtype)
        out[f"N={n}"] = {k.replace("eval_", ""): v for k, v in evaluate(model, [batch]).items()}
    return out


def train_and_save(cfg: TrainConfig, out_dir: str | Path, *, replace: bool = True, key: str = "--out",
                   where: str | None = None) -> Path:
    """Train `cfg` and write the checkpoint `<out_dir>/<cfg.name>.{safetensors,json}`; returns the stem.

    The JSON carries the train config, R, N, seed, solver, the history, the final held-out
    metrics and `fresh_metrics` (noise 0.1, N in the default grid) for the model card.
    `replace`: False when the caller checked that the pair is absent (no --force): a pair that
    another process saved under this name while this one trained is then kept, and this run is
    saved beside it as `<name>-pid<pid>` (hours of training are not thrown away either).

    Raises:
        ConfigError: training diverged (a non-finite loss or weight): nothing is written (the
            message begins with `where`, default `runs.<name>.lr`: the config field to change); or (naming
            `key`) replace is False and the pair appeared while training: the message names where
            this run was saved instead.
    """
    where = where or f"runs.{cfg.name}.lr"
    try:
        model, history = train(cfg)
    except RuntimeError as exc:  # Adam's step size lr / (1 - beta1^t), 10 lr at step 1, must fit the dtype:
        if "overflow" not in str(exc):  # lr = 1e38 in float32 was a torch traceback (a review)
            raise
        raise ConfigError(f"{where}: the optimiser's step size overflows {cfg.dtype} (lr = {cfg.lr:g}: Adam's first "
                          "step is 10 lr); no checkpoint written: lower lr") from None
    final = history[-1]
    if (final["step"] > 0 and not math.isfinite(final["loss"])) or not all(bool(torch.isfinite(p).all())
                                                                           for p in model.parameters()):
        raise ConfigError(f"{where}: training diverged by step {final['step']} (loss "
                          f"{final['loss']}, lr = {cfg.lr:g}{f', l1 = {cfg.l1:g}' if cfg.l1 else ''}); no checkpoint "
                          "written: lower lr" + (" or l1" if cfg.l1 else "") + ("" if cfg.clip > 0 else ", or set clip > 0")
                          + ("" if cfg.l1 else f" (or, where lr is already small, R = {cfg.R:g}, noise = {cfg.noise:g} "
                                                f"or init_scale = {cfg.init_scale:g} may be too large for {cfg.dtype})"))
    meta = {"solver": cfg.solver, "R": float(cfg.R), "N": cfg.N, "seed": cfg.seed, "train_config": cfg.to_dict(),
            "metrics": {**{k: final[k] for k in ("step", "eval_mse_vs_ols", "eval_rel_mse", "sparsity", "elapsed_s", "steps_per_s")},
                        "weight_l1": weight_l1(model.weight_matrices()), "fresh_noise0.1": fresh_metrics(model, cfg.R, n_prompts=cfg.eval_prompts)},
            "history": history}
    stem = stem_of(Path(out_dir) / cfg.name)
    try:
        return save_checkpoint(model, stem, meta, replace=replace)
    except FileExistsError as exc:  # another train / sweep of this name finished first: keep both
        taken = exc.filename
    for k in range(100):  # a free name beside it (a leftover of an earlier process of this PID is kept too)
        try:
            alt = save_checkpoint(model, beside(stem, k), meta, replace=False)
        except FileExistsError:
            continue
        raise ConfigError(f"{key}: {taken} was saved by another process while this run trained, so it was "
                          f"not overwritten; this run is saved as {alt}.safetensors")
    raise ConfigError(f"{key}: {taken} was saved by another process while this run trained, and so were "
                      f"{beside(stem)} to {beside(stem, 99)}; this run is not saved: clear the folder and train again")
