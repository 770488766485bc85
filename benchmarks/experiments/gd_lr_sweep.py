"""Learning-rate sweep that sets gd-lsa's / gd's default step size eta (icl_bench.solvers.gd_lsa.DEFAULT_LR).

    python -m benchmarks.experiments.gd_lr_sweep          # writes results/gd_lr_sweep.{csv,md}

Prompts: the default distribution (x, slope, intercept ~ N(0, 1)), noise 0.1, R = 100, float64,
4096 prompts per N, seed 0, masked key set. For every eta in ETAS and N in NS it runs the explicit
GD iterates (icl_bench_baselines/gd.py, equal to gd-lsa to ~1e-15) for K = 1..32 and records the MSE vs the
OLS prediction and the number of prompts on which GD diverges (eta * lambda_max(H) >= 2).

Selection rule (select_lr): among the etas under which no prompt diverges at any N in NS, take the
one with the smallest MSE vs OLS at K = 16 (the largest steps of the default matrix) and N = 30.
Why the stability filter: N = 10 is in the default matrix, and its prompts have the widest spread
of lambda_max; a single diverging prompt makes the MSE grow without bound in K.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch

from benchmarks.experiments.gd_analysis import hessian_eigenvalues, mse_by_step
from icl_bench import PromptSpec, sample_prompts
from icl_bench.solvers.gd_lsa import DEFAULT_LR

ETAS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2)
NS = (10, 30, 100)
KS = (1, 2, 4, 8, 16, 32)  # reported; every K = 1..32 is computed
K_SELECT, N_SELECT = 16, 30
NOISE, R, N_PROMPTS, SEED = 0.1, 100.0, 4096, 0


def lr_sweep(etas=ETAS, Ns=NS, k_max: int = 32, n_prompts: int = N_PROMPTS, seed: int = SEED) -> pd.DataFrame:
    """Long table: one row per (eta, N, K) with mse_vs_ols, n_unstable (prompts with
    eta * lambda_max >= 2) and n_prompts, K = 0..k_max."""
    rows = []
    for N in Ns:
        batch = sample_prompts(PromptSpec(N=N, noise=NOISE, R=R), n_prompts, seed=seed, dtype="float64")
        lam_max = hessian_eigenvalues(batch.x)[:, 1]  # (B,)
        for eta in etas:
            mse = mse_by_step(batch, k_max, eta)  # (k_max+1,)
            n_unstable = int((eta * lam_max >= 2).sum())
            rows += [dict(eta=eta, N=N, K=k, mse_vs_ols=float(mse[k]), n_unstable=n_unstable,
                          n_prompts=n_prompts) for k in range(k_max + 1)]
    return pd.DataFrame(rows)


def select_lr(df: pd.DataFrame, k: int = K_SELECT, N: int = N_SELECT) -> float:
    """The selection rule of the module docstring applied to a lr_sweep table."""
    stable = df.groupby("eta")["n_unstable"].max() == 0
    ok = df[df.eta.isin(stable[stable].index) & (df.K == k) & (df.N == N)]
    if ok.empty:
        raise ValueError("no eta in the sweep is stable on every prompt")
    return float(ok.loc[ok.mse_vs_ols.idxmin(), "eta"])


def to_markdown(df: pd.DataFrame, chosen: float) -> str:
    """One table per N: rows eta, columns MSE vs OLS at K in KS and the diverging-prompt count."""
    out = ["# gd / gd-lsa learning-rate sweep", "",
           f"Made by `python -m benchmarks.experiments.gd_lr_sweep`. Prompts: x, slope, intercept ~ N(0, 1), "
           f"noise {NOISE}, R {R:g}, float64, {N_PROMPTS} prompts per N, seed {SEED}, masked key set. "
           "Cells: MSE vs the OLS prediction after K GD steps (= K gd-lsa layers). "
           "`diverging`: prompts with eta * lambda_max(H) >= 2, H = [[1, mean x], [mean x, mean x^2]].", "",
           f"Rule: among the etas with no diverging prompt at any N, the smallest MSE at K = {K_SELECT}, "
           f"N = {N_SELECT}. **Chosen eta = {chosen:g}** (bold row).", ""]
    for N in sorted(df.N.unique()):
        sub = df[df.N == N]
        out += [f"## N = {N}", "", "| eta | " + " | ".join(f"K={k}" for k in KS) + " | diverging |",
                "|---:|" + "---:|" * (len(KS) + 1)]
        for eta in sorted(sub.eta.unique()):
            e = sub[sub.eta == eta].set_index("K")
            cells = [f"{e.loc[k, 'mse_vs_ols']:.2e}" for k in KS] + [str(int(e.n_unstable.iloc[0]))]
            name = f"**{eta:g}**" if eta == chosen else f"{eta:g}"
            out.append(f"| {name} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main(out_dir: str = "results") -> int:
    torch.set_num_threads(1)
    df = lr_sweep()
    chosen = select_lr(df)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "gd_lr_sweep.csv", index=False, float_format="%.6e")
    (out / "gd_lr_sweep.md").write_text(to_markdown(df, chosen))
    print(f"chosen eta = {chosen:g}; wrote {out / 'gd_lr_sweep.md'} and .csv")
    if chosen != DEFAULT_LR:
        print(f"WARNING: icl_bench.solvers.gd_lsa.DEFAULT_LR = {DEFAULT_LR:g} differs from the sweep's choice", file=sys.stderr)
        return 1
    return 0


def cli(argv=None):
    """Command line: --out DIR (default results/)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results", help="folder for gd_lr_sweep.csv and gd_lr_sweep.md (default: results)")
    return main(ap.parse_args(argv).out)


if __name__ == "__main__":
    sys.exit(cli())
