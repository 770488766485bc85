"""Coverage of the report's 95 % interval of a mean MSE: how often it holds the true mean.

    python -m benchmarks.experiments.ci_coverage   # writes results/ci_coverage.{csv,md} (~3 min, 2 cores)

The report's interval (icl_bench/report/aggregate.py, module docstring) is normal theory: the
delta method on log(mean) with Student's t. Squared errors against OLS are heavy-tailed (a few
prompts with a large OLS answer carry most of the sum), so its coverage is a measured quantity,
not an assumption. For each cell (solver at noise 0.1, R = 100, float32, cpu: the headline's
setting, N = 30 and 100) this script
  1. estimates the true mean from 2^20 prompts (seeds 10000.., each the runner's prompts: sample_prompts),
  2. draws DRAWS independent cells of n prompts (seeds 100.., n = 512, the default matrix's
     n_prompts, and 4096), computes each cell's row with the runner's own metrics
     (icl_bench.bench.metrics.prediction_metrics) and its interval with the report's own code
     (aggregate._pooled), and counts the intervals that hold the step-1 mean;
  3. for n = 512, does the same with a BCa bootstrap interval (scipy.stats.bootstrap, 999
     resamples) over the cell's per-prompt squared errors, as a comparison.
It also gives the share of the step-1 sum that its top 1 % of prompts carry. A coverage below
0.95 by more than its binomial interval (beside it) means the interval is too narrow for these
errors. The step-1 mean has its own sampling error (its relative se is in the table); coverage
is counted against it as if it were exact.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from scipy import stats

from icl_bench import PromptSpec, get_solver, sample_prompts
from icl_bench.bench.metrics import prediction_metrics
from icl_bench.report.aggregate import _pooled

CELLS = [("ln-closed-form", {}), ("gd", {"steps": 16}), ("gd-lsa", {"steps": 4}), ("trained-l1", {}),
         ("trained-nol1", {})]
NS = (30, 100)
SIZES = (512, 4096)
DRAWS = 100
TRUTH = (16, 65536)  # batches x prompts: 2^20 prompts for the reference mean
OUT = Path("results")


def _errors(solver, spec: PromptSpec, n: int, seed: int) -> tuple[np.ndarray, dict]:
    """Per-prompt squared errors vs OLS (finite ones, float64) and the runner's metrics row."""
    b = sample_prompts(spec, n, seed=seed, dtype="float32")
    pred = solver.predict(b)
    row = prediction_metrics(pred, b)
    e = ((pred.double() - b.ols_prediction.double()) ** 2).numpy()
    return e[np.isfinite(e)], {**row, "n_prompts": n}


def cell(name: str, params: dict, N: int, draws: int) -> list[dict]:
    """Coverage rows of one solver and N (one per n in SIZES)."""
    solver = get_solver(name, **params)
    spec = PromptSpec(N=N, noise=0.1, R=100.0)
    big = np.concatenate([_errors(solver, spec, TRUTH[1], 10_000 + i)[0] for i in range(TRUTH[0])])
    truth, truth_se = big.mean(), big.std(ddof=1) / math.sqrt(big.size)
    top = np.sort(big)[::-1][: big.size // 100].sum() / big.sum()
    out = []
    for n in SIZES:
        hit, boot, width = [], [], []
        for k in range(draws):
            e, row = _errors(solver, spec, n, 100 + k)
            ci = _pooled(pd.DataFrame([row]), "mse_vs_ols")
            hit.append(ci["mse_vs_ols_ci_low"] <= truth <= ci["mse_vs_ols_ci_high"])
            width.append(ci["mse_vs_ols_ci_high"] / ci["mse_vs_ols_ci_low"])
            if n == SIZES[0]:
                b = stats.bootstrap((e,), np.mean, n_resamples=999, method="BCa", random_state=k).confidence_interval
                boot.append(b.low <= truth <= b.high)
        c = float(np.mean(hit))
        lo, hi = stats.binomtest(int(sum(hit)), draws).proportion_ci(0.95)
        out.append({"solver": name, "params": ", ".join(f"{a}={v}" for a, v in params.items()), "N": N,
                    "n_prompts": n, "draws": draws, "true_mean": truth, "true_mean_rel_se": truth_se / truth,
                    "top1pct_share": top, "coverage": c, "coverage_ci_low": lo, "coverage_ci_high": hi,
                    "median_high_over_low": float(np.median(width)),
                    "bca_coverage": float(np.mean(boot)) if boot else math.nan})
        print(f"{name} {params or ''} N={N} n={n}: coverage {c:.2f} [{lo:.2f}, {hi:.2f}]"
              + (f", BCa {np.mean(boot):.2f}" if boot else ""), flush=True)
    return out


def to_markdown(df: pd.DataFrame) -> str:
    """The table of results/ci_coverage.md."""
    show = df.assign(coverage=[f"{c:.2f} [{lo:.2f}, {hi:.2f}]" for c, lo, hi in
                               zip(df.coverage, df.coverage_ci_low, df.coverage_ci_high)],
                     true_mean=[f"{m:.3g} (± {s:.1%})" for m, s in zip(df.true_mean, df.true_mean_rel_se)],
                     top1pct_share=[f"{t:.0%}" for t in df.top1pct_share],
                     median_high_over_low=[f"{w:.2f}" for w in df.median_high_over_low],
                     bca_coverage=["" if v != v else f"{v:.2f}" for v in df.bca_coverage])
    cols = ["solver", "params", "N", "n_prompts", "draws", "true_mean", "top1pct_share", "coverage",
            "median_high_over_low", "bca_coverage"]
    return show[cols].rename(columns={"true_mean": "true mean (rel. se)", "top1pct_share": "top 1 % share",
                                      "coverage": "coverage of the report's 95 % CI [binomial 95 %]",
                                      "median_high_over_low": "median high / low",
                                      "bca_coverage": "BCa bootstrap coverage"}).to_markdown(index=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=DRAWS)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    df = pd.DataFrame([r for name, params in CELLS for N in NS for r in cell(name, params, N, a.draws)])
    a.out.mkdir(parents=True, exist_ok=True)
    df.to_csv(a.out / "ci_coverage.csv", index=False)
    head = ("# Coverage of the report's 95 % interval of a mean MSE\n\n"
            "Written by `python -m benchmarks.experiments.ci_coverage` (seeds fixed in the script; its "
            "docstring gives the method). noise 0.1, R = 100, float32, cpu. A cell of n prompts is one "
            f"seed of the runner; {a.draws} independent cells per row; the true mean from 2^20 prompts.\n\n")
    (a.out / "ci_coverage.md").write_text(head + to_markdown(df) + "\n")
    print(f"wrote {a.out / 'ci_coverage.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
