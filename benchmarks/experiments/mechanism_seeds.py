"""The mechanism experiment: train each recipe of benchmarks/experiments/mechanism.toml over seeds, then
tabulate per seed the functional tests, the state, the behavioural verdict, the weight
similarity and the exact-zero fraction (docs/training.md, docs/analysis.md).

    python -m benchmarks.experiments.mechanism_seeds train --recipe ramp12k --seeds 0-9   # resumable
    python -m benchmarks.experiments.mechanism_seeds train --recipe ramp12k --seeds 0 --set l1_prox=0.1 --tag cal0.1
    python -m benchmarks.experiments.mechanism_seeds table   # -> results/mechanism/seeds.{csv,md}
    python -m benchmarks.experiments.mechanism_seeds table --reanalyse   # every row from its checkpoint again

Checkpoints: results/mechanism/models/<recipe>[-<tag>]-s<seed>.{safetensors,json}. Training runs
niced, one torch thread (the CPU is shared); an existing checkpoint is not retrained.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from icl_bench.training.config import TrainConfig, load_runs
from icl_bench.training.train import train_and_save

ROOT = Path(__file__).resolve().parents[2]  # the repository root
CONFIG = ROOT / "benchmarks" / "experiments" / "mechanism.toml"
OUT = ROOT / "results" / "mechanism"


def parse_seeds(text: str) -> list[int]:
    """'0-9' or '0,3,5' -> list of ints."""
    if "-" in text:
        a, b = text.split("-")
        return list(range(int(a), int(b) + 1))
    return [int(s) for s in text.split(",")]


def parse_set(items: list[str]) -> dict:
    """['l1_prox=0.3', 'steps=6000'] -> {'l1_prox': 0.3, 'steps': 6000} (JSON values)."""
    out = {}
    for item in items:
        key, value = item.split("=", 1)
        out[key] = json.loads(value)
    return out


def cmd_train(args) -> None:
    os.nice(10)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    recipe = load_runs(str(args.config), [args.recipe])[0]
    overrides = parse_set(args.set or [])
    name = args.recipe + (f"-{args.tag}" if args.tag else "")
    models = Path(args.out) / "models"
    for seed in parse_seeds(args.seeds):
        stem = models / f"{name}-s{seed}"
        if Path(f"{stem}.json").exists():
            print(f"{stem.name}: exists, skipped", flush=True)
            continue
        cfg = TrainConfig.from_dict({**recipe, **overrides, "name": stem.name, "seed": seed, "solver": ""})
        t0 = time.perf_counter()
        train_and_save(cfg, models)
        meta = json.loads(Path(f"{stem}.json").read_text())["metrics"]
        print(f"{stem.name}: {time.perf_counter() - t0:.0f} s, held-out rel MSE {meta['eval_rel_mse']:.2e}", flush=True)


def cmd_table(args) -> None:
    from benchmarks.experiments.mechanism_table import write_table

    torch.set_num_threads(1)
    write_table(Path(args.out), n_prompts=args.n_prompts, reanalyse=args.reanalyse)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train one recipe over seeds")
    t.add_argument("--recipe", required=True)
    t.add_argument("--seeds", default="0-9")
    t.add_argument("--set", action="append", help="override a field: key=JSON value (repeatable)")
    t.add_argument("--tag", default="", help="suffix of the checkpoint names (use with --set)")
    t.add_argument("--config", default=CONFIG)
    t.add_argument("--out", default=OUT)
    t.set_defaults(func=cmd_train)
    s = sub.add_parser("table", help="analyse every checkpoint -> seeds.csv / seeds.md")
    s.add_argument("--out", default=OUT)
    s.add_argument("--reanalyse", action="store_true", help="recompute every row from its checkpoint (default: "
                   "only checkpoints without a cached row in rows/ that is newer; the rest are read back)")
    s.add_argument("--n-prompts", type=int, default=4096)
    s.set_defaults(func=cmd_table)
    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
