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
    csv = run / "results.csv"
    if not csv.is_file():
        sys.exit(f"ood_table: no {csv} (run `icl-bench run --config ood --out {run}` first)")
    try:
        d = pd.read_csv(csv)
    except pd.errors.EmptyDataError:
        d = pd.DataFrame()
    need = {"solver", "solver_params", "ood", "mse_vs_ols", "N", "R", "noise", "dtype", "n_prompts"}
    if d.empty or not need <= set(d.columns):
        sys.exit(f"ood_table: {csv} has no rows or lacks the columns {sorted(need - set(d.columns))} of an OOD run")
    mixed = [c for c in ("N", "R", "noise", "dtype", "d") if c in d and d[c].nunique() > 1]
    if mixed:
        sys.exit(f"ood_table: {csv} mixes several values of {mixed}; the table is for one setting")
    params = d["solver_params"].fillna("{}")
    series = d["solver"] + params.where(params != "{}", "")
    t = d.assign(solver=series).pivot_table(index="solver", columns="ood", values="mse_vs_ols")
    first = d.iloc[0]
    head = (f"# MSE vs OLS per solver and ood value (icl-bench run --config ood --out {run}; N {first['N']}, "
            f"R {first['R']:g}, noise {first['noise']:g}, {first['dtype']}, {first['n_prompts']} prompts)")
    (run / "mse_vs_ols.md").write_text(head + "\n\n" + t.to_markdown(floatfmt=".2g") + "\n")


if __name__ == "__main__":
    main()
