"""Fingerprint and functional LayerNorm tests of the known solvers and the shipped checkpoints
(the validation tables of docs/analysis.md):

    python -m benchmarks.experiments.mechanism_known        # -> results/mechanism/known.{csv,md}

Prompts: N = 20, noise 0.1, R = 100, float64; fingerprint on 1024 prompts (seed 0), LayerNorm
tests on 4096 (seed 0). Checkpoints: the R = 100 ones in icl_bench/models/ (the shipped ones).
Controls: the construction with layer 1's centring off (its LayerNorm divides by the raw second
moment, not by Cxx), gd at step sizes other than its default 0.4, and gd at (K, lr) between
the grid points of the fingerprint (positive controls of its step-size fit), gd at step sizes
outside the fingerprint's range (0.1 - 0.8: what the GD-like verdict cannot see) and 12 random
initial models (negatives).
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch

from icl_bench.analysis.fingerprint import classify, default_prompts, gd_reference, profile
from icl_bench.analysis.lnfunc import ln_functional
from icl_bench.solvers.checkpoint import load_checkpoint
from icl_bench.solvers.gd_lsa import build_gd_construction
from icl_bench.solvers.ln_closed_form import build_construction
from icl_bench.solvers.registry import get_solver
from icl_bench.training.config import TrainConfig
from icl_bench.training.train import init_model

ROOT = Path(__file__).resolve().parents[2]  # the repository root


class Bare:
    def __init__(self, model):
        self.model = model.double()

    def predict(self, batch):
        return self.model(batch.tokens)


def main() -> None:
    torch.set_num_threads(1)
    R = 100.0
    batch = default_prompts(R=R, n_prompts=1024)
    gd = gd_reference(batch)
    rows = []

    def add(name, solver, model=None):
        fp = classify(profile(solver, batch), gd, batch)  # the step size fitted off the grid too
        row = {"solver": name, **{k: v for k, v in fp.row().items()}}
        if model is not None:
            row.update({f"ln.{k}": v for k, v in ln_functional(model, R).items()})
        rows.append(row)
        print(name, fp.verdict, row.get("ln.state", ""), flush=True)

    add("ols", get_solver("ols"))
    add("scipy-lstsq", get_solver("scipy-lstsq"))
    add("ln-closed-form", get_solver("ln-closed-form"), build_construction(R))
    unc = build_construction(R)  # negative control: layer 1's centring off, so layer 2 divides by mean x^2
    with torch.no_grad():
        unc.blocks[0].ln.weight.zero_()
    add("ln-closed-form, centring off", Bare(unc), unc)
    for k in (1, 4, 16):
        add(f"gd K={k}", get_solver("gd", steps=k))
        add(f"gd-lsa K={k}", get_solver("gd-lsa", steps=k), build_gd_construction(k, 0.4, R))
    add("gd K=16, lr 0.8", get_solver("gd", steps=16, lr=0.8))
    add("gd K=16, lr 0.1", get_solver("gd", steps=16, lr=0.1))
    for k, lr in ((12, 0.3), (16, 0.6), (24, 0.5), (48, 0.5)):  # between the grid's K and lr
        add(f"gd K={k}, lr {lr}", get_solver("gd", steps=k, lr=lr))
    for k, lr in ((4, 1.0), (64, 0.05)):  # outside the fingerprint's lr range 0.1-0.8: the detector's scope
        add(f"gd K={k}, lr {lr} (off range)", get_solver("gd", steps=k, lr=lr))
    for seed in range(12):
        m = init_model(TrainConfig(R=R, seed=seed))
        add(f"random init (seed {seed})", Bare(m), m)
    for path in sorted((ROOT / "icl_bench" / "models").glob("*-R100.json")):
        m, _ = load_checkpoint(path)
        add(path.stem, Bare(m), m)
    df = pd.DataFrame(rows)
    out = ROOT / "results" / "mechanism"
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "known.csv", index=False)
    cols = ["solver", "fp.identity", "fp.x*0.1", "fp.x*10", "fp.x+5", "fp.x+20", "fp.y*10", "fp.y*1+5", "fp.verdict",
            "fp.gd_steps", "fp.gd_lr", "fp.gd_distance", "fp.gd_max_gap", "fp.gd_worst_map", "ln.ln0.slope", "ln.ln1.slope", "ln.ln1.r2", "ln.ln1.r2_raw", "ln.ln0.freeze",
            "ln.ln1.freeze", "ln.effective_R", "ln.state"]
    text = ["# Fingerprint and functional LayerNorm tests of the known solvers", "",
            "Regenerate: `python -m benchmarks.experiments.mechanism_known` (R = 100, N = 20, noise 0.1, float64).", "",
            df[[c for c in cols if c in df]].to_markdown(index=False, floatfmt=".3g"), ""]
    (out / "known.md").write_text("\n".join(text))


if __name__ == "__main__":
    main()
