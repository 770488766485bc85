"""Stage 5, training: configs (config.py), the training loop (train.py) and the l1 sweep (sweep.py).
"""
