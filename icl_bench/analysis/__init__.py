"""Stage 4, analysis: does a model run the LayerNorm closed form? Weight-space similarity
(similarity.py), representation-space maps (representation.py), LayerNorm probes (probes.py) and
the combined report of a checkpoint (analyze.py).
"""
