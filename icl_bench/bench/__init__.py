"""Stage 3, bench: the matrix config (config.py), the grid axes (axes.py) and result schema
(schema.py), cells and their keys (cells.py), the runner (runner.py), the run folder (store.py),
timing (timing.py) and per-cell metrics (metrics.py).
"""
