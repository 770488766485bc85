"""The seed table of the mechanism experiment (called by `mechanism_seeds.py table`).

One row per checkpoint in results/mechanism/models/: recipe, seed, relative MSE vs OLS (N = 20,
un-augmented prompts), the functional LayerNorm tests (icl_bench.analysis.lnfunc), the state, the
behavioural fingerprint (icl_bench.analysis.fingerprint) with its verdict and the issue's +5 / x10
scores, the weight similarity to the construction (icl_bench.analysis.similarity), the exact-zero fraction
and the success flag. Success (docs/mechanism.md): relative MSE <= 1e-2, layer-2 slope >= 0.95
with R^2 >= 0.9 and above the raw second moment's R^2, layer-2 freeze >= 0.03, x+5 <= 0.01 and
x*10 <= 0.05.
Writes seeds.csv (every column) and seeds.md (the headline columns and a per-recipe summary).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pandas as pd

from icl_bench.analysis.fingerprint import classify, default_prompts, gd_reference, profile, transforms
from icl_bench.analysis.lnfunc import ln_functional
from icl_bench.analysis.similarity import similarity
from icl_bench.solvers.checkpoint import load_checkpoint
from icl_bench.solvers.ln_closed_form import build_construction
from icl_bench.training.augment import exact_zero_fraction

SUCCESS = ("rel_mse <= 1e-2, ln1.slope >= 0.95, ln1.r2 >= 0.9, ln1.r2 > ln1.r2_raw, ln1.freeze >= 0.03, "
           "fp.x+5 <= 0.01, fp.x*10 <= 0.05")


def success(r: dict) -> bool:
    """The success criterion of the module docstring."""
    return bool(r["rel_mse"] <= 1e-2 and r.get("ln1.slope", 0) >= 0.95 and r.get("ln1.r2", 0) >= 0.9
                and not r.get("ln1.r2_raw", math.nan) >= r.get("ln1.r2", 0)
                and r.get("ln1.freeze", 0) >= 0.03 and r["fp.x+5"] <= 0.01 and r["fp.x*10"] <= 0.05)


class _ModelSolver:
    """predict(batch) of a bare Transformer (the fingerprint needs only that)."""

    def __init__(self, model):
        self.model = model

    def predict(self, batch):
        return self.model(batch.tokens.to(next(self.model.parameters()).dtype))


def functional(model, R: float, gd_cache: dict, n_prompts: int) -> dict:
    """The functional columns of a row: LayerNorm tests, fingerprint (against gd over K and lr)
    and the success flag's inputs; the cheap part of `analyse`."""
    N = model.cfg.N if model.cfg.readout == "flatten" else 20
    row = ln_functional(model, R, N=N, n_prompts=n_prompts)
    batch = default_prompts(N=N, R=R, n_prompts=1024)
    if (R, N) not in gd_cache:
        gd_cache[(R, N)] = gd_reference(batch)
    fp = classify(profile(_ModelSolver(model.double()), batch), gd_cache[(R, N)])
    row.update(fp.row())
    x_maps = [t.name for t in transforms() if t.name.startswith("x")]
    row["fp.max_x"] = max(fp.scores[k] for k in x_maps)
    row["fp.max_y"] = max(v for k, v in fp.scores.items() if k.startswith("y"))
    return row


def analyse(path: Path, gd_cache: dict, n_prompts: int) -> dict:
    """One row of the table for the checkpoint at `path` (the module docstring's columns)."""
    model, meta = load_checkpoint(path)
    name = path.name.removesuffix(".json")
    m = re.match(r"(.+)-s(\d+)$", name)
    R = float(meta["R"])
    row = {"recipe": m.group(1), "seed": int(m.group(2)), "R": R, "readout": model.cfg.readout,
           "steps": meta["train_config"]["steps"], "l1_prox": meta["train_config"].get("l1_prox", 0.0)}
    row.update(functional(model, R, gd_cache, n_prompts))
    try:
        row["similarity"] = similarity(model.double(), build_construction(R, model.cfg.keys), seed=0)[0]
    except Exception as exc:  # a model the similarity cannot align (reported, not hidden)
        row["similarity"], row["similarity_error"] = math.nan, str(exc)
    row["exact_zero"] = exact_zero_fraction(model)
    row["success"] = success(row)
    return row


def _stale(row: dict) -> bool:
    """A cached row written before the LayerNorm tests had r2_raw or the fingerprint had its lr grid."""
    return "fp.gd_lr" not in row or ("ln1.r2_raw" not in row and row.get("ln1.r2") is not None)


def write_table(out: Path, n_prompts: int = 4096) -> pd.DataFrame:
    """Analyse every checkpoint under out/models and write out/seeds.csv and out/seeds.md."""
    rows, gd_cache = [], {}
    (out / "rows").mkdir(exist_ok=True)
    for path in sorted((out / "models").glob("*.json")):
        cache = out / "rows" / path.name  # one analysed row per checkpoint, redone if the checkpoint is newer
        if cache.exists() and cache.stat().st_mtime >= path.stat().st_mtime:
            rows.append(json.loads(cache.read_text()))
            if _stale(rows[-1]):  # redo the functional columns only (the similarity is the slow part)
                model, meta = load_checkpoint(path)
                rows[-1].update(functional(model, float(meta["R"]), gd_cache, n_prompts))
                rows[-1]["success"] = success(rows[-1])
                cache.write_text(json.dumps(rows[-1], allow_nan=True))
            continue
        rows.append(analyse(path, gd_cache, n_prompts))
        cache.write_text(json.dumps(rows[-1], allow_nan=True))
        print(f"{path.name}: {rows[-1]['state']}, {rows[-1]['fp.verdict']}, success={rows[-1]['success']}", flush=True)
    df = pd.DataFrame(rows).sort_values(["recipe", "seed"])
    df.to_csv(out / "seeds.csv", index=False)
    cols = ["recipe", "seed", "rel_mse", "ln0.slope", "ln1.slope", "ln1.r2", "ln1.r2_raw", "ln0.freeze", "ln1.freeze", "effective_R",
            "state", "fp.x+5", "fp.x*10", "fp.max_x", "fp.max_y", "fp.verdict", "similarity", "exact_zero", "success"]
    summary = df.groupby("recipe").agg(R=("R", "first"), readout=("readout", "first"), seeds=("seed", "count"),
                                       successes=("success", "sum"),
                                       layer2_division=("state", lambda v: int((v == "layer-2 division").sum())),
                                       closed_form_like=("fp.verdict", lambda v: int((v == "closed-form-like").sum())),
                                       gd_like=("fp.verdict", lambda v: int((v == "GD-like").sum())),
                                       median_rel_mse=("rel_mse", "median"), median_exact_zero=("exact_zero", "median"),
                                       median_similarity=("similarity", "median")).reset_index()
    text = ["# Mechanism seed table", "",
            "Regenerate: `python -m benchmarks.experiments.mechanism_seeds table` (after the `train` commands",
            "in benchmarks/experiments/README.md; recipes in benchmarks/experiments/mechanism.toml). Every checkpoint is listed.", "",
            f"Success: {SUCCESS}.", "", "## Per recipe", "", summary.to_markdown(index=False, floatfmt=".3g"), "",
            "## Per seed", "", df[[c for c in cols if c in df]].to_markdown(index=False, floatfmt=".3g"), ""]
    (out / "seeds.md").write_text("\n".join(text))
    return df
