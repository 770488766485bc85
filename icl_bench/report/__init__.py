"""Stage 6, report: run folders (load.py) -> tables (aggregate.py), plots (plots.py,
model_plots.py) and a published folder (publish.py). Reads stored results and checkpoints only;
never re-runs a solver.
"""
