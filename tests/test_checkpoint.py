"""Checkpoint round trip. The rejection of bad checkpoint files (truncated, pickles, wrong shapes,
bad JSON, ...) is in the bad-input catalogue, tests/test_bad_inputs.py."""
import json

import pytest
import torch

from icl_bench.solvers.checkpoint import load_checkpoint, save_checkpoint
from icl_bench.solvers.transformer import Transformer, TransformerConfig


def _model(**kw):
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(**kw))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


@pytest.fixture
def saved(tmp_path):
    model = _model()
    stem = save_checkpoint(model, tmp_path / "m", {"R": 10.0, "N": [20], "seed": 3, "solver": "trained-l1"})
    return model, stem


@pytest.mark.parametrize("suffix", ["", ".safetensors", ".json"])
def test_round_trip_either_file(saved, suffix):
    model, stem = saved
    loaded, meta = load_checkpoint(str(stem) + suffix)
    tokens = torch.randn(5, 11, 3)
    torch.testing.assert_close(loaded(tokens), model(tokens), rtol=0, atol=0)
    assert meta["R"] == 10.0 and meta["seed"] == 3 and meta["model_config"] == model.cfg.to_dict()
    assert meta["git_commit"] and meta["format"] == "icl-bench-checkpoint"


def test_round_trip_flatten_float64(tmp_path):
    model = _model(readout="flatten", N=7, layernorm=False).double()
    stem = save_checkpoint(model, tmp_path / "f.safetensors", {})
    loaded, _ = load_checkpoint(stem)
    assert loaded.cfg == model.cfg and loaded.readout.weight.dtype == torch.float64
    tokens = torch.randn(4, 8, 3, dtype=torch.float64)
    torch.testing.assert_close(loaded(tokens), model(tokens), rtol=0, atol=0)


def test_json_is_strict(tmp_path):
    stem = save_checkpoint(_model(), tmp_path / "s", {"history": [{"loss": float("nan")}], "x": float("inf")})

    def reject(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    meta = json.loads(stem.with_suffix(".json").read_text(), parse_constant=reject)
    assert meta["history"][0]["loss"] is None and meta["x"] is None
