"""results/ood/mse_vs_ols.md: MSE vs OLS per solver (with its parameters) and OOD value, from the
run folder of `icl-bench run --config ood --out results/ood` (formats only, computes nothing).

    python -m benchmarks.experiments.ood_table [RUN_DIR]
"""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd


def main() -> None:
    run = Path(sys.argv[1] if len(sys.argv) > 1 else "results/ood")
    d = pd.read_csv(run / "results.csv")
    params = d["solver_params"].fillna("{}")
    series = d["solver"] + params.where(params != "{}", "")
    t = d.assign(solver=series).pivot_table(index="solver", columns="ood", values="mse_vs_ols")
    first = d.iloc[0]
    head = (f"# MSE vs OLS per solver and ood value (icl-bench run --config ood --out {run}; N {first['N']}, "
            f"R {first['R']:g}, noise {first['noise']:g}, {first['dtype']}, {first['n_prompts']} prompts)")
    (run / "mse_vs_ols.md").write_text(head + "\n\n" + t.to_markdown(floatfmt=".2g") + "\n")


if __name__ == "__main__":
    main()
