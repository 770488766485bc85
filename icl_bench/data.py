"""Prompts from real data: a CSV file with an x and a y column.

Each prompt draws N + 1 distinct rows (seeded): the first N are the context, the last one the
query, whose observed y is the target. Real data has no clean truth, so y_query_clean, slope
and intercept are NaN and the runner reports mse_vs_truth = NaN. Rows with NaN / inf are kept:
they make degenerate prompts, which every solver must answer with NaN (see metrics.py).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import pandas as pd
import torch

from icl_bench.config import DataSource
from icl_bench.errors import ConfigError
from icl_bench.prompts import PromptBatch, make_batch


@lru_cache(maxsize=4)
def _columns(source: DataSource) -> tuple[np.ndarray, np.ndarray]:
    frame = pd.read_csv(source.resolve())
    return frame[source.x].to_numpy(np.float64), frame[source.y].to_numpy(np.float64)


def sample_data_prompts(source: DataSource, N: int, R: float, n_prompts: int, *, seed: int,
                        dtype="float32", device="cpu") -> PromptBatch:
    """Draw `n_prompts` prompts of N context rows + 1 query row from a CSV file.

    Returns:
        PromptBatch: x, y (B, N); x_query, y_query (B,) from the held-out row; the OLS reference
        from the context; truth fields NaN.
    Raises:
        ConfigError: the file has fewer than N + 1 rows.
    """
    xs, ys = _columns(source)
    if len(xs) < N + 1:
        raise ConfigError(f"grid.N: N={N} needs at least {N + 1} rows of data; {source.path} has {len(xs)}")
    rng = np.random.default_rng(seed)
    # (B, N+1) row indices, distinct within each prompt: argsort of uniform keys = random permutation
    idx = np.argsort(rng.random((n_prompts, len(xs))), axis=1)[:, : N + 1]
    x, y = xs[idx], ys[idx]  # (B, N+1)
    return make_batch(torch.from_numpy(x[:, :N]), torch.from_numpy(y[:, :N]), torch.from_numpy(x[:, N]),
                      R=R, dtype=dtype, device=device, y_query=torch.from_numpy(y[:, N]))
