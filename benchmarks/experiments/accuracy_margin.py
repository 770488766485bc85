"""How close the OLS reference and the `ols` solver come to their error bound (N + 4) u K.

    python -m benchmarks.experiments.accuracy_margin [--prompts 400] [--seed 0]

Random prompts like tests/test_accuracy_properties.py's (N 2..2000, offsets 0..1e12 in units of
the spread, scales 1e-150..1e150 / 1e-30..1e30, normal / few-values / outlier / sorted shapes),
each compared with its exact rational OLS (icl_bench/prompts/exact_ols.py). Prints, per (solver, dtype), the
largest ratio |error| / ((N + 4) u K) and the largest |error| / (u K) seen: the margin of the
documented bound (docs/accuracy.md). Takes ~15 s.
"""
from __future__ import annotations

import argparse
import math
import warnings

import numpy as np
import torch

from icl_bench.prompts.exact_ols import exact_ols
from icl_bench.prompts.ols import ols_predict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)  # float32 casts to inf
    rng = np.random.default_rng(args.seed)
    worst: dict = {}
    degenerate = 0
    for it in range(args.prompts):
        N = int(rng.choice([2, 3, 5, 10, 50, 300, 2000]))
        dt = (np.float32, np.float64)[it % 2]
        lim = 150 if dt == np.float64 else 30
        sx, sy = 10.0 ** rng.integers(-lim, lim + 1), 10.0 ** rng.integers(-lim, lim + 1)
        offset = 0.0 if rng.random() < 0.3 else 10 ** rng.uniform(-1, 12)
        shape = rng.integers(0, 4)
        z = (rng.normal(size=N), rng.integers(0, 3, size=N).astype(float),
             np.where(rng.random(N) < 0.05, 30 * rng.normal(size=N), rng.normal(size=N)),
             np.sort(rng.normal(size=N))[::-1].copy())[shape]
        x = (sx * (offset + z)).astype(dt)
        y = (sy * (rng.normal() + rng.normal() * z + rng.uniform(0, 1) * rng.normal(size=N))).astype(dt)
        u = dt(sx * (offset + 2 * rng.normal()))
        if not (np.isfinite(x).all() and np.isfinite(y).all() and np.isfinite(u)):
            continue  # out of the dtype's range: ill-posed, NaN (checked by the tests)
        exact = exact_ols(x.tolist(), y.tolist(), float(u))
        if exact is None:
            degenerate += 1
            continue
        for name, cdt in (("reference (float64)", torch.float64), ("ols", torch.float32 if dt == np.float32 else torch.float64)):
            p = float(ols_predict(torch.tensor(x, dtype=cdt)[None], torch.tensor(y, dtype=cdt)[None],
                                  torch.tensor([float(u)], dtype=cdt))[0])
            unit = 2.0**-53 if cdt == torch.float64 else 2.0**-24
            if exact.k == 0:
                continue
            e = exact.err(p) / (unit * exact.k)
            key = (name, np.dtype(dt).name)
            w = worst.setdefault(key, [0.0, 0.0, 0])
            w[0], w[1], w[2] = max(w[0], e / (N + 4)), max(w[1], e), w[2] + 1
    print(f"{args.prompts} prompts, seed {args.seed}, {degenerate} exactly degenerate (NaN, as required)")
    print("| solver | data dtype | prompts | max err / ((N+4) u K) | max err / (u K) |")
    print("|---|---|---|---|---|")
    for (name, dt), (a, b, n) in sorted(worst.items()):
        print(f"| {name} | {dt} | {n} | {a:.3f} | {b:.2f} |")
    assert all(math.isfinite(v[0]) for v in worst.values())


if __name__ == "__main__":
    main()
