"""Train the shared transformer to do in-context linear regression, with an optional l1 penalty.

The reference paper's experiment (shared DESIGN.md sections 1, 4 and 8): a d_model-4, 2-layer,
2-head LSA + LayerNorm transformer is trained on prompts from the shared generator with the OLS
prediction as target, and an l1 penalty lambda * sum|w| on its weight matrices, so that one can
ask whether it learns the LayerNorm closed form (DESIGN section 5) or gradient descent.

    loss = mean_b (model(tokens_b) - target_b)^2  +  l1 * sum_{w in penalised matrices} |w|

Penalised: the embedding, every W_Q / W_K / W_V / W_O and the readout. Not penalised: the
LayerNorm gains and biases (docs/training.md explains why: the construction *needs* large LN
gains, R/sqrt(2) and K/sqrt(2), to undo LN's division by the std).

Recipe that leaves the R >= 10 plateau (DESIGN section 8, re-measured in docs/training.md):
Adam, one-cycle schedule (linear warm-up, cosine decay), gradient-norm clipping, the R column
of the embedding initialised at 1/R of the other columns (so h = W_e (x, y, R) starts O(1)), and,
for R >= 100, that column preconditioned (`precondition_R`): without it R = 1000 stays on the
MSE ~ 1 plateau. Sources: the reference paper (shared/reference/paper-summary.zh.txt), von
Oswald et al. 2023 (LSA); one-cycle schedule after Smith & Topin 2017.
Usage: `model, history = train(TrainConfig.from_toml("benchmarks/train.toml", section="trained-l1-R10"))`
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import parametrize
from tqdm.auto import tqdm

from icl_bench.augment import check_fields, prox_step, training_tokens
from icl_bench.config import tomllib  # tomllib, or tomli on Python 3.10
from icl_bench.errors import ConfigError
from icl_bench.metrics import weight_l1, weight_sparsity
from icl_bench.prompts import PromptSpec, resolve_dtype, sample_prompts
from icl_bench.transformer import KEY_SETS, READOUTS, Transformer, TransformerConfig

SCHEDULES = ("onecycle", "cosine", "constant")
TARGETS = ("ols", "noisy")
EVAL_SEED_OFFSET = 1_000_003  # held-out prompts use seed + this, never a training step's seed


@dataclass
class TrainConfig:
    """One training run. Invalid values raise ConfigError("train.<field>: ...; accepted: ...")."""

    name: str = "model"  # checkpoint file stem, e.g. "trained-l1-R10"
    solver: str = ""  # the solver this checkpoint serves (trained-l1 / trained-nol1 / trained-lsa) or ""
    seed: int = 0  # seeds the init, the per-step prompts and the held-out prompts
    # --- prompts ---
    R: float = 10.0  # the embedding constant of every prompt (> 0)
    N: list[int] = field(default_factory=lambda: [20])  # context lengths; each step draws one
    noise: float = 0.1  # label noise sigma of the training prompts
    target: str = "ols"  # "ols": regress on the OLS prediction; "noisy": on the noisy y_query
    # --- model ---
    layernorm: bool = True  # LN after attention in every block (False: the trained-lsa control)
    keys: str = "masked"  # key set of the attention, one of transformer.KEY_SETS
    readout: str = "query"  # "query" (N-free) or "flatten" (the paper's; needs one N)
    d_model: int = 4  # residual width
    n_layers: int = 2  # blocks
    n_heads: int = 2  # heads per block
    init_scale: float = 0.3  # std of the N(0, std^2) init of every weight matrix
    embed_r_over_R: bool = True  # divide the R column of the embedding init by R
    precondition_R: float = 10.0  # > 0: Adam trains the R column in units where R = this (0: off)
    dtype: str = "float32"  # "float32" or "float64", for model and prompts
    # --- optimisation ---
    steps: int = 6000  # step budget
    batch_size: int = 512  # prompts per step
    lr: float = 3e-3  # peak Adam learning rate
    schedule: str = "onecycle"  # one of SCHEDULES
    warmup_frac: float = 0.05  # fraction of steps of linear warm-up (onecycle)
    clip: float = 1.0  # gradient-norm clip (0: off)
    l1: float = 0.0  # lambda of the l1 penalty on the weight matrices (>= 0)
    aug_scale: float = 1.0  # affine augmentation (icl_bench.augment): s = exp(U[-ln S, ln S]) (1: off)
    aug_shift: float = 0.0  # t ~ U[-T, T] (0: off); x, u -> s x + t, y and the OLS target unchanged
    aug_ramp: float = 0.0  # fraction of steps over which the range grows to full (0: full at once)
    l1_prox: float = 0.0  # proximal l1: soft threshold lr_t * l1_prox after each step (0: off)
    l1_start: float = 0.0  # fraction of steps before the proximal l1 starts
    # --- evaluation / stopping ---
    eval_every: int = 250  # steps between evaluations on the held-out prompts
    eval_prompts: int = 4096  # held-out prompts (fixed, per training N)
    stop_rel_mse: float = 0.0  # stop once held-out MSE vs OLS / var(OLS) <= this (0: never)
    progress: bool = True  # show a tqdm bar (loss, MSE vs OLS, sparsity)
    threads: int = 1  # torch threads (DESIGN section 8: one thread per run)

    def __post_init__(self):
        self.N = [self.N] if isinstance(self.N, int) else list(self.N)
        def bad(name, accepted):
            raise ConfigError(f"train.{name}: invalid value {getattr(self, name)!r}; accepted: {accepted}")
        for name in ("R", "noise", "init_scale", "precondition_R", "lr", "warmup_frac", "clip", "l1", "stop_rel_mse"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                bad(name, "a number")
        for name in ("layernorm", "embed_r_over_R", "progress"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "true, false")
        for name in ("name", "solver"):
            if not isinstance(getattr(self, name), str):
                bad(name, "a string")
        if not self.N or any(isinstance(n, bool) or not isinstance(n, int) or n < 2 for n in self.N):
            bad("N", "a non-empty list of integers >= 2")
        if not (isinstance(self.R, (int, float)) and math.isfinite(self.R) and self.R > 0):
            bad("R", "a finite number > 0")
        if not self.noise >= 0:
            bad("noise", "a number >= 0")
        for name, options in (("target", TARGETS), ("keys", KEY_SETS), ("readout", READOUTS), ("schedule", SCHEDULES)):
            if getattr(self, name) not in options:
                bad(name, ", ".join(options))
        if self.dtype not in ("float32", "float64"):
            bad("dtype", "float32, float64")
        if self.readout == "flatten" and len(self.N) != 1:
            bad("N", "exactly one N with readout='flatten' (it fixes the context length)")
        for name in ("steps", "batch_size", "eval_every", "eval_prompts", "threads", "d_model", "n_layers", "n_heads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad(name, "an integer >= 1")
        for name in ("lr", "init_scale"):
            if not getattr(self, name) > 0:
                bad(name, "a number > 0")
        for name in ("l1", "clip", "stop_rel_mse", "precondition_R"):
            if not getattr(self, name) >= 0:
                bad(name, "a number >= 0")
        if not 0 <= self.warmup_frac < 1:
            bad("warmup_frac", "a number in [0, 1)")
        check_fields(self)

    def model_config(self) -> TransformerConfig:
        """The TransformerConfig this run trains."""
        return TransformerConfig(
            d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads, layernorm=self.layernorm,
            keys=self.keys, readout=self.readout, N=self.N[0] if self.readout == "flatten" else None,
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "train") -> "TrainConfig":
        """Build from a dict; unknown keys raise ConfigError naming the accepted ones."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}: unknown key; accepted: {', '.join(names)}")
        return cls(**d)

    @classmethod
    def from_toml(cls, path: str, section: str | None = None) -> "TrainConfig":
        """Read `[defaults]` merged with `[runs.<section>]` (or a flat file when section is None)."""
        return cls.from_dict(load_runs(path, [section] if section else None)[0])


def load_runs(path: str, names: list[str] | None = None) -> list[dict]:
    """The runs of a training TOML: `[defaults]` + one `[runs.NAME]` table each -> list of dicts.

    A file with no [runs] table is one run (its top-level keys). `names` selects runs by name.
    Raises ConfigError for a missing/unreadable file or an unknown run name.
    """
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config: cannot read {path}: {exc}".replace("\n", " ")) from None
    if "runs" not in doc:
        return [doc]
    defaults = doc.get("defaults", {})
    runs = {name: {**defaults, "name": name, **table} for name, table in doc["runs"].items()}
    if names:
        missing = [n for n in names if n not in runs]
        if missing:
            raise ConfigError(f"runs: unknown run {missing[0]!r}; accepted: {', '.join(runs)}")
        return [runs[n] for n in names]
    return list(runs.values())


def init_model(cfg: TrainConfig) -> Transformer:
    """A Transformer with N(0, init_scale^2) weight matrices, LN gain 1 / bias 0, seeded.

    With embed_r_over_R the R column (index 2) of the embedding is divided by R, so the token
    (x, y, R) embeds to O(1) values: this is what lets training leave the R >= 10 plateau.
    """
    torch.manual_seed(cfg.seed)
    model = Transformer(cfg.model_config()).to(resolve_dtype(cfg.dtype))
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
    if cfg.schedule == "constant":  # noqa: E701
        return 1.0
    warm = int(cfg.warmup_frac * cfg.steps) if cfg.schedule == "onecycle" else 0
    if step < warm:
        return (step + 1) / warm
    t = (step - warm) / max(1, cfg.steps - warm)
    return 0.5 * (1 + math.cos(math.pi * t)) * (1 - 1e-3) + 1e-3


@torch.no_grad()
def evaluate(model: Transformer, held_out: list) -> dict[str, float]:
    """Held-out MSE vs OLS (absolute and divided by var(OLS)), averaged over the training N."""
    mse, rel = [], []
    for batch in held_out:
        ols = batch.ols_prediction
        err = (model(batch.tokens).double() - ols) ** 2  # (B,) float64
        ok = torch.isfinite(err)
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
        (held-out MSE vs OLS / var(OLS prediction)), sparsity (DESIGN section 3 threshold), lr,
        elapsed_s and steps_per_s. Evaluation happens every eval_every steps, at step 0 and at
        the end. Training stops at cfg.steps or once eval_rel_mse <= stop_rel_mse.
    Reproducibility: the same cfg (and thread count) gives the same weights; step t trains on
        sample_prompts(seed = cfg.seed * 1_000_000 + t).
    """
    torch.set_num_threads(cfg.threads)
    torch.set_flush_denormal(True)  # denormals slow CPU training > 10x (DESIGN section 8)
    dtype = resolve_dtype(cfg.dtype)
    model = init_model(cfg) if model is None else model
    precondition(model, cfg)
    model.train()
    specs = {n: PromptSpec(N=n, noise=cfg.noise, R=float(cfg.R)) for n in cfg.N}
    held_out = [sample_prompts(specs[n], cfg.eval_prompts, seed=cfg.seed + EVAL_SEED_OFFSET, dtype=dtype) for n in cfg.N]
    pick_n = random.Random(cfg.seed)  # which N each step trains on
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(cfg, s))
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
        pred = model(training_tokens(cfg, batch.tokens, step))  # (B,): x, u -> s x + t if augmenting
        mse = ((pred - target) ** 2).mean()
        loss = mse + cfg.l1 * sum(p.abs().sum() for p in penalised(model)) if cfg.l1 > 0 else mse
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip) if cfg.clip > 0 else None
        opt.step()
        prox_step(model, cfg, step, opt.param_groups[0]["lr"])  # proximal l1 (no-op when l1_prox = 0)
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


def train_and_save(cfg: TrainConfig, out_dir: str | Path) -> Path:
    """Train `cfg` and write the checkpoint `<out_dir>/<cfg.name>.{safetensors,json}`; returns the stem.

    The JSON carries the train config, R, N, seed, solver, the history, the final held-out
    metrics and `fresh_metrics` (noise 0.1, N in the default grid) for the model card.
    """
    from icl_bench.checkpoint import save_checkpoint  # local: checkpoint imports nothing from here

    model, history = train(cfg)
    final = history[-1]
    meta = {"solver": cfg.solver, "R": float(cfg.R), "N": cfg.N, "seed": cfg.seed, "train_config": cfg.to_dict(),
            "metrics": {**{k: final[k] for k in ("step", "eval_mse_vs_ols", "eval_rel_mse", "sparsity", "elapsed_s", "steps_per_s")},
                        "weight_l1": weight_l1(model.weight_matrices()), "fresh_noise0.1": fresh_metrics(model, cfg.R, n_prompts=cfg.eval_prompts)},
            "history": history}
    return save_checkpoint(model, Path(out_dir) / cfg.name, meta)


def add_train_command(subparsers) -> argparse.ArgumentParser:
    """Add `train` to an argparse subparsers object (the icl-bench CLI); handler in `main`."""
    p = subparsers.add_parser("train", help="train transformers from a TOML config and save checkpoints")
    p.add_argument("--config", default="benchmarks/train.toml", help="training TOML ([defaults] + [runs.NAME] tables)")
    p.add_argument("--out", default="results/models", help="directory for <name>.safetensors + <name>.json")
    p.add_argument("--run", action="append", default=None, help="train only this run (repeatable; default: all)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run_command)
    return p


def run_command(args) -> int:
    """Train every selected run of args.config one after another (one process, one thread)."""
    runs = load_runs(args.config, args.run)
    out = Path(args.out)  # check --out before hours of training, not after
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out: {out} exists and is not a folder")
    out.mkdir(parents=True, exist_ok=True)  # an OSError here is one line, exit 2 (cli.main)
    for d in runs:
        cfg = TrainConfig.from_dict({**d, "progress": d.get("progress", True) and not args.no_progress}, where="runs." + d.get("name", "?"))
        stem = train_and_save(cfg, args.out)
        meta = json.loads(Path(f"{stem}.json").read_text())["metrics"]
        print(f"{cfg.name}: {meta['step']} steps, held-out MSE vs OLS {meta['eval_mse_vs_ols']:.3e} "
              f"({meta['eval_rel_mse']:.2%} of var(OLS)), sparsity {meta['sparsity']:.2f} -> {stem}.safetensors", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m icl_bench.train ARGS` = `icl-bench train ARGS` (same parser, same errors)."""
    from icl_bench.cli import main as cli_main
    return cli_main(["train", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
