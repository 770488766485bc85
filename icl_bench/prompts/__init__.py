"""Stage 1, prompts: the shared prompt generator (generator.py), the float64 OLS reference
(ols.py) and the CSV data source (data.py). Imports nothing from the later stages.
"""
