"""Checkpoint round trip and rejection of bad files (never unpickle; one-line ConfigError)."""
import json
import pickle

import pytest
import torch

from icl_bench.checkpoint import load_checkpoint, read_meta, save_checkpoint
from icl_bench.errors import ConfigError
from icl_bench.transformer import Transformer, TransformerConfig


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


def _one_line(exc):
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("checkpoint:")


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


def test_truncated_weights(saved):
    _, stem = saved
    path = stem.with_suffix(".safetensors")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError) as exc:
        load_checkpoint(stem)
    _one_line(exc)


def test_pickle_disguised_as_safetensors(saved, tmp_path):
    _, stem = saved
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    stem.with_suffix(".safetensors").write_bytes(pickle.dumps({"x": Evil()}))
    with pytest.raises(ConfigError) as exc:
        load_checkpoint(stem)
    _one_line(exc)
    assert not marker.exists()  # nothing was unpickled


def test_torch_save_disguised(saved):
    _, stem = saved
    torch.save(_model().state_dict(), stem.with_suffix(".safetensors"))
    with pytest.raises(ConfigError):
        load_checkpoint(stem)


def test_wrong_shape(saved):
    _, stem = saved
    meta = json.loads(stem.with_suffix(".json").read_text())
    meta["model_config"]["d_model"] = 5
    stem.with_suffix(".json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="shape") as exc:
        load_checkpoint(stem)
    _one_line(exc)


def test_wrong_names(saved):
    _, stem = saved
    meta = json.loads(stem.with_suffix(".json").read_text())
    meta["model_config"]["n_layers"] = 3
    stem.with_suffix(".json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="names"):
        load_checkpoint(stem)


def test_missing_json(saved):
    _, stem = saved
    stem.with_suffix(".json").unlink()
    with pytest.raises(ConfigError, match="missing") as exc:
        load_checkpoint(stem.with_suffix(".safetensors"))
    _one_line(exc)


def test_missing_weights(saved):
    _, stem = saved
    stem.with_suffix(".safetensors").unlink()
    with pytest.raises(ConfigError, match="missing"):
        load_checkpoint(stem)


@pytest.mark.parametrize("text", ["{not json", "[]", '{"format": "other"}', ""])
def test_corrupt_json(saved, text):
    _, stem = saved
    stem.with_suffix(".json").write_text(text)
    with pytest.raises(ConfigError) as exc:
        read_meta(stem)
    _one_line(exc)


def test_bad_model_config(saved):
    _, stem = saved
    meta = json.loads(stem.with_suffix(".json").read_text())
    meta["model_config"]["keys"] = "causal"
    stem.with_suffix(".json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="model_config") as exc:
        load_checkpoint(stem)
    _one_line(exc)


def test_json_is_strict(tmp_path):
    stem = save_checkpoint(_model(), tmp_path / "s", {"history": [{"loss": float("nan")}], "x": float("inf")})

    def reject(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    meta = json.loads(stem.with_suffix(".json").read_text(), parse_constant=reject)
    assert meta["history"][0]["loss"] is None and meta["x"] is None
