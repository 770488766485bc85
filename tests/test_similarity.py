"""Weight similarity to the construction (icl_bench/analysis/similarity.py): its alignment JSON,
the cosine of components zero in both models, the shuffled null and the d_model bound."""
import pytest
import torch

from icl_bench.errors import ConfigError
from icl_bench.solvers.transformer import Transformer, TransformerConfig
from tests.transformer_models import random_model


def test_alignment_json_is_standard_json():
    """A model with a NaN weight gave alignment text with bare NaN tokens, which strict parsers
    (JavaScript's JSON.parse) refuse; analyze writes every other NaN as null (found by a review)."""
    import json
    import math

    from icl_bench.analysis.similarity import alignment_json

    def strict(name):
        raise ValueError(name)
    text = alignment_json({"components": {"embed": math.nan, "L0": 0.5}, "score": math.inf, "scales": [1.0, -math.inf]})
    assert json.loads(text, parse_constant=strict) == {"components": {"L0": 0.5, "embed": None}, "score": None,
                                                       "scales": [1.0, None]}


def test_components_zero_in_both_models_count_as_equal():
    """A cosine is 1 where both components are zero (_cosine's docstring): the construction
    compared with itself, both with layer 1's W_O zeroed, scores 1, not 2/3 (its layer0.out
    and layer0.gram read 0)."""
    from icl_bench.analysis.similarity import similarity
    from icl_bench.solvers.ln_closed_form import build_construction

    c = build_construction(100.0, dtype=torch.float64)
    with torch.no_grad():
        c.blocks[0].attn.W_O.zero_()
    score, align = similarity(c, c, steps=(5, 5), keep=2, polish=1)
    assert align["components"]["layer0.gram"] == 1.0 and align["components"]["layer0.out"] == 1.0, align
    assert score == pytest.approx(1.0, abs=1e-9)


def test_the_shuffled_null_permutes_the_readout_too():
    """shuffle_entries permutes the entries of every weight matrix, the readout included (84 entries
    of a flatten readout: the identity permutation has probability 1 / 84!)."""
    from icl_bench.analysis.similarity import shuffle_entries

    m = random_model(readout="flatten", N=20)
    s = shuffle_entries(m, 0)
    a, b = m.readout.weight.detach().flatten(), s.readout.weight.detach().flatten()
    assert torch.equal(a.sort().values, b.sort().values) and not torch.equal(a, b)


def test_similarity_refuses_d_model_above_6():
    """d! 2^d candidates: d_model 7 is a ConfigError up front (645 120 candidates, each with a
    (7^3 x 7^3) Gram term, would not fit in memory)."""
    from icl_bench.analysis.similarity import similarity

    m = Transformer(TransformerConfig(d_model=7, n_heads=1)).to(torch.float64)
    with pytest.raises(ConfigError, match="d_model must be <= 6"):
        similarity(m, m)
