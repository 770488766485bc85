"""The l1 sweep: train over a lambda grid x seeds and tabulate what the penalty changes.

    python -m icl_bench.sweep --config benchmarks/l1_sweep.toml             # train + table
    python -m icl_bench.sweep --config benchmarks/l1_sweep.toml --reuse     # table from saved models

Config (TOML):
    [sweep]  l1 = [...] (the lambda grid), seeds = [...], out = "results/l1_sweep",
             eval_N = 30, eval_noise = 0.1, eval_prompts = 4096, analysis_prompts = 2048
    [train]  TrainConfig fields shared by every run (R, steps, ...); name/seed/l1 are set here.

Every run's checkpoint is saved under <out>/models/ (so --reuse can redo the table, e.g. once
the analysis module changes, without retraining). Outputs: <out>.csv (one row per lambda x
seed) and <out>.md (mean and min..max over seeds per lambda). Columns: MSE vs OLS on fresh
prompts (absolute and / var(OLS)), weight sparsity (DESIGN section 3), L1 norm, and whatever
`icl_bench.analysis.analyze(model, R, seed=...)` returns (similarity to the construction,
probe R^2, Hoyer sparsity); if that module is missing the table says so and has no such columns.
"""
from __future__ import annotations

import argparse
import importlib
import math
import sys
from pathlib import Path

import pandas as pd
import torch

from icl_bench.checkpoint import load_checkpoint
from icl_bench.config import tomllib  # tomllib, or tomli on Python 3.10
from icl_bench.errors import ConfigError
from icl_bench.metrics import weight_l1, weight_sparsity
from icl_bench.prompts import PromptSpec, sample_prompts
from icl_bench.train import TrainConfig, train_and_save

# Columns of the markdown summary (the CSV keeps every column analyze returns).
MD_COLUMNS = ["l1", "seeds", "rel_mse", "rel_mse_range", "mse_vs_ols", "sparsity", "weight_l1", "hoyer", "similarity",
              "repr.layer0.r2_mean", "repr.layer1.r2_mean", "probe.centering.x.r2_stream", "probe.centering.y.r2_stream",
              "probe.division.r2", "probe.division.r2_stream"]
SWEEP_KEYS = {"l1": None, "seeds": [0], "out": "results/l1_sweep", "eval_N": 30, "eval_noise": 0.1, "eval_prompts": 4096, "analysis_prompts": 2048}


def read_config(path: str) -> tuple[dict, dict]:
    """(sweep table with defaults filled in, train table). ConfigError for bad files or keys."""
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config: cannot read {path}: {exc}".replace("\n", " ")) from None
    sweep, trn = doc.get("sweep", {}), doc.get("train", {})
    unknown = sorted(set(sweep) - set(SWEEP_KEYS))
    if unknown:
        raise ConfigError(f"sweep.{unknown[0]}: unknown key; accepted: {', '.join(SWEEP_KEYS)}")
    sweep = {**SWEEP_KEYS, **sweep}
    lams = sweep["l1"]
    if not isinstance(lams, list) or not lams or not all(isinstance(v, (int, float)) and v >= 0 for v in lams):
        raise ConfigError("sweep.l1: needs a non-empty list of lambdas >= 0")
    if not isinstance(sweep["seeds"], list) or not sweep["seeds"] or not all(isinstance(s, int) for s in sweep["seeds"]):
        raise ConfigError("sweep.seeds: needs a non-empty list of integers")
    for key in ("name", "seed", "l1"):
        if key in trn:
            raise ConfigError(f"train.{key}: set by the sweep; accepted: any other TrainConfig field")
    return sweep, trn


def analyzer():
    """icl_bench.analysis.analyze if that module exists, else None (the table notes its absence)."""
    try:
        return importlib.import_module("icl_bench.analysis").analyze
    except (ImportError, AttributeError):
        return None


def row_for(stem: Path, sweep: dict, analyze) -> dict:
    """One table row for a saved sweep checkpoint."""
    model, meta = load_checkpoint(stem)
    R = float(meta["R"])
    batch = sample_prompts(PromptSpec(N=sweep["eval_N"], noise=sweep["eval_noise"], R=R), sweep["eval_prompts"],
                           seed=3_000_000_000, dtype=next(model.parameters()).dtype)
    with torch.no_grad():
        err = (model(batch.tokens).double() - batch.ols_prediction) ** 2  # (B,)
    ok = torch.isfinite(err)
    mse = float(err[ok].mean()) if bool(ok.any()) else math.nan
    w = model.weight_matrices()
    row = {"l1": meta["train_config"]["l1"], "seed": meta["seed"], "R": R, "steps": meta["metrics"]["step"],
           "mse_vs_ols": mse, "rel_mse": mse / float(batch.ols_prediction.var()),
           "sparsity": weight_sparsity(w), "weight_l1": weight_l1(w)}
    if analyze is not None:
        try:
            result = analyze(model, R, seed=int(meta["seed"]), n_prompts=sweep["analysis_prompts"])
            row.update({k: v for k, v in result.items() if isinstance(v, (int, float)) and k not in row})
        except Exception as exc:  # record the failure in the table, keep the sweep
            row["analysis_error"] = f"{type(exc).__name__}: {exc}"
    return row


def summarise(table: pd.DataFrame) -> pd.DataFrame:
    """Per lambda: mean over seeds of every numeric column, plus min..max of rel_mse."""
    num = table.drop(columns=["seed"]).select_dtypes("number")
    out = num.groupby("l1").mean()
    out.insert(0, "seeds", table.groupby("l1")["seed"].count())
    rng = table.groupby("l1")["rel_mse"].agg(["min", "max"])
    out.insert(out.columns.get_loc("rel_mse") + 1, "rel_mse_range", [f"{a:.2e}..{b:.2e}" for a, b in rng.values])
    return out.reset_index()


def markdown_table(df: pd.DataFrame) -> str:
    """A GitHub markdown table of `df` (numbers to 3 significant digits)."""
    cell = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def write_tables(table: pd.DataFrame, out: Path, sweep: dict, command: str, analysis_found: bool) -> None:
    """<out>.csv (every run) and <out>.md (summary by lambda, with the command that made it)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(f"{out}.csv", index=False)
    summary = summarise(table)
    summary = summary[[c for c in MD_COLUMNS if c in summary.columns]]
    note = ("hoyer, similarity (to the LN construction, symmetry-invariant; ~0.35 for random weights, see "
            "results/similarity_calibration.md), repr.* (R^2 of linear maps to the construction's residual stream) "
            "and probe.* come from `icl_bench.analysis.analyze` "
            f"(N = 20, {sweep['analysis_prompts']} prompts)." if analysis_found else
            "`icl_bench.analysis` was not available: no similarity / probe columns (rerun with --reuse once it is).")
    lines = [f"# l1 sweep (R = {table.R.iloc[0]:g})", "", f"Made by: `{command}`", "",
             f"Evaluation: {sweep['eval_prompts']} fresh prompts, N = {sweep['eval_N']}, noise = {sweep['eval_noise']}; "
             "rel_mse = MSE vs OLS / var(OLS prediction); sparsity = fraction of weights with |w| < 1e-3 max|w| "
             f"(all parameters incl. LayerNorm). Means over seeds {sorted(set(table.seed))}; per-run rows in "
             f"`{out.name}.csv`. {note}", "",
             markdown_table(summary), ""]
    Path(f"{out}.md").write_text("\n".join(lines))


def run_sweep(config: str, reuse: bool = False, progress: bool = True) -> pd.DataFrame:
    """Train (or, with reuse, reload) every lambda x seed run and write the tables; returns the per-run table."""
    sweep, trn = read_config(config)
    out = Path(sweep["out"])
    models = out.parent / (out.name + "_models")
    analyze = analyzer()
    rows = []
    for lam in sweep["l1"]:
        for seed in sweep["seeds"]:
            name = f"l1-{lam:g}-seed{seed}"
            stem = models / name
            if not (reuse and Path(f"{stem}.safetensors").is_file()):
                cfg = TrainConfig.from_dict({"progress": progress, **trn, "name": name, "seed": seed, "l1": float(lam)}, where="train")
                train_and_save(cfg, models)
            rows.append(row_for(stem, sweep, analyze))
            r = rows[-1]
            print(f"{name}: rel_mse {r['rel_mse']:.2e}, sparsity {r['sparsity']:.2f}", flush=True)
    table = pd.DataFrame(rows)
    command = f"python -m icl_bench.sweep --config {config}" + (" --reuse" if reuse else "")
    write_tables(table, out, sweep, command, analyze is not None)
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m icl_bench.sweep", description="l1 sweep: lambda grid x seeds -> table")
    p.add_argument("--config", default="benchmarks/l1_sweep.toml")
    p.add_argument("--reuse", action="store_true", help="reuse checkpoints already saved by an earlier sweep")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    try:
        run_sweep(args.config, reuse=args.reuse, progress=not args.no_progress)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
