"""Stage 2, solvers: the contract (base.py), the registry (registry.py), the transformer module
(transformer.py) and its checkpoint format (checkpoint.py), the constructions (ln_closed_form.py,
gd_lsa.py), the checkpoint-backed trained-* solvers (trained.py) and weight sparsity (sparsity.py).
"""
