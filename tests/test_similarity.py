

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
