"""The l1 sweep: train over a lambda grid x seeds and tabulate what the penalty changes.

    icl-bench sweep --config l1_sweep            # train + table (the packaged config)
    icl-bench sweep --config l1_sweep --reuse    # the table again from the saved checkpoints

Config (TOML; fields in training/config.py):
    [sweep]  l1 = [...] (the lambda grid), seeds = [...], out = "l1_sweep" (a file stem,
             relative to the current folder: not a folder, not ending in "/"), eval_N = 30, eval_noise = 0.1, eval_prompts = 4096, analysis_prompts = 2048
    [train]  TrainConfig fields shared by every run (R, steps, ...); name/seed/l1 are set here.

Every run's checkpoint is saved under <out>_models/ (so --reuse can redo the table, e.g. once
the analysis module changes, without retraining; it refuses, before any training, a saved
checkpoint whose recorded train_config differs from the run the config now describes). Outputs: <out>.csv (one row per lambda x
seed) and <out>.md (mean and min..max over seeds per lambda); without --force, existing tables (with
--reuse: ones a sweep did not write) and (without --reuse) saved checkpoints are refused first. Columns: MSE vs OLS on fresh
prompts (absolute and / var(OLS)), weight sparsity (solvers/sparsity.py), L1 norm, and whatever
`icl_bench.analysis.analyze.analyze(model, R, seed=...)` returns (similarity to the construction,
probe R^2, Hoyer sparsity).
"""
from __future__ import annotations

import math
import os
import sys
import warnings
from pathlib import Path

import pandas as pd
import torch

from icl_bench.analysis.analyze import FEW_PROMPTS, analyze
from icl_bench.prompts.generator import PromptSpec, sample_prompts
from icl_bench.errors import ConfigError
from icl_bench.files import name_too_long, temp_path, write_atomic
from icl_bench.solvers.checkpoint import check_writable, load_checkpoint, read_meta
from icl_bench.solvers.sparsity import weight_l1, weight_sparsity
from icl_bench.startup import torch_threads
from icl_bench.training.config import Sweep, SweepConfig, TrainConfig, read_sweep, run_name
from icl_bench.training.train import train_and_save

# Columns of the markdown summary (the CSV keeps every column analyze returns).
MD_COLUMNS = ["l1", "seeds", "analysed", "n_nonfinite", "rel_mse", "rel_mse_range", "mse_vs_ols", "sparsity", "weight_l1", "hoyer", "similarity",
              "repr.layer0.r2_mean", "repr.layer1.r2_mean", "probe.centering.x.r2_stream", "probe.centering.y.r2_stream",
              "probe.division.r2", "probe.division.r2_stream", "ln.ln1.slope", "ln.ln1.freeze", "layer2_division"]


def row_for(stem: Path, sweep: Sweep) -> dict:
    """One table row for a saved sweep checkpoint."""
    model, meta = load_checkpoint(stem)
    R = float(meta["R"])
    batch = sample_prompts(PromptSpec(N=sweep.eval_N, noise=sweep.eval_noise, R=R), sweep.eval_prompts,
                           seed=3_000_000_000, dtype=next(model.parameters()).dtype)
    # one thread, as the analysis below: a resumed sweep (no training before it) gives the same row
    with torch.no_grad(), torch_threads(1):
        err = (model(batch.tokens).double() - batch.ols_prediction) ** 2  # (B,)
    ok = torch.isfinite(err)
    mse = float(err[ok].mean()) if bool(ok.any()) else math.nan
    w = model.weight_matrices()
    row = {"l1": meta["train_config"]["l1"], "seed": meta["seed"], "R": R, "steps": meta["metrics"]["step"],
           "mse_vs_ols": mse, "rel_mse": mse / float(batch.ols_prediction.var()),
           "n_nonfinite": int((~ok).sum()),  # prompts left out of mse_vs_ols: its mean is over the others
           "sparsity": weight_sparsity(w), "weight_l1": weight_l1(w)}
    try:
        with torch_threads(1), warnings.catch_warnings():  # (threads: many small ops, 4-8x faster on one)
            warnings.filterwarnings("ignore", message="n_prompts = ")  # said once by run_sweep, not per run
            warnings.filterwarnings("ignore", message="ln.rel_mse = ")  # the table's rel_mse column says it
            result = analyze(model, R, seed=int(meta["seed"]), n_prompts=sweep.analysis_prompts)
        row.update({k: v for k, v in result.items() if isinstance(v, (int, float)) and k not in row})
        row.update({k: result[k] for k in ("ln.state", "fp.verdict") if k in result})  # the mechanism verdicts
        row["layer2_division"] = int(result.get("ln.state") == "layer-2 division")  # its mean: the seeds' share
    except Exception as exc:  # record the failure in the table, keep the sweep
        row["analysis_error"] = f"{type(exc).__name__}: {exc}"
    return row


def summarise(table: pd.DataFrame) -> pd.DataFrame:
    """Per lambda: mean over seeds of every numeric column (a seed whose analysis failed adds
    nothing to the analysis columns), plus min..max of rel_mse; `n_nonfinite` summed over seeds
    and shown, like `analysed` (the seeds with an analysis), only where it is not the obvious."""
    num = table.drop(columns=["seed"]).select_dtypes("number")
    out = num.groupby("l1").mean()
    out.insert(0, "seeds", table.groupby("l1")["seed"].count())
    if "n_nonfinite" in table:
        out["n_nonfinite"] = table.groupby("l1")["n_nonfinite"].sum()
        if not out["n_nonfinite"].any():
            out = out.drop(columns="n_nonfinite")
    if "analysis_error" in table and table["analysis_error"].notna().any():  # the shares are of these seeds
        out.insert(1, "analysed", table.groupby("l1")["analysis_error"].apply(lambda s: int(s.isna().sum())))
    rng = table.groupby("l1")["rel_mse"].agg(["min", "max"])
    out.insert(out.columns.get_loc("rel_mse") + 1, "rel_mse_range", [f"{a:.2e}..{b:.2e}" for a, b in rng.values])
    return out.reset_index()


def markdown_table(df: pd.DataFrame) -> str:
    """A GitHub markdown table of `df` (numbers to 3 significant digits)."""
    cell = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def _one(table: pd.DataFrame, column: str) -> str:
    """The value of `column` shared by every analysed row, or 'n/a' (no row analysed)."""
    values = sorted({int(v) for v in table[column].dropna()}) if column in table.columns else []
    return ", ".join(map(str, values)) or "n/a"


def write_tables(table: pd.DataFrame, out: Path, sweep: Sweep, command: str) -> None:
    """<out>.csv (every run) and <out>.md (summary by lambda, with the command that made it)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(f"{out}.csv", table.to_csv(index=False).encode())  # a crash leaves the old table whole
    summary = summarise(table)
    summary = summary[[c for c in MD_COLUMNS if c in summary.columns]]
    note = ("hoyer, similarity (to the LN construction, symmetry-invariant; ~0.35 for random N(0, 1) weights, "
            "0.34-0.42 for the initialisation training starts from, see docs/analysis.md), repr.* (R^2 of linear maps to the construction's residual stream) "
            "and probe.* come from `icl_bench.analysis.analyze.analyze` "
            f"(N = {_one(table, 'N')}, {sweep.analysis_prompts} prompts; the mechanism tests at N = "
            f"{_one(table, 'mechanism_N')}); the probes are passed by any accurate model, the "
            "functional LayerNorm tests are the mechanism test: ln.ln1.slope (layer-2 LayerNorm std against "
            "log Cxx; the construction 1.000), ln.ln1.freeze (the state needs the error that freezing the "
            "std adds, freeze - the test's own rel_mse, >= 0.03; the construction reads 0.056 on 4096 "
            "prompts, 0.066 on 2048) and layer2_division, the share "
            "of seeds in the state 'layer-2 division' (docs/analysis.md).")
    lines = [f"# l1 sweep (R = {table.R.iloc[0]:g})", "", f"Made by: `{command}`", "",
             f"Evaluation: {sweep.eval_prompts} fresh prompts, N = {sweep.eval_N}, noise = {sweep.eval_noise}; "
             "rel_mse = MSE vs OLS / var(OLS prediction); sparsity = fraction of weights with |w| < 1e-3 max|w| "
             f"(all parameters incl. LayerNorm). Means over seeds {sorted(set(table.seed))}; per-run rows in "
             f"`{out.name}.csv`. {note}", "",
             markdown_table(summary), ""]
    write_atomic(f"{out}.md", "\n".join(lines).encode())


RUNTIME_ONLY = ("progress", "threads")  # TrainConfig fields that do not change what a run learns


def sweep_runs(cfg: SweepConfig, progress: bool = True) -> list[TrainConfig]:
    """The TrainConfig of every lambda x seed run, in table order."""
    return [TrainConfig.from_dict({"progress": progress, **cfg.train, "name": run_name(lam, seed), "seed": seed,
                                   "l1": float(lam)}) for lam in cfg.sweep.l1 for seed in cfg.sweep.seeds]


def check_reusable(run: TrainConfig, stem: Path) -> None:
    """Raise ConfigError unless the checkpoint `stem` was trained with `run`'s settings (its JSON's
    train_config; a field it does not record, added later, counts as its default; the runtime-only
    fields progress and threads are not compared)."""
    recorded = read_meta(stem).get("train_config")
    if not isinstance(recorded, dict):
        raise ConfigError(f"--reuse: {stem}.json records no train_config; drop --reuse to retrain it")
    defaults = TrainConfig().to_dict()
    for key, value in run.to_dict().items():
        if key not in RUNTIME_ONLY and recorded.get(key, defaults[key]) != value:
            raise ConfigError(f"--reuse: {stem}.json was trained with {key} = {recorded.get(key, defaults[key])!r}, "
                              f"the config now gives {value!r}; drop --reuse to retrain, or restore the setting")


TABLE_HEADS = {".md": "# l1 sweep (R = ", ".csv": "l1,seed,R,steps,mse_vs_ols,rel_mse,"}  # how write_tables begins each


def written_by_sweep(path: Path) -> bool:
    """Whether the file `path` begins as write_tables begins a sweep's table (a regular file, not a link)."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            first = f.readline(200).decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return first.startswith(TABLE_HEADS[path.suffix])


def check_out(out: str) -> None:
    """Raise ConfigError unless `out` ([sweep] out) names a file stem: not a path ending in a
    separator or in "." / ".." ("sw/" and "sw/." read as the stem "sw" wrote sw.md, sw.csv and
    sw_models/ beside the folder) nor an existing folder (its tables would land beside it)."""
    last = out.replace(os.sep, "/").split("/")[-1]  # pathlib reads "sw/." as "sw": look at the text
    if last in ("", ".", "..") or Path(out).is_dir():
        what = ("ends in a path separator" if not last else f"ends in {last!r}, a folder") if last in ("", ".", "..") \
            else "is an existing folder"
        raise ConfigError(f"sweep.out: must be a non-empty path ending in a file stem (got {out!r}, which {what}); "
                          f"the sweep writes <out>.md, <out>.csv and <out>_models/: e.g. {str(Path(out) / 'l1_sweep')!r}")
    why = name_too_long(temp_path(f"{out}.csv"), f"{out}_models")  # refused before training, not after it
    if why:
        raise ConfigError(f"sweep.out: too long to write <out>.csv and <out>_models/ ({why}); give a shorter out")


def check_overwrite(out: Path, reuse: bool, force: bool) -> None:
    """Raise ConfigError unless the tables <out>.md / <out>.csv may be written: absent, or force, or
    (reuse) written by a sweep (written_by_sweep): a user's notes.md is never replaced silently."""
    for path in (Path(f"{out}.md"), Path(f"{out}.csv")):
        if force or not (path.exists() or path.is_symlink()) or (reuse and written_by_sweep(path)):
            continue
        what = "exists and is not a table written by icl-bench sweep" if reuse else "already exists"
        raise ConfigError(f"sweep.out: {path} {what}; choose another out, or pass --force to overwrite it")


def run_sweep(config: str | Path, reuse: bool = False, progress: bool = True, force: bool = False,
              command: str | None = None) -> pd.DataFrame:
    """Train (or, with reuse, reload) every lambda x seed run and write the tables; returns the
    per-run table. Raises ConfigError, before any training, for a bad config, (reuse) a saved
    checkpoint trained with other settings than the config's, or, unless force, a checkpoint it
    would train over (without reuse) or a table it would overwrite (with reuse: one that is not a
    sweep's own, see written_by_sweep). `command`: the command line the tables name (default: one
    made from `config` and `reuse`)."""
    cfg = read_sweep(config)
    sweep = cfg.sweep
    check_out(sweep.out)
    out = Path(sweep.out)
    models = out.parent / (out.name + "_models")
    runs = sweep_runs(cfg, progress)
    reused = {run.name for run in runs if reuse and Path(f"{models / run.name}.safetensors").is_file()}
    accepted = set()  # runs whose old files this sweep may replace
    for run in runs:  # every saved checkpoint loads and fits, every new one can be saved, before any training
        if run.name in reused:
            try:
                check_reusable(run, models / run.name)
                load_checkpoint(models / run.name)
                continue
            except ConfigError as exc:  # a half pair, a damaged file, other [train] settings
                if not force:
                    raise ConfigError(f"{exc} (--reuse --force retrains this run over it)") from None
                reused.discard(run.name)  # --force: retrained, as its help says (it was refused; a review)
                print(f"--reuse --force: retraining {run.name} ({exc})", flush=True)
        check_writable(models / run.name, "sweep.out")
        old = [p for p in (Path(f"{models / run.name}{s}") for s in (".safetensors", ".json")) if p.exists()]
        # like train, a checkpoint is never trained over silently (with reuse only a lone .json is: a missing one)
        if old:
            accepted.add(run.name)  # (--force, or --reuse over a lone .json) any other pair is never replaced
        if old and not (force or reuse):
            raise ConfigError(f"sweep.out: {old[0]} already exists; pass --reuse to use the saved checkpoints, "
                              "--force to retrain over them, or choose another out")
    check_overwrite(out, reuse, force)
    their_files = [Path(f"{models / run.name}{x}") for run in runs for x in (".safetensors", ".json")]
    if reuse and runs and not any(p.exists() for p in their_files):
        # nothing of this sweep there, most likely the wrong folder: it trained the whole sweep in it (a tryout)
        raise ConfigError(f"--reuse: none of the {len(runs)} checkpoints of this sweep is in {models} (sweep.out is "
                          "relative to the current folder); run it from the folder the sweep was made in, or drop "
                          "--reuse to train them")
    if reuse and len(reused) < len(runs):  # --reuse trains what is missing: said, not done silently
        print(f"--reuse: {len(reused)} of {len(runs)} checkpoints found in {models}; training the other "
              f"{len(runs) - len(reused)}", flush=True)
    if sweep.analysis_prompts < FEW_PROMPTS:
        warnings.warn(f"sweep.analysis_prompts = {sweep.analysis_prompts}: the mechanism tests' thresholds were "
                      f"calibrated on 1024-4096 prompts; below {FEW_PROMPTS} ln.state and layer2_division can flip "
                      "with the seed", stacklevel=2)
    command = command or f"icl-bench sweep --config {config}" + (" --reuse" if reuse else "")
    rows, saved = [], len(reused)
    try:
        for run in runs:
            stem = models / run.name
            if run.name not in reused:
                train_and_save(run, models, replace=force or run.name in accepted, key="sweep.out",
                               where=f"train.lr (sweep run {run.name})")
                saved += 1
            rows.append(row_for(stem, sweep))
            r = rows[-1]
            print(f"{run.name}: rel_mse {r['rel_mse']:.2e}, sparsity {r['sparsity']:.2f}", flush=True)
    except KeyboardInterrupt:  # (main prints "interrupted"): what is saved, and the command that keeps it
        if saved:
            again = command if " --reuse" in command else f"{command} --reuse"
            print(f"icl-bench: {saved} of {len(runs)} checkpoints are saved in {models}; finish the sweep with:\n  "
                  f"{again}", file=sys.stderr, flush=True)
        raise
    table = pd.DataFrame(rows)
    write_tables(table, out, sweep, command)
    return table
