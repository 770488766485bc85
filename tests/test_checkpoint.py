"""Checkpoint round trip. The rejection of bad checkpoint files (truncated, pickles, wrong shapes,
bad JSON, ...) is in the bad-input catalogue, tests/test_bad_inputs.py."""
import errno
import hashlib
import json
import os
import re
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from icl_bench.errors import ConfigError
from icl_bench.solvers.checkpoint import load_checkpoint, save_checkpoint, weights_digest
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


@contextmanager
def _file_size_limit(limit: int):
    """Writes past `limit` bytes fail with EFBIG (RLIMIT_FSIZE, SIGXFSZ ignored): a real write error
    part-way through a file, as a disk filling up gives, for this process only."""
    resource = pytest.importorskip("resource")
    old_limit, old_handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


@pytest.mark.parametrize("fails", ["weights", "metadata"])
def test_a_save_that_fails_part_way_keeps_the_old_pair(tmp_path, fails):
    """`train --force` on a full disk wrote the new .safetensors over the old one, then failed
    part-way through the .json it was overwriting in place: the old checkpoint was gone and the
    new one half written (found by an adversarial review). Both files now go to temporary names
    first: a failure in either leaves the old pair byte for byte and no temporary file; the error
    is an OSError naming the file (safetensors' own SafetensorError for the weights included)."""
    save_checkpoint(_model(), tmp_path / "m", {"R": 10.0})
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    new = _model(d_model=4)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(1.0)
    limit = 1000 if fails == "weights" else 20_000  # the weights are 2272 bytes, the metadata > 100 000
    with _file_size_limit(limit), pytest.raises(OSError) as info:
        save_checkpoint(new, tmp_path / "m", {"R": 10.0, "history": [{"loss": 1.0, "step": i} for i in range(3000)]})
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert info.value.errno == errno.EFBIG
    assert info.value.filename == str(tmp_path / ("m.safetensors" if fails == "weights" else "m.json"))


def test_the_json_is_renamed_in_last_and_marks_a_complete_pair(tmp_path, monkeypatch):
    """A crash between the two renames leaves new weights without a .json, refused as incomplete,
    never new weights beside the old pair's metadata (which could load as a wrong checkpoint)."""
    import icl_bench.solvers.checkpoint as checkpoint

    save_checkpoint(_model(), tmp_path / "m", {"R": 10.0})
    renamed, real = [], os.replace

    def crash_before_the_json(a, b):
        if str(b).endswith(".json"):
            raise KeyboardInterrupt  # stands in for a kill between the renames
        renamed.append(Path(b).name)
        real(a, b)

    monkeypatch.setattr(checkpoint.os, "replace", crash_before_the_json)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(_model(d_model=4), tmp_path / "m", {"R": 100.0})
    assert renamed == ["m.safetensors"] and sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]
    with pytest.raises(ConfigError, match="metadata file .*m.json is missing"):
        load_checkpoint(tmp_path / "m")


def _save_tagged(stem: str, tag: int, times: int) -> None:
    """(A writer process.) Save a model whose every weight is `tag`, with meta {"tag": tag}."""
    model = _model(d_model=4)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(tag))
    for _ in range(times):
        save_checkpoint(model, stem, {"tag": tag})


def test_concurrent_saves_of_one_stem_never_mix_and_a_reader_never_sees_a_mix(tmp_path):
    """Two processes training one name each saved the pair by two renames; interleaved, they left one
    run's weights beside the other's metadata (64 of 300 in a review's stress test), and a reader
    between the renames found no .json. The renames now run under an exclusive lock of the folder
    and load_checkpoint reads under a shared one: every load sees one writer's whole pair."""
    import multiprocessing as mp

    stem = str(tmp_path / "m")
    _save_tagged(stem, 0, 1)
    ctx = mp.get_context("spawn")
    writers = [ctx.Process(target=_save_tagged, args=(stem, tag, 60)) for tag in (1, 2, 3)]
    for w in writers:
        w.start()
    loads = 0
    while any(w.is_alive() for w in writers) or loads == 0:
        model, meta = load_checkpoint(stem)  # a ConfigError here: a .json missing between the renames
        values = {float(v) for p in model.parameters() for v in p.detach().flatten().unique()}
        assert values == {float(meta["tag"])}, (values, meta["tag"])
        loads += 1
    for w in writers:
        w.join()
        assert w.exitcode == 0
    model, meta = load_checkpoint(stem)
    assert {float(v) for p in model.parameters() for v in p.detach().flatten().unique()} == {float(meta["tag"])}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json", "m.safetensors"]  # no temp file left


def test_replace_false_keeps_a_pair_that_is_there(tmp_path):
    """save_checkpoint(replace=False) (train without --force) refuses, under the lock, a pair that
    another process saved after the caller looked: nothing of it changes, no temp file is left."""
    save_checkpoint(_model(), tmp_path / "m", {"R": 10.0})
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(FileExistsError) as info:
        save_checkpoint(_model(d_model=4), tmp_path / "m", {"R": 100.0}, replace=False)
    assert info.value.filename == str(tmp_path / "m.safetensors")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    (tmp_path / "m.safetensors").unlink()  # a lone .json (half a pair) is refused too
    with pytest.raises(FileExistsError):
        save_checkpoint(_model(d_model=4), tmp_path / "m", {"R": 100.0}, replace=False)
    assert save_checkpoint(_model(), tmp_path / "n", {}, replace=False) == tmp_path / "n"  # a free name: saved


def test_a_checkpoints_commit_ignores_its_own_folder(tmp_path, monkeypatch):
    """A sweep writing over the tracked results/l1_sweep_models read "-dirty" from its second run
    on: its own outputs counted as uncommitted code (a review). The folder is left out of the check."""
    from icl_bench import provenance

    seen = []
    monkeypatch.setattr(provenance, "git_commit", lambda root=None, ignore=(): seen.append(ignore) or "abc")
    stem = save_checkpoint(_model(), tmp_path / "models" / "m", {})
    assert seen == [(stem.parent,)] and stem.parent == tmp_path / "models"
    assert json.loads(Path(f"{stem}.json").read_text())["git_commit"] == "abc"


def _flip(path: Path, value: float) -> None:
    """Overwrite the first float32 of the last tensor's data (the file's last 4 bytes are data)."""
    raw = bytearray(path.read_bytes())
    raw[-4:] = torch.tensor([value], dtype=torch.float32).view(torch.uint8).numpy().tobytes()
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("value", [10.0, float("nan")])
def test_a_damaged_weight_is_refused(tmp_path, value):
    """safetensors has no checksum: a damaged tensor byte loaded, and analyze printed the numbers of
    other weights with exit 0 (a review). The JSON's weights_sha256 refuses it now."""
    stem = save_checkpoint(_model(), tmp_path / "m")
    _flip(tmp_path / "m.safetensors", value)
    with pytest.raises(ConfigError, match=r"m\.safetensors does not hold the weights .*m\.json records \(weights_sha256 "
                                          r"differs\): the file is damaged, or the pair mixes two checkpoints"):
        load_checkpoint(stem)


def test_weights_copied_beside_another_runs_json_are_refused_and_older_pairs_load(tmp_path):
    """`sweep --reuse` tabulated one run's weights under another's lambda and seed after a copy (a
    review): nothing tied the .safetensors to its .json. A pair saved before the field existed
    (no weights_sha256) still loads."""
    other = _model()
    with torch.no_grad():
        other.embed.weight.add_(1.0)
    a, b = save_checkpoint(_model(), tmp_path / "a"), save_checkpoint(other, tmp_path / "b")
    (tmp_path / "a.safetensors").write_bytes((tmp_path / "b.safetensors").read_bytes())
    with pytest.raises(ConfigError, match="weights_sha256 differs"):
        load_checkpoint(a)
    meta = json.loads((tmp_path / "b.json").read_text())
    del meta["weights_sha256"]
    (tmp_path / "b.json").write_text(json.dumps(meta))
    model, _ = load_checkpoint(b)
    assert torch.equal(model.embed.weight, other.embed.weight)


@pytest.mark.parametrize("value", [5, None, "", "ABC", [1, 2]])
def test_a_weights_sha256_that_is_no_digest_is_named(tmp_path, value):
    """A number or a list read as 'the file is damaged', and null turned the check off (a review)."""
    stem = save_checkpoint(_model(), tmp_path / "m")
    meta = json.loads((tmp_path / "m.json").read_text())
    meta["weights_sha256"] = value
    (tmp_path / "m.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=r"m\.json: weights_sha256 must be 64 lowercase hexadecimal characters"):
        load_checkpoint(stem)


def test_a_git_commit_the_caller_gives_is_kept(tmp_path, monkeypatch):
    """meta's own "git_commit" is stored as given ("git_commit unless given"): a checkpoint derived
    from another records that one's commit, not the one saving it now."""
    from icl_bench import provenance

    monkeypatch.setattr(provenance, "git_commit", lambda root=None, ignore=(): "now")
    stem = save_checkpoint(_model(), tmp_path / "m", {"git_commit": "abc123"})
    assert json.loads(Path(f"{stem}.json").read_text())["git_commit"] == "abc123"


def test_weights_relabelled_to_another_dtype_of_the_same_bytes_are_refused(tmp_path):
    """weights_sha256 covers each tensor's dtype, not only its bytes: float16 weights rewritten as
    bfloat16 (the same bytes, other numbers) do not load as the checkpoint the JSON records."""
    stem = save_checkpoint(_model().half(), tmp_path / "m")
    tensors = load_file(f"{stem}.safetensors")
    save_file({k: v.view(torch.bfloat16) for k, v in tensors.items()}, f"{stem}.safetensors")
    with pytest.raises(ConfigError, match=r"weights_sha256 differs"):
        load_checkpoint(stem)


@pytest.mark.parametrize("half", ["json", "safetensors"])
def test_replace_false_keeps_a_dangling_link_of_the_pair(tmp_path, half):
    """A dangling link where either file of the pair goes is taken (it does not exist(), but it is
    there): replace=False refuses it and leaves it in place, as it does a file."""
    (tmp_path / f"m.{half}").symlink_to(tmp_path / "gone")
    with pytest.raises(FileExistsError):
        save_checkpoint(_model(), tmp_path / "m", {}, replace=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"m.{half}"] and (tmp_path / f"m.{half}").is_symlink()


def test_a_checkpoint_name_is_checked_at_the_longest_name_saving_may_use(tmp_path):
    """check_writable counts the temporary file of <stem>-pid<PID>-99, the last name train_and_save
    falls back to when another process took <stem>: a stem whose every such name fits is accepted,
    one character more is refused before training (not only <stem>'s or <stem>-pid<PID>'s own)."""
    from icl_bench.files import temp_path
    from icl_bench.solvers.checkpoint import beside, check_writable

    limit = os.pathconf(tmp_path, "PC_NAME_MAX")

    def longest(n: int) -> int:
        return len(temp_path(f"{beside(tmp_path / ('m' * n), 99)}.safetensors").name)

    n = limit - (longest(1) - 1)
    assert longest(n) == limit
    check_writable(tmp_path / ("m" * n))
    with pytest.raises(ConfigError, match=r"^--out: the checkpoint name m{40}\.\.\. is too long to save"):
        check_writable(tmp_path / ("m" * (n + 1)))


def _edit_meta(stem: Path, **fields) -> None:
    """Rewrite <stem>.json with `fields` set (a value of ... deletes the field)."""
    path = Path(f"{stem}.json")
    meta = json.loads(path.read_text())
    for k, v in fields.items():
        if v is ...:
            meta.pop(k)
        else:
            meta[k] = v
    path.write_text(json.dumps(meta))


def test_a_checkpoint_without_a_version_field_loads_as_version_1(tmp_path):
    stem = save_checkpoint(_model(), tmp_path / "m", {"R": 10.0})
    _edit_meta(stem, version=...)
    assert load_checkpoint(stem)[1]["R"] == 10.0


@pytest.mark.parametrize("version", [True, 1.0, 0, "1"])
def test_a_version_that_is_not_the_integer_1_is_refused(tmp_path, version):
    """JSON true equals 1 in Python, but is no version number."""
    stem = save_checkpoint(_model(), tmp_path / "m")
    _edit_meta(stem, version=version)
    with pytest.raises(ConfigError, match=rf"m\.json has version {re.escape(repr(version))}; this icl-bench reads version 1"):
        load_checkpoint(stem)


def test_weights_with_more_tensors_than_the_config_are_refused_in_one_line(tmp_path):
    """A model_config with fewer layers than the weights hold (or any extra tensor) is a ConfigError
    naming the first extra tensor, not torch's RuntimeError from load_state_dict."""
    stem = save_checkpoint(_model(n_layers=2), tmp_path / "m")
    _edit_meta(stem, model_config={**json.loads(Path(f"{stem}.json").read_text())["model_config"], "n_layers": 1})
    with pytest.raises(ConfigError, match=r"m\.safetensors tensor names do not match the config \(first difference: "
                                          r"'blocks\.1\."):
        load_checkpoint(stem)


def test_weights_of_two_dtypes_are_refused_even_with_a_matching_digest(tmp_path):
    """One float64 tensor among float32 ones was cast silently on load; the digest recorded for
    exactly those tensors does not make them one checkpoint's weights."""
    stem = save_checkpoint(_model(), tmp_path / "m")
    tensors = load_file(f"{stem}.safetensors")
    tensors["embed.weight"] = tensors["embed.weight"].double()
    save_file(tensors, f"{stem}.safetensors")
    _edit_meta(stem, weights_sha256=weights_digest(tensors))
    with pytest.raises(ConfigError, match=r"tensors must share one floating dtype \(got \['torch.float32', 'torch.float64'\]\)"):
        load_checkpoint(stem)


def test_an_upper_case_digest_is_named_as_malformed_not_as_other_weights(tmp_path):
    """The right digest in upper case is a malformed field (the file says lower case), not weights
    that differ from the JSON's: the message must not send the user to retrain."""
    stem = save_checkpoint(_model(), tmp_path / "m")
    _edit_meta(stem, weights_sha256=json.loads(Path(f"{stem}.json").read_text())["weights_sha256"].upper())
    with pytest.raises(ConfigError, match=r"m\.json: weights_sha256 must be 64 lowercase hexadecimal characters"):
        load_checkpoint(stem)


def test_the_weights_digest_takes_a_0_dim_tensor_and_tells_it_from_a_1_element_one():
    """weights_digest raised "self.dim() cannot be 0 to view Float as Byte" on a scalar tensor (a
    model with a scalar buffer could not be saved; a review). Its bytes are the value's, its
    shape () is hashed, so it differs from shape (1,); other tensors hash as before."""
    from icl_bench.solvers.checkpoint import weights_digest

    scalar, one = weights_digest({"s": torch.tensor(1.5)}), weights_digest({"s": torch.tensor([1.5])})
    assert len(scalar) == 64 and scalar != one
    m = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    h = hashlib.sha256()
    h.update(b"m\0torch.float32\0(2, 3)\0")
    h.update(m.numpy().tobytes())
    assert weights_digest({"m": m}) == h.hexdigest()
