"""Classical baselines for icl-bench, registered through the `icl_bench.solvers` entry-point
group exactly as a third-party plugin would be (see pyproject.toml)."""
