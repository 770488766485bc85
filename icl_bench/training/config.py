"""Training and sweep configs (pydantic models of the one config layer, icl_bench/config_base.py).

A training TOML holds `[defaults]` and one `[runs.NAME]` table per checkpoint (NAME is the file
stem); a file without [runs] is one run. A sweep TOML holds `[sweep]` (the lambda grid, seeds and
evaluation settings) and `[train]` (TrainConfig fields shared by every run). Field meanings and
the recipe: docs/training.md. Bad values raise ConfigError("train.<field>: ...").
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, model_validator

from icl_bench.config_base import (FLOAT_MAX, FLOAT_TINY, MAX_SEED, MAX_THREADS, ConfigModel, axis_list, choice, file_stem, flag,
                                   integer, number, problem, read_toml, validate)
from icl_bench.errors import ConfigError
from icl_bench.prompts.generator import MAX_VALUES
from icl_bench.solvers.checkpoint import stem_of
from icl_bench.solvers.trained import SOLVER_LAYERNORM, layernorm_name
from icl_bench.solvers.transformer import KEY_SETS, READOUTS, TransformerConfig

SCHEDULES = ("onecycle", "cosine", "constant")
TARGETS = ("ols", "noisy")
TRAINED_SOLVERS = ("", *SOLVER_LAYERNORM)  # what a checkpoint may serve ("" = none)

AUG_MAX = 1e6  # largest augmentation scale / shift: (1e6 x)^2 stays far inside float32 for x ~ N(0, 1)
MAX_WIDTH = 256  # d_model, n_layers, n_heads each: far beyond the 4 / 2 / 2 of the paper
# together they are bounded too: 256 of each is ~1.7e10 weights (69 GB in float32)
MAX_PARAMS = 2**24  # attention weights n_layers * n_heads * 4 * d_model^2 (the paper's model: 256); the eager
# forward's folded maps (solvers/transformer.py: Attention.folded_map, n_heads^2 * d_model^4 values a layer) are
# bounded by MAX_VALUES over all layers
MAX_ACTIVATIONS = MAX_VALUES  # batch_size * (N + 1) * n_layers * n_heads * 4 * d_model: q, k, v, out per head
# training derives its per-step prompt seeds as seed * 10^6 + step (+ up to 7 * 10^8, training/augment.py):
# steps <= 10^6 keeps each run's prompt seeds inside its own block of 10^6, so two training seeds never
# share a step's prompts (the paper's runs take 6000 steps; the augmentation streams reach into the blocks
# of seeds s + 500 and s + 700, docs/training.md); the seeds must stay 64-bit integers:
# seed <= MAX_TRAIN_SEED
MAX_STEPS = 10**6
MAX_TRAIN_SEED = (MAX_SEED - MAX_STEPS - 10**9) // 10**6
Int1 = Annotated[int, BeforeValidator(integer(1))]
Int2 = Annotated[int, BeforeValidator(integer(2))]  # a variance needs two: one held-out prompt gave NaN and a torch warning
Width = Annotated[int, BeforeValidator(integer(1, MAX_WIDTH))]
Pos = Annotated[float, BeforeValidator(number(gt=0))]
NonNeg = Annotated[float, BeforeValidator(number(ge=0))]
Flag = Annotated[bool, BeforeValidator(flag)]


def checkpoint_name(v: Any) -> str:
    """A run's `name`: a file stem (config_base.file_stem) that may end in one checkpoint suffix
    ("x.json" saves x.safetensors + x.json), not two: "x.json.json" was checked as x.json.* but
    saved as x.* (the suffix stripped twice), over another run's checkpoint (found by a review)."""
    v = file_stem(v)
    if stem_of(stem_of(v)) != stem_of(v):
        raise problem(f"bad name {v!r}: it ends in two checkpoint suffixes (.json, .safetensors); give the name "
                      f"without them, e.g. {stem_of(stem_of(v)).name!r}")
    return v


class TrainConfig(ConfigModel):
    """One training run (docs/training.md explains the recipe and every default)."""

    name: Annotated[str, BeforeValidator(checkpoint_name)] = "model"  # checkpoint file stem, e.g. "trained-l1-R10"
    solver: Annotated[str, BeforeValidator(choice(TRAINED_SOLVERS))] = ""  # the solver this checkpoint serves
    seed: Annotated[int, BeforeValidator(integer(0, MAX_TRAIN_SEED))] = 0  # init, per-step prompts, held-out prompts
    # --- prompts ---
    R: Pos = 10.0  # the embedding constant of every prompt
    N: Annotated[list[int], BeforeValidator(axis_list(integer(2), unique=False))] = [20]  # context lengths; a step draws one
    noise: NonNeg = 0.1  # label noise sigma of the training prompts
    target: Annotated[str, BeforeValidator(choice(TARGETS))] = "ols"  # regress on the OLS prediction, or the noisy y_query
    # --- model ---
    layernorm: Flag = True  # LN after attention in every block; left out: the solver's (False for trained-lsa)
    keys: Annotated[str, BeforeValidator(choice(KEY_SETS))] = "masked"  # key set of the attention
    readout: Annotated[str, BeforeValidator(choice(READOUTS))] = "query"  # "query" (N-free) or "flatten" (one N)
    d_model: Width = 4  # residual width
    n_layers: Width = 2  # blocks
    n_heads: Width = 2  # heads per block
    init_scale: Pos = 0.3  # std of the N(0, std^2) init of every weight matrix
    embed_r_over_R: Flag = True  # divide the R column of the embedding init by R
    precondition_R: NonNeg = 10.0  # > 0: Adam trains the R column in units where R = this (0: off)
    dtype: Annotated[str, BeforeValidator(choice(("float32", "float64")))] = "float32"  # model and prompts
    # --- optimisation ---
    steps: Annotated[int, BeforeValidator(integer(1, MAX_STEPS))] = 6000  # step budget
    batch_size: Int1 = 512  # prompts per step
    lr: Pos = 3e-3  # peak Adam learning rate
    schedule: Annotated[str, BeforeValidator(choice(SCHEDULES))] = "onecycle"
    warmup_frac: Annotated[float, BeforeValidator(number(ge=0, lt=1))] = 0.05  # linear warm-up fraction (onecycle)
    clip: NonNeg = 1.0  # gradient-norm clip (0: off)
    l1: NonNeg = 0.0  # lambda of the l1 penalty on the weight matrices
    # --- affine augmentation and proximal l1 (icl_bench/training/augment.py, docs/mechanism.md) ---
    aug_scale: Annotated[float, BeforeValidator(number(ge=1, le=AUG_MAX))] = 1.0  # x, u -> s x + t, s = exp(U[-ln S, ln S]) (1: off)
    aug_shift: Annotated[float, BeforeValidator(number(ge=0, le=AUG_MAX))] = 0.0  # t ~ U[-T, T] (0: off); y and the OLS target unchanged
    aug_y_scale: Annotated[float, BeforeValidator(number(ge=1, le=AUG_MAX))] = 1.0  # y -> c y + d, c = exp(U[-ln C, ln C]) (1: off)
    aug_y_shift: Annotated[float, BeforeValidator(number(ge=0, le=AUG_MAX))] = 0.0  # d ~ U[-D, D] (0: off); the OLS target maps with y
    aug_ramp: Annotated[float, BeforeValidator(number(ge=0, lt=1))] = 0.0  # fraction of steps to reach the full range
    l1_prox: NonNeg = 0.0  # proximal l1: soft threshold lr_t * l1_prox after each step (0: off)
    l1_start: Annotated[float, BeforeValidator(number(ge=0, lt=1))] = 0.0  # fraction of steps before it starts
    l1_stop: Annotated[float, BeforeValidator(number(gt=0, le=1))] = 1.0  # after this fraction: no shrinking, zeros kept
    # --- evaluation / stopping ---
    eval_every: Int1 = 250  # steps between evaluations on the held-out prompts
    eval_prompts: Int2 = 4096  # held-out prompts (fixed, per training N)
    stop_rel_mse: NonNeg = 0.0  # stop once held-out MSE vs OLS / var(OLS) <= this (0: never)
    progress: Flag = True  # show a tqdm bar (loss, MSE vs OLS, sparsity)
    threads: Annotated[int, BeforeValidator(integer(1, MAX_THREADS))] = 1  # torch threads (one per run: docs/training.md)

    @model_validator(mode="before")
    @classmethod
    def _solver_layernorm(cls, data: Any) -> Any:
        """layernorm left out follows the solver the run serves (SOLVER_LAYERNORM): trained-lsa has none."""
        if isinstance(data, dict) and "layernorm" not in data and isinstance(data.get("solver"), str):
            if data["solver"] in SOLVER_LAYERNORM:
                return {**data, "layernorm": SOLVER_LAYERNORM[data["solver"]]}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "TrainConfig":
        if self.solver and self.layernorm != SOLVER_LAYERNORM[self.solver]:  # the solver would be refused it
            raise problem(f"solver {self.solver!r} is {layernorm_name(SOLVER_LAYERNORM[self.solver])}; accepted: "
                          f"{str(SOLVER_LAYERNORM[self.solver]).lower()} (or leave it out)", key="layernorm")
        if self.readout == "flatten" and len(self.N) != 1:
            raise problem("needs exactly one N with readout = 'flatten' (it fixes the context length)", key="N")
        if self.l1_stop <= self.l1_start:
            raise problem(f"must be above l1_start = {self.l1_start:g} (a fraction of steps in (l1_start, 1])", key="l1_stop")
        if self.l1_stop < 1 and self.l1_prox <= 0:
            raise problem("needs l1_prox > 0 (it ends proximal l1; 1 = never)", key="l1_stop")
        if self.l1_prox > 0 and not prox_window(self):
            raise problem(f"(l1_start, l1_stop] x steps = ({self.l1_start * self.steps:g}, {self.l1_stop * self.steps:g}] "
                          "holds no step: widen it or raise steps", key="l1_stop")
        self._fits_dtype()
        weights = self.n_layers * self.n_heads * 4 * self.d_model**2
        if weights > MAX_PARAMS:
            raise problem(f"n_layers * n_heads * 4 * d_model^2 = {weights} attention weights exceed {MAX_PARAMS}; "
                          "lower d_model, n_layers or n_heads", key="d_model")
        folded = self.n_layers * self.n_heads**2 * self.d_model**4  # Attention.folded_map's K per layer
        if folded > MAX_VALUES:
            raise problem(f"n_layers * n_heads^2 * d_model^4 = {folded} values of the folded attention maps exceed "
                          f"{MAX_VALUES}; lower d_model, n_heads or n_layers", key="d_model")
        for key in ("batch_size", "eval_prompts"):  # one batch of prompts must fit in memory
            if getattr(self, key) * (max(self.N) + 1) > MAX_VALUES:
                raise problem(f"{key} * (N + 1) = {getattr(self, key) * (max(self.N) + 1)} prompt values exceed "
                              f"{MAX_VALUES}; lower {key} or N", key=key)
        acts = self.batch_size * (max(self.N) + 1) * self.n_layers * self.n_heads * 4 * self.d_model
        if acts > MAX_ACTIVATIONS:  # the values backpropagation keeps for one batch
            raise problem(f"batch_size * (N + 1) * n_layers * n_heads * 4 * d_model = {acts} activations exceed "
                          f"{MAX_ACTIVATIONS}; lower batch_size, N or the model's size", key="batch_size")
        return self

    def _fits_dtype(self) -> None:
        """R, precondition_R and the preconditioner's scale precondition_R / R (training/train.py:
        precondition) must be normal numbers of the model's dtype: a value that over- or underflows
        there fails in torch mid-training, or trains on an R column of 0 or inf."""
        lo, hi, dt = FLOAT_TINY[self.dtype], FLOAT_MAX[self.dtype], self.dtype
        if self.R > hi:
            raise problem(f"R={self.R:g} overflows {dt} (max {hi:.3g})", key="R")
        if self.R < lo:
            raise problem(f"R={self.R:g} underflows {dt} (min {lo:.3g})", key="R")
        if self.precondition_R and not lo <= self.precondition_R <= hi:
            raise problem(f"{self.precondition_R:g} is outside the {dt} range [{lo:.3g}, {hi:.3g}] (0: off)",
                          key="precondition_R")
        if self.precondition_R and not lo <= self.precondition_R / self.R <= hi:
            raise problem(f"precondition_R / R = {self.precondition_R:g} / {self.R:g} is outside the {dt} range "
                          f"[{lo:.3g}, {hi:.3g}]; bring precondition_R nearer R, or 0 (off)", key="precondition_R")

    def transformer_config(self) -> TransformerConfig:
        """The TransformerConfig this run trains."""
        return TransformerConfig(
            d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads, layernorm=self.layernorm,
            keys=self.keys, readout=self.readout, N=self.N[0] if self.readout == "flatten" else None,
        )

    @classmethod
    def from_dict(cls, d: dict, where: str = "train") -> "TrainConfig":
        """Validate a dict; ConfigError("<where>.<field>: ...") for unknown keys or bad values."""
        return validate(cls, d, where=where)

    @classmethod
    def from_toml(cls, path: str | Path, section: str | None = None) -> "TrainConfig":
        """Read `[defaults]` merged with `[runs.<section>]` (or a flat file when section is None)."""
        return cls.from_dict(load_runs(path, [section] if section else None)[0])


def prox_window(cfg: "TrainConfig") -> bool:
    """Whether some optimiser step t (1-based) lies in (l1_start, l1_stop] * steps, where proximal
    l1 thresholds (icl_bench/training/augment.py, ProxL1)."""
    return math.floor(cfg.l1_stop * cfg.steps) > math.floor(cfg.l1_start * cfg.steps)


def load_runs(path: str | Path, names: list[str] | None = None, *, labelled: bool = False) -> list:
    """The runs of a training TOML: `[defaults]` + one `[runs.NAME]` table each -> list of dicts
    (with `labelled`, of (where, dict): the table a run's fields are named under in errors,
    "runs.NAME", or "train" for a file with no [runs] table).

    A file with no [runs] table is one run (its top-level keys). `names` selects runs by name (a
    repeated name once).
    Raises:
        ConfigError: a missing / unreadable / invalid file, an unknown run name, or two selected
            runs whose names save one checkpoint (`name` "x" and "x.json" included).
    """
    doc = read_toml(path)
    if "runs" not in doc and "defaults" in doc:  # [defaults] is only ever the defaults of [runs.NAME] tables
        raise ConfigError("runs: missing; [defaults] needs at least one [runs.NAME] table to apply to")
    if "runs" not in doc:
        runs = {str(doc.get("name", "model")): doc}
    else:
        other = sorted(set(doc) - {"defaults", "runs"})  # a `[default]` typo dropped every default silently
        if other:
            raise ConfigError(f"{other[0]}: unknown key beside [runs]; accepted: defaults, runs (a run's settings "
                              "go in [defaults] or its [runs.NAME] table)")
        defaults = doc.get("defaults", {})
        if not isinstance(defaults, dict):
            raise ConfigError(f"defaults: must be a table (got {type(defaults).__name__})")
        if not isinstance(doc["runs"], dict) or not all(isinstance(t, dict) for t in doc["runs"].values()):
            raise ConfigError("runs: must hold one [runs.NAME] table per run")
        if not doc["runs"]:
            raise ConfigError("runs: empty table; give at least one [runs.NAME] table")
        for name in doc["runs"]:
            try:
                file_stem(name)
            except Exception:
                raise ConfigError(f"runs: bad run name {name!r}; accepted: letters, digits, '-', '_', '.' (not first), "
                                  "at most 200") from None
        runs = {name: {**defaults, "name": name, **table} for name, table in doc["runs"].items()}
    if names:
        missing = [n for n in names if n not in runs]
        if missing:
            raise ConfigError(f"--run: unknown run {missing[0]!r}; accepted: {', '.join(runs)}")
        runs = {n: runs[n] for n in dict.fromkeys(names)}  # `--run a --run a` trains a once
    saves: dict[str, str] = {}  # checkpoint stem -> the run that saves it
    for key, run in runs.items():  # two runs saving one pair: the second would overwrite the first
        stem = stem_of(run["name"]).name if isinstance(run.get("name"), str) else None
        if stem in saves:
            raise ConfigError(f"runs.{key}.name: runs {saves[stem]!r} and {key!r} both save the checkpoint {stem}; "
                              "give each run its own name")
        saves[stem] = key
    if labelled:
        return [("train" if "runs" not in doc else f"runs.{key}", run) for key, run in runs.items()]
    return list(runs.values())


def _table(v: Any) -> dict:
    if not isinstance(v, dict):
        raise problem(f"must be a table (got {type(v).__name__})")
    return v


def run_name(lam: float, seed: int) -> str:
    """The checkpoint stem of the sweep run (lambda, seed): lambda printed with `:g` (6 significant
    digits) without a '+' (not a file-stem character: 1e+16 is written 1e16; smaller lambdas have none)."""
    return f"l1-{lam:g}-seed{seed}".replace("+", "")


def _lambdas(v: Any) -> list[float]:
    if not isinstance(v, list) or not v:
        raise problem("needs a non-empty list of lambdas >= 0")
    lams = axis_list(number(ge=0))(v)  # repeated lambdas would train one run twice
    named: dict[str, float] = {}
    for lam in lams:  # lambdas that print alike share one checkpoint file and overwrite each other
        stem = run_name(lam, 0).removesuffix("-seed0")
        if stem in named:
            raise problem(f"{named[stem]!r} and {lam!r} share the checkpoint name {stem}-seed<S> "
                          "(lambdas are named with 6 significant digits); keep one or make them differ there")
        named[stem] = lam
    return lams


def _seeds(v: Any) -> list[int]:
    if not isinstance(v, list) or not v:
        raise problem("needs a non-empty list of integers >= 0")
    return axis_list(integer(0, MAX_TRAIN_SEED))(v)


def _out_path(v: Any) -> str:
    if not isinstance(v, str) or not v.strip() or Path(v).name in ("", ".", ".."):
        raise problem(f"must be a non-empty path ending in a file stem (got {v!r})")
    return v


class Sweep(ConfigModel):
    """The [sweep] table of an l1 sweep (training/sweep.py)."""

    l1: Annotated[list[float], BeforeValidator(_lambdas)]  # the lambda grid
    seeds: Annotated[list[int], BeforeValidator(_seeds)] = [0]
    out: Annotated[str, BeforeValidator(_out_path)] = "l1_sweep"  # tables <out>.csv / .md, checkpoints <out>_models/
    eval_N: Annotated[int, BeforeValidator(integer(2))] = 30
    eval_noise: NonNeg = 0.1
    eval_prompts: Int2 = 4096  # (one prompt: var(OLS) is NaN, and rel_mse with it; a review)
    analysis_prompts: Annotated[int, BeforeValidator(integer(8))] = 2048

    @model_validator(mode="after")
    def _fits(self) -> "Sweep":  # (analysis_prompts: read_sweep, which knows the N the analysis runs at)
        if self.eval_prompts * (self.eval_N + 1) > MAX_VALUES:
            raise problem(f"eval_prompts * (eval_N + 1) exceeds {MAX_VALUES} prompt values; lower it or eval_N",
                          key="eval_prompts")
        return self


class SweepConfig(ConfigModel):
    """A sweep TOML: [sweep] and [train] (TrainConfig fields shared by every run, except the
    name, seed and l1 that the sweep sets)."""

    sweep: Sweep
    train: Annotated[dict, BeforeValidator(_table)] = {}

    @model_validator(mode="after")
    def _train_fields(self) -> "SweepConfig":
        for key in ("name", "seed", "l1"):
            if key in self.train:
                raise problem("set by the sweep; accepted: any other TrainConfig field", key=f"train.{key}")
        # a [sweep] key below [train] (TOML puts it there) was "unknown key; did you mean 'seed'?" for
        # `seeds`, sending the user to a key the sweep refuses in [train] (a review)
        for key in self.train:
            if key in Sweep.model_fields and key not in TrainConfig.model_fields:
                raise problem(f"a [sweep] key; write it under [sweep] (accepted there: {', '.join(Sweep.model_fields)})",
                              key=f"train.{key}")
        return self


def read_sweep(path: str | Path) -> SweepConfig:
    """Read and validate a sweep TOML, its [train] table included (so a bad field fails before any
    training). Raises ConfigError (one line) for any problem."""
    cfg = validate(SweepConfig, read_toml(path))
    try:
        train = validate(TrainConfig, {**cfg.train, "seed": max(cfg.sweep.seeds), "l1": max(cfg.sweep.l1)}, where="train")
    except ConfigError as exc:  # name, seed and l1 are the sweep's: suggest where they are set, not the refused key
        msg = str(exc)
        for key, instead in (("l1", "[sweep] l1"), ("seed", "[sweep] seeds"), ("name", None)):
            hint = f"; did you mean {key!r}?"
            if msg.endswith(hint):
                msg = msg[:-len(hint)] + (f"; did you mean {instead}? (the sweep sets train.{key})" if instead else "")
        head, found, rest = msg.partition("unknown key; accepted: ")
        if found:  # nor are they listed as keys [train] accepts
            listed, semi, hint = rest.partition(";")
            msg = head + found + ", ".join(k for k in listed.split(", ") if k not in ("name", "seed", "l1")) + semi + hint
        raise ConfigError(msg) from None
    if train.readout == "flatten" and cfg.sweep.eval_N != train.N[0]:  # the evaluation raised after training
        raise ConfigError(f"sweep.eval_N: a flatten readout fixes the context length at train.N = {train.N[0]}; "
                          f"set eval_N = {train.N[0]} (got {cfg.sweep.eval_N})")
    from icl_bench.analysis.analyze import DEFAULT_N

    analysis_N = train.N[0] if train.readout == "flatten" else DEFAULT_N  # the N analyze runs at (sweep.row_for):
    if cfg.sweep.analysis_prompts * (analysis_N + 1) > MAX_VALUES:  # not eval_N, which refused 200000 prompts at
        raise ConfigError(  # eval_N = 1000 and let 3e7 through at eval_N = 2, each row then an error (a review)
            f"sweep.analysis_prompts: analysis_prompts * (N + 1) = {cfg.sweep.analysis_prompts * (analysis_N + 1)} "
            f"prompt values exceed {MAX_VALUES} (the analysis runs at N = {analysis_N}); lower it")
    out = Path(cfg.sweep.out)
    for target in (Path(f"{out}.csv"), Path(f"{out}.md"), out.parent / (out.name + "_models")):
        if target.exists() and target.is_dir() != target.name.endswith("_models"):
            raise ConfigError(f"sweep.out: {target} exists and is {'a folder' if target.is_dir() else 'a file'}")
    return cfg
