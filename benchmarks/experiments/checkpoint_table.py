"""Model card of the shipped checkpoints: icl_bench/models/README.md from their JSON files.

    python -m benchmarks.experiments.checkpoint_table

Reads icl_bench/models/*.json (training metrics written by `icl-bench train`) and
results/models_analysis/*.json (written by `icl-bench analyze CHECKPOINT --out ...`) and writes
one markdown file with two tables. Nothing is computed here beyond formatting.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root
NS = (10, 30, 100, 300)
ANALYSIS = ["mse_vs_ols", "sparsity", "l1", "hoyer", "similarity", "repr.layer0.r2_mean", "repr.layer1.r2_mean",
            "probe.centering.x.r2_stream", "probe.centering.y.r2_stream", "probe.division.r2", "probe.division.r2_stream",
            "ln.ln1.slope", "ln.ln1.freeze", "ln.state", "fp.x+5", "fp.x*10", "fp.verdict"]


def _fmt(v) -> str:
    """A number to 3 significant digits, text as it is, a missing value (older analyses) as '—'."""
    return "—" if v is None else v if isinstance(v, str) else f"{v:.3g}"


def short_commit(commit) -> str:
    """A checkpoint's git_commit as the card shows it: 7 hex digits, `-dirty` kept; '—' if unrecorded."""
    if not isinstance(commit, str) or not commit:
        return "—"
    head, dirty = commit.removesuffix("-dirty"), commit.endswith("-dirty")
    return head[:7] + ("-dirty" if dirty else "")


def row(cells) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def main() -> None:
    models, analysis = ROOT / "icl_bench" / "models", ROOT / "results" / "models_analysis"
    head = ["checkpoint", "steps", "λ", "held-out MSE vs OLS", *(f"rel N={n}" for n in NS), "sparsity", "Σ\\|w\\|", "wall s", "steps/s",
            "commit"]
    lines = ["# Shipped checkpoints", "",
             "Made by `icl-bench train --config train --out icl_bench/models` (trained-l1: shipped from the seed experiment "
             "by `python -m benchmarks.experiments.ship_trained_l1`, the same configuration; docs/mechanism.md); this card by "
             "`python -m benchmarks.experiments.checkpoint_table`. rel = MSE vs OLS / var(OLS prediction) on 4096 "
             "fresh prompts per N (noise 0.1); wall time and steps/s were measured on a shared 2-core machine; commit: "
             "the git commit it was trained at (`-dirty`: with uncommitted edits in the checkout). trained-l1-R10 and "
             "-R1000 are derived from the R = 100 run (its embedding's R column rescaled): their held-out MSE, steps, wall "
             "time, steps/s and commit are that run's; rel, sparsity and Σ\\|w\\| are their own. trained-l1-noaug was "
             "trained and shipped as trained-l1 and renamed when the current trained-l1 replaced it (commit 24ee264): the "
             "`train_config` in its JSON keeps the solver and name it was trained under (`trained-l1`, `trained-l1-R10` "
             "...); retrain it with `--run trained-l1-noaug-R10` etc., whose [runs] tables name the new solver.", "",
             row(head), row(["---"] * len(head))]
    for path in sorted(models.glob("*.json")):
        meta = json.loads(path.read_text())
        m, fresh = meta["metrics"], meta["metrics"]["fresh_noise0.1"]
        lines.append(row([path.stem, m["step"], f"{meta['train_config']['l1']:g}" + (f", prox {meta['train_config']['l1_prox']:g}" if meta["train_config"].get("l1_prox") else ""), f"{m['eval_mse_vs_ols']:.2e}",
                          *(f"{100 * fresh[f'N={n}']['rel_mse']:.3f}%" for n in NS), f"{m['sparsity']:.3f}",
                          f"{m['weight_l1']:.1f}", f"{m['elapsed_s']:.0f}", f"{m['steps_per_s']:.1f}",
                          short_commit(meta.get("git_commit"))]))
    lines += ["", "## Mechanism analysis", "",
              "`icl-bench analyze <stem> --out results/models_analysis/<stem>.json` (defaults: 2048 "
              "prompts, N = 20, noise 0.1, seed 0). similarity: ~0.35 for random N(0, 1) weights, 0.34-0.42 "
              "for the initialisation training starts from, 1.0 for the construction (results/similarity_calibration.md).", "", row(["checkpoint", *ANALYSIS]), row(["---"] * (len(ANALYSIS) + 1))]
    for path in sorted(analysis.glob("*.json")):
        r = json.loads(path.read_text())
        lines.append(row([path.stem, *(_fmt(r.get(c)) for c in ANALYSIS)]))
    (models / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help only
    main()
