"""Calibration of the mechanism analysis: what similarity and representation numbers look like for
models that are (or are not) the LayerNorm construction.

    python -m benchmarks.experiments.similarity_calibration   # writes results/similarity_calibration.{csv,md}

Families (R = 100, masked key set, float64; the reference is build_construction(100)):
    moved        the construction moved by random exact symmetries (icl_bench.analysis.similarity.random_symmetry)
    noisy-5%     the construction + N(0, (0.05 max|w|)^2) per parameter tensor
    half         layer 1 of the construction, layer 2 (and its LN) N(0, 1)
    R=10, R=1000 build_construction(10) and (1000), compared with the R = 100 construction (on
                 R = 100 prompts they are wrong: layer 1's gain no longer undoes LN's 1/R)
    random       every parameter N(0, 1)
    sparse       N(0, 1) kept with probability 0.3
    uniform      U(-1, 1)
    init         what training starts from: icl_bench.training.train.init_model of the default
                 TrainConfig at R = 100 (N(0, 0.3^2) weight matrices, the R column of the embedding
                 divided by R, LN gain 1 and bias 0), seed = the model's seed
    shuffled     the construction with each weight matrix's entries permuted at random
                 (icl_bench.analysis.similarity.shuffle_entries: same values and zeros, no structure)
    gd-lsa       a structured negative: the 2-layer GD construction (build_gd_construction(2, lr, 100),
                 one head, no LayerNorm; docs/gd-lsa.md), lr = GD_STEP_SIZES[seed]; it runs GD, not the
                 closed form, yet it is sparse and built on the same token slots
    gd-lsa shuffled  its matched null: build_gd_construction(2, 0.4, 100) with each weight matrix's
                 entries permuted (shuffle_entries, seed = the model's seed)
For each model: the weight-space similarity and its components, and the representation-space
numbers after block 2 (icl_bench.analysis.representation.representation_similarity) on 1024 prompts (N 20,
noise 0.1, seed 0).
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import pandas as pd
import torch

from icl_bench import PromptSpec, sample_prompts
from icl_bench.analysis.representation import representation_similarity
from icl_bench.analysis.similarity import random_symmetry, shuffle_entries, similarity
from icl_bench.solvers.gd_lsa import build_gd_construction
from icl_bench.solvers.ln_closed_form import build_construction
from icl_bench.training.config import TrainConfig
from icl_bench.training.train import init_model

R, N, NOISE, N_PROMPTS = 100.0, 20, 0.1, 1024
SEEDS = {"moved": 10, "noisy-5%": 5, "half": 5, "R=10": 1, "R=1000": 1, "random": 20, "sparse": 10, "uniform": 10, "init": 10,
         "shuffled": 10, "gd-lsa": 4, "gd-lsa shuffled": 4}
GD_STEP_SIZES = (0.1, 0.2, 0.4, 0.8)  # lr of the gd-lsa family: the fingerprint's search range 0.1-0.8 (icl_bench/analysis/fingerprint.py)


def family(name: str, seed: int, ref):
    """One model of a family (module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    if name == "moved":
        return random_symmetry(ref, seed)[0]
    if name.startswith("R="):
        return build_construction(float(name[2:]))
    if name == "shuffled":
        return shuffle_entries(ref, seed)
    if name == "gd-lsa":
        return build_gd_construction(2, GD_STEP_SIZES[seed], R)
    if name == "init":
        return init_model(TrainConfig(R=R, seed=seed)).double()
    if name == "gd-lsa shuffled":
        return shuffle_entries(build_gd_construction(2, 0.4, R), seed)
    m = copy.deepcopy(ref)
    with torch.no_grad():
        for pname, p in m.named_parameters():
            z = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if name == "noisy-5%":
                p.add_(0.05 * float(p.abs().max()) * z)
            elif name == "half":
                if pname.startswith("blocks.1."):
                    p.copy_(z)
            elif name == "random":
                p.copy_(z)
            elif name == "sparse":
                p.copy_(z * (torch.rand(p.shape, generator=gen, dtype=p.dtype) < 0.3))
            elif name == "uniform":
                p.copy_(2 * torch.rand(p.shape, generator=gen, dtype=p.dtype) - 1)
    return m


def calibration_table() -> pd.DataFrame:
    """One row per model."""
    torch.set_num_threads(1)
    ref = build_construction(R)
    tokens = sample_prompts(PromptSpec(N=N, noise=NOISE, R=R), N_PROMPTS, seed=0, dtype="float64").tokens
    rows = []
    for name, n in SEEDS.items():
        for seed in range(n):
            model = family(name, seed, ref)
            score, align = similarity(model, ref, seed=seed)
            rep = representation_similarity(model, ref, tokens)
            rows.append({"family": name, "seed": seed, "similarity": score, **align["components"],
                         "r2_mean_block2": rep["repr.layer1.r2_mean"], "query_r2_s3_block2": rep["repr.layer1.query_r2.s3"],
                         "gp_block2": rep["repr.layer1.gp"], "r2_x_block1": rep["repr.layer0.r2.s0"],
                         "r2_y_block1": rep["repr.layer0.r2.s1"]})
    return pd.DataFrame(rows)


def markdown(table: pd.DataFrame) -> str:
    """Per family: models, similarity min / median / max, component and representation medians."""
    cols = ["embed", "layer0.out", "layer0.gram", "layer1.out", "layer1.gram", "readout",
            "r2_x_block1", "r2_y_block1", "r2_mean_block2", "query_r2_s3_block2", "gp_block2"]
    g = table.groupby("family", sort=False)
    lines = ["| family | models | similarity min | median | max | " + " | ".join(cols) + " |",
             "|---|---:|---:|---:|---:|" + "---:|" * len(cols)]
    for fam, d in g:
        s = d["similarity"]
        med = " | ".join(f"{d[c].median():.3f}" for c in cols)
        lines.append(f"| {fam} | {len(d)} | {s.min():.3f} | {s.median():.3f} | {s.max():.3f} | {med} |")
    return "\n".join(lines)


def main(out_dir: str = "results") -> None:
    table = calibration_table()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "similarity_calibration.csv", index=False)
    text = ["# Similarity calibration", "",
            "Made by `python -m benchmarks.experiments.similarity_calibration`. Reference: the LayerNorm "
            f"construction at R = {R:g} (masked). Representation numbers on {N_PROMPTS} prompts (N {N}, noise "
            f"{NOISE}, seed 0), held-out half; block 1 = after the first block, block 2 = after the second. "
            "Component columns and representation columns are medians over the family. Families: see the "
            "script's docstring; per-model rows in `similarity_calibration.csv`.", "", markdown(table), ""]
    (out / "similarity_calibration.md").write_text("\n".join(text))
    print("\n".join(text))


def cli(argv=None):
    """Command line: --out DIR (default results/)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results", help="folder for similarity_calibration.csv and similarity_calibration.md (default: results)")
    return main(ap.parse_args(argv).out)


if __name__ == "__main__":
    sys.exit(cli())
