"""Bad input to train, sweep, analyze and publish (found by a review of the installed package):
one line `icl-bench: error: <field>: ...`, exit 2, no traceback, and nothing written."""
from __future__ import annotations

import shutil

import pytest

from icl_bench.cli import main
from icl_bench.resources import models_dir

TINY = "steps = 2\nbatch_size = 16\neval_every = 1\neval_prompts = 16\n"


def run(capsys, tmp_path, argv, toml=None):
    if toml is not None:
        (tmp_path / "c.toml").write_text(toml)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("icl-bench: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written
    return err[len("icl-bench: error: "):]


@pytest.mark.parametrize("toml, expected", [
    ('[runs."../evil"]\n' + TINY, "runs: bad run name '../evil'"),
    ('name = "../../evil"\n' + TINY, "train.name: bad name '../../evil'"),  # a flat config: was 'runs.../../evil.name
    ('[runs.a]\nname = "../evil"\n' + TINY, "runs.a.name: bad name '../evil'"),  # its table, not its bad name
    ('[runs."a/b"]\n' + TINY, "runs: bad run name 'a/b'"),
    ('[runs.""]\n' + TINY, "runs: bad run name ''"),
    ("[runs]\n", "runs: empty table"),
    ("[default]\nsteps = 30\n[runs.a]\n" + TINY, "default: unknown key beside [runs]; accepted: defaults, runs"),  # a typo
    ("steps = 30\n[runs.a]\n" + TINY, "steps: unknown key beside [runs]"),  # trained on defaults, silently (a review)
    ("[runs.a]\neval_prompts = 1\n", "runs.a.eval_prompts: must be >= 2 (got 1)"),  # a variance of one: NaN
    ("defaults = 3\n[runs.a]\n" + TINY, "defaults: must be a table"),
    ("[runs.a]\neval_every = 'x'\n", "runs.a.eval_every: expected an integer >= 1"),
    ("[runs.a]\nthreads = 100000\n", "runs.a.threads: must be <= 1024"),
    ("[runs.a]\nbatch_size = 1000000000000\n", "runs.a.batch_size: batch_size * (N + 1) ="),
    ("[runs.a]\nN = [1000000000]\n", "runs.a.batch_size: batch_size * (N + 1) ="),
    ("[runs.a]\nd_model = 100000000\n", "runs.a.d_model: must be <= 256"),
    ("[runs.a]\nd_model = 256\nn_layers = 256\nn_heads = 256\n",  # each in range, together 69 GB
     "runs.a.d_model: n_layers * n_heads * 4 * d_model^2 = 17179869184 attention weights exceed 16777216"),
    ("[runs.a]\nd_model = 64\nn_layers = 1\nn_heads = 64\n",  # 2^20 weights, but the eager forward's folded maps: 256 GB
     "runs.a.d_model: n_layers * n_heads^2 * d_model^4 = 68719476736 values of the folded attention maps exceed 134217728; lower d_model, n_heads or n_layers"),
    ("[runs.a]\nd_model = 4\nn_layers = 2\nn_heads = 2\nbatch_size = 10000000\nN = [10]\n",
     "runs.a.batch_size: batch_size * (N + 1) * n_layers * n_heads * 4 * d_model = 7040000000 activations exceed"),
    ("R = 1e300\n" + TINY, "train.R: R=1e+300 overflows float32"),
    ("R = 1e-300\n" + TINY, "train.R: R=1e-300 underflows float32 (min 1.18e-38)"),  # were RuntimeErrors in
    ("precondition_R = 1e308\n" + TINY, "train.precondition_R: 1e+308 is outside the float32 range"),  # precondition
    ("R = 1e-30\nprecondition_R = 1e10\n" + TINY, "train.precondition_R: precondition_R / R = 1e+10 / 1e-30 is outside the float32"),
    ("dtype = 'float64'\nR = 1e-300\nprecondition_R = 1e10\n" + TINY, "train.precondition_R: precondition_R / R = 1e+10 / 1e-300 is outside the float64"),
    ('[defaults]\n' + TINY + '[runs.a]\nname = "x"\nseed = 1\n[runs.b]\nname = "x"\nseed = 2\n',  # b overwrote a's pair
     "runs.b.name: runs 'a' and 'b' both save the checkpoint x; give each run its own name"),
    ('[defaults]\n' + TINY + '[runs.x]\n[runs.y]\nname = "x.json"\n',  # saved as x.safetensors + x.json too
     "runs.y.name: runs 'x' and 'y' both save the checkpoint x; give each run its own name"),
    ('[defaults]\n' + TINY + '[runs.x]\n[runs."x.json.json"]\n',  # checked as x.json.*, saved as x.* over x's pair
     "runs.x.json.json.name: bad name 'x.json.json': it ends in two checkpoint suffixes (.json, .safetensors); "
     "give the name without them, e.g. 'x'"),
    ("[runs.a]\nsteps = 10000000000\n", "runs.a.steps: must be <= 1000000"),
    ("[runs.a]\nsteps = 1000001\n", "runs.a.steps: must be <= 1000000"),  # seed 0's steps 10^6.. were seed 1's prompts
    ("progress = 'yes'\n" + TINY, "train.progress: expected true or false"),
    ("lr = 1e38\nprogress = false\n" + TINY, "train.lr: the optimiser's step size overflows float32 (lr = 1e+38"),  # was a torch traceback
    ("seed = 9223372036854775807\n" + TINY, "train.seed: must be <= 9223372035853"),  # seed * 10^6 + step
    ('[runs.tiny-b]\nsolver = "trained-lsa"\nlayernorm = true\n' + TINY,  # was saved as trained-lsa with LayerNorm
     "runs.tiny-b.layernorm: solver 'trained-lsa' is LSA without LayerNorm; accepted: false (or leave it out)"),
    ('[runs.a]\nsolver = "trained-nol1"\nlayernorm = false\n' + TINY,
     "runs.a.layernorm: solver 'trained-nol1' is LSA + LayerNorm; accepted: true (or leave it out)"),
    pytest.param("N = " + "[" * 50_000 + "]" * 50_000 + "\n", "--config: c.toml nests arrays or inline tables too deeply",
                 id="nested-too-deep"),  # was a RecursionError
])
def test_train_config(capsys, tmp_path, toml, expected):
    msg = run(capsys, tmp_path, ["train", "--config", tmp_path / "c.toml", "--out", tmp_path / "m", "--steps", "2"], toml)
    assert msg.startswith(expected), msg


def test_train_flags(capsys, tmp_path):
    assert run(capsys, tmp_path, ["train", "--steps", "0", "--out", tmp_path / "m"]).startswith("--steps: must be an integer >= 1")
    huge = run(capsys, tmp_path, ["train", "--steps", "9" * 23, "--out", tmp_path / "m"])  # was an OverflowError in tqdm
    assert huge.startswith("--steps: must be an integer >= 1 and <= 1000000 (got 999"), huge
    msg = run(capsys, tmp_path, ["train", "--config", tmp_path / "c.toml", "--run", "nosuch", "--out", tmp_path / "m"], TINY)
    assert msg.startswith("--run: unknown run 'nosuch'; accepted: model"), msg
    msg = run(capsys, tmp_path, ["train", "--config", tmp_path / "c.toml", "--out", ""], TINY)  # saved into the cwd
    assert msg.strip() == "--out: empty path; give a folder", msg


@pytest.mark.parametrize("toml, expected", [
    ("[sweep]\nl1 = [0.0]\nout = ''\n", "sweep.out: must be a non-empty path"),
    ("[sweep]\nl1 = [0.0]\nout = 'sw/'\n[train]\n" + TINY,  # wrote sw.md, sw.csv, sw_models/ beside a folder sw/
     "sweep.out: must be a non-empty path ending in a file stem (got 'sw/', which ends in a path separator)"),
    ("[sweep]\nl1 = [0.0]\nout = 'sw/.'\n[train]\n" + TINY,  # pathlib reads it as 'sw': the same files beside it
     "sweep.out: must be a non-empty path ending in a file stem (got 'sw/.', which ends in '.', a folder)"),
    ("[sweep]\nl1 = [0.0]\neval_prompts = 1000000000000\n", "sweep.eval_prompts: eval_prompts * (eval_N + 1) exceeds"),
    ("[sweep]\nl1 = [0.0]\neval_prompts = 1\n", "sweep.eval_prompts: must be >= 2 (got 1)"),  # rel_mse NaN
    ("[sweep]\nl1 = [0.0]\n[train]\nseeds = [1]\n",  # suggested 'seed', which the sweep refuses (a review)
     "train.seeds: a [sweep] key; write it under [sweep] (accepted there: l1, seeds, out"),
    ("[sweep]\nl1 = [0.0]\n[train]\nprogress = false\nl1s = [1]\n", "train.l1s: unknown key; accepted: solver, R,"),
    ("[sweep]\nl1 = [0.0]\n[train]\nreadout = 'flatten'\nN = [12]\n" + TINY,  # raised after training the first run
     "sweep.eval_N: a flatten readout fixes the context length at train.N = 12; set eval_N = 12 (got 30)"),
    ("train = 3\n[sweep]\nl1 = [0.0]\n", "train: must be a table"),
    ("[sweep]\nl1 = [0.0]\n[train]\nthreads = 5000\n", "train.threads: must be <= 1024"),
    ("[sweep]\nl1 = [0.0, 0.0]\n[train]\n" + TINY, "sweep.l1: repeated values in [0.0, 0.0]"),  # one run trained twice
    ("[sweep]\nl1 = [1e-3, 0.001]\n[train]\n" + TINY, "sweep.l1: repeated values in [0.001, 0.001]"),
    ("[sweep]\nl1 = [0.1, 0.10000001]\n[train]\n" + TINY,  # one checkpoint file for both
     "sweep.l1: 0.1 and 0.10000001 share the checkpoint name l1-0.1-seed<S>"),
])
def test_sweep_config(capsys, tmp_path, monkeypatch, toml, expected):
    monkeypatch.chdir(tmp_path)  # [sweep] out is relative to the current folder: "nothing written" looks there
    msg = run(capsys, tmp_path, ["sweep", "--config", tmp_path / "c.toml"], toml)
    assert msg.startswith(expected), msg


def test_sweep_output_that_is_a_folder_is_refused_before_training(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "o.csv").mkdir()
    msg = run(capsys, tmp_path, ["sweep", "--config", "c.toml"], "[sweep]\nl1 = [0.0]\nout = 'o'\n[train]\n" + TINY)
    assert msg.startswith("sweep.out: o.csv exists and is a folder"), msg


def test_sweep_output_naming_an_existing_folder_is_refused_before_training(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sw").mkdir()
    msg = run(capsys, tmp_path, ["sweep", "--config", "c.toml"], "[sweep]\nl1 = [0.0]\nout = 'sw'\n[train]\n" + TINY)
    assert msg.startswith("sweep.out: must be a non-empty path ending in a file stem (got 'sw', which is an existing "
                          "folder); the sweep writes <out>.md, <out>.csv and <out>_models/: e.g. 'sw/l1_sweep'"), msg


def test_analyze_flags(capsys, tmp_path):
    assert run(capsys, tmp_path, ["analyze", "trained-l1-R100", "--seed", "-1"]).startswith("--seed: must be an integer in [0,")
    (tmp_path / "x.json").mkdir()
    assert run(capsys, tmp_path, ["analyze", "trained-l1-R100", "--out", tmp_path / "x.json"]).startswith("--out: ")
    msg = run(capsys, tmp_path, ["analyze", "nosuch-model"])
    assert msg.startswith("CHECKPOINT: no checkpoint 'nosuch-model'") and "trained-l1-R100" in msg, msg
    assert run(capsys, tmp_path, ["analyze", "trained-l1-R100", "--n-prompts", "0"]).startswith("--n-prompts: ")


def test_publish_the_same_run_twice_is_refused(capsys, tmp_path):
    (tmp_path / "r").mkdir()
    msg = run(capsys, tmp_path, ["publish", tmp_path / "r", tmp_path / "r" / ".", "--out", tmp_path / "p"])
    assert msg.startswith("RUN_DIR: ") and "given twice" in msg, msg


def test_a_shipped_checkpoint_resolves_by_name_with_a_suffix(capsys):
    from icl_bench.solvers.checkpoint import checkpoint_path

    assert checkpoint_path("trained-l1-R100.json").endswith("models/trained-l1-R100")


def test_a_dangling_link_named_like_a_shipped_checkpoint_is_an_error_not_the_shipped_model(capsys, tmp_path, monkeypatch):
    """A link the user put here, even one whose target is gone, is meant as the local checkpoint: the
    shipped model of that name must not stand in for it silently."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "trained-nol1-R10.json").symlink_to(tmp_path / "gone.json")
    msg = run(capsys, tmp_path, ["analyze", "trained-nol1-R10"])
    assert msg.rstrip() == f"checkpoint: metadata file trained-nol1-R10.json is a link to {tmp_path / 'gone.json'}, which is missing"
    (tmp_path / "trained-nol1-R10.json").unlink()
    (tmp_path / "trained-nol1-R10.safetensors").symlink_to("gone.safetensors")  # only the weights' link: named too
    msg = run(capsys, tmp_path, ["analyze", "trained-nol1-R10"])
    assert msg.rstrip() == ("checkpoint: metadata file trained-nol1-R10.json is missing, and weights file "
                            "trained-nol1-R10.safetensors is a link to gone.safetensors, which is missing")
    (tmp_path / "trained-nol1-R10.safetensors").unlink()
    for half in ("json", "safetensors"):
        shutil.copy(models_dir() / f"trained-nol1-R10.{half}", tmp_path)
    (tmp_path / "trained-nol1-R10.safetensors").unlink()
    (tmp_path / "trained-nol1-R10.safetensors").symlink_to("gone.safetensors")
    msg = run(capsys, tmp_path, ["publish", tmp_path, "--out", tmp_path / "p", "--checkpoint", "trained-nol1-R10"])
    assert msg.rstrip() == "--checkpoint: weights file trained-nol1-R10.safetensors is missing (a link to gone.safetensors, which is missing)"
    assert not (tmp_path / "p").exists()


def test_analyze_out_over_a_checkpoints_metadata_is_refused(capsys, tmp_path, monkeypatch):
    """`analyze m --out m.json` wrote the analysis over the checkpoint's own JSON half and so
    destroyed it (found by an adversarial review); any checkpoint's metadata is refused."""
    monkeypatch.chdir(tmp_path)
    for half in ("json", "safetensors"):
        shutil.copy(models_dir() / f"trained-nol1-R10.{half}", tmp_path / f"m.{half}")
    before = (tmp_path / "m.json").read_bytes()
    for target in ("m.json", str(models_dir() / "trained-l1-R100.json")):
        msg = run(capsys, tmp_path, ["analyze", "m", "--out", target])
        assert msg == f"--out: {target} is the metadata of checkpoint {target[:-5]}; writing the analysis there would destroy it; give another file\n"
    assert (tmp_path / "m.json").read_bytes() == before


def test_links_in_a_checkpoint_folder_are_refused_before_training(capsys, tmp_path):
    """A dangling m.json link in --out passed the checks, both runs trained, then saving failed and
    left m.safetensors alone; a live link would have been written through (found by a review)."""
    (tmp_path / "c.toml").write_text("[runs.m]\n" + TINY)
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "m.json").symlink_to("/nonexistent/zz")
    msg = run(capsys, tmp_path, ["train", "--config", tmp_path / "c.toml", "--out", tmp_path / "o"])
    assert msg == f"--out: {tmp_path / 'o'} already holds m.json; choose another folder or pass --force\n"
    msg = run(capsys, tmp_path, ["train", "--config", tmp_path / "c.toml", "--out", tmp_path / "o", "--force"])
    assert msg == f"--out: {tmp_path / 'o' / 'm.json'} is a symbolic link, so the checkpoint would not be saved in place; remove it\n"


@pytest.mark.parametrize("name", ["x.json", "x.safetensors"])
def test_a_run_named_with_a_checkpoint_suffix_does_not_overwrite_its_pair(capsys, tmp_path, name):
    """name = "x.json" saves x.safetensors + x.json (the suffix is dropped), but the check looked for
    x.json.json, so an existing x pair was replaced without --force (found by a review)."""
    (tmp_path / "o").mkdir()
    for half in ("x.json", "x.safetensors"):
        (tmp_path / "o" / half).write_text("an earlier checkpoint")
    msg = run(capsys, tmp_path, ["train", "--config", tmp_path / "c.toml", "--out", tmp_path / "o"], f'name = "{name}"\n' + TINY)
    assert msg == f"--out: {tmp_path / 'o'} already holds x.safetensors, x.json; choose another folder or pass --force\n"
    assert all((tmp_path / "o" / half).read_text() == "an earlier checkpoint" for half in ("x.json", "x.safetensors"))


def test_checkpoint_names_local_first_then_shipped_and_a_folder_never_hides_one(tmp_path, monkeypatch):
    """How `analyze NAME` and `publish --checkpoint NAME` find a checkpoint (found by a review: a
    folder named like a shipped model, e.g. made by `analyze trained-l1-R100 --out
    trained-l1-R100/a.json`, hid the shipped model; "./m" fell back to the shipped one)."""
    from icl_bench.errors import ConfigError
    from icl_bench.resources import models_dir
    from icl_bench.solvers.checkpoint import checkpoint_path, save_checkpoint
    from icl_bench.solvers.transformer import Transformer, TransformerConfig

    monkeypatch.chdir(tmp_path)
    shipped = str(models_dir() / "trained-l1-R100")
    (tmp_path / "trained-l1-R100").mkdir()  # a folder of that name: still the shipped model
    assert checkpoint_path("trained-l1-R100") == checkpoint_path("trained-l1-R100.safetensors") == shipped
    for typed in ("./trained-l1-R100", "trained-l1-R100/", "sub/trained-l1-R100"):  # a path as typed: never shipped
        assert checkpoint_path(typed) == typed
    assert checkpoint_path(".") == "."  # a folder that is no shipped name: load_checkpoint says it is a folder
    (tmp_path / "trained-l1-R100.json").write_text('{"R": 100.0}')  # e.g. `analyze trained-l1-R100 --out trained-l1-R100.json`
    (tmp_path / "trained-nol1-R10").write_text("")  # e.g. `analyze trained-nol1-R10 > trained-nol1-R10`
    assert checkpoint_path("trained-l1-R100") == shipped  # files that are no checkpoint never hide one
    assert checkpoint_path("trained-nol1-R10") == str(models_dir() / "trained-nol1-R10")
    (tmp_path / "trained-l1-R1000").symlink_to(tmp_path)  # a link to a folder hides nothing either
    assert checkpoint_path("trained-l1-R1000") == str(models_dir() / "trained-l1-R1000")
    (tmp_path / "other.json").write_text("{}")
    (tmp_path / "trained-nol1-R100.json").symlink_to(tmp_path / "other.json")  # a live link to no checkpoint: a file
    assert checkpoint_path("trained-nol1-R100") == str(models_dir() / "trained-nol1-R100")
    (tmp_path / "trained-l1-R10.safetensors").write_bytes(b"x")  # half a local pair: the local one, not shipped
    assert checkpoint_path("trained-l1-R10.json") == "trained-l1-R10.json"
    save_checkpoint(Transformer(TransformerConfig(n_layers=1, n_heads=1)), tmp_path / "trained-lsa-R10")
    assert checkpoint_path("trained-lsa-R10") == "trained-lsa-R10"  # a local pair comes first
    for bad, msg in [("", "--checkpoint: empty name"), ("a" * 300, "--checkpoint: cannot use 'aaaa"),
                     ("./" + "a" * 300, "--checkpoint: cannot use './aaaa"),
                     ("nosuch", "--checkpoint: no checkpoint 'nosuch' (a file pair's stem, or a shipped one: ")]:
        with pytest.raises(ConfigError) as exc:
            checkpoint_path(bad, "--checkpoint")
        assert str(exc.value).startswith(msg) and "\n" not in str(exc.value), str(exc.value)


def test_a_full_disk_while_saving_is_one_line_and_keeps_the_old_pair(capsys, tmp_path, monkeypatch):
    """safetensors reports a full disk as its own SafetensorError, not an OSError: `train` printed a
    traceback, exit 1 (found by an adversarial review). It is one line naming --out's file, exit 2,
    and the pair that was there is left as it was, with no temporary file beside it."""
    from safetensors import SafetensorError

    import icl_bench.solvers.checkpoint as checkpoint

    def full(tensors, filename, metadata=None):
        with open(filename, "wb") as f:  # safetensors had begun its file
            f.write(b"\0" * 100)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(checkpoint, "save_file", full)
    (tmp_path / "o").mkdir()
    for half in ("m.json", "m.safetensors"):
        (tmp_path / "o" / half).write_text("an earlier checkpoint")
    msg = run(capsys, tmp_path, ["train", "--config", tmp_path / "c.toml", "--out", tmp_path / "o", "--force", "--no-progress"],
              "[runs.m]\n" + TINY)
    assert msg == f"--out: {tmp_path / 'o' / 'm.safetensors'}: No space left on device\n"
    assert all((tmp_path / "o" / half).read_text() == "an earlier checkpoint" for half in ("m.json", "m.safetensors"))


def test_names_too_long_to_save_are_refused_before_training(capsys, tmp_path, monkeypatch):
    """A run name or a sweep out of ~230-250 characters passed every check, trained, and failed only
    when the temporary file of the checkpoint or table was made (its name adds ~25 bytes; found by a
    review): refused now before any training, one line naming the field."""
    from icl_bench.errors import ConfigError
    from icl_bench.solvers.checkpoint import check_writable
    from icl_bench.training import train as train_mod

    monkeypatch.setattr(train_mod, "train", lambda cfg: pytest.fail("training ran"))
    msg = run(capsys, tmp_path, ["train", "--config", tmp_path / "c.toml", "--out", tmp_path / "o"],
              toml=f"[runs.{'m' * 201}]\n" + TINY)  # run names stop at 200, whose temp names fit in 255 bytes
    assert msg.startswith("runs: bad run name 'mmm") and msg.endswith("'.' (not first), at most 200\n")
    with pytest.raises(ConfigError, match=r"^--out: the checkpoint name m{40}\.\.\. is too long to save \(the name \."):
        check_writable(tmp_path / ("m" * 230))  # a legal file name; its temp names are not
    check_writable(tmp_path / ("m" * 200))
    (tmp_path / "s.toml").write_text(f'[sweep]\nl1 = [0.0]\nout = "{tmp_path / ("s" * 235)}"\n[train]\n' + TINY)
    msg = run(capsys, tmp_path, ["sweep", "--config", tmp_path / "s.toml"])
    assert msg.startswith("sweep.out: too long to write <out>.csv and <out>_models/ (the name .") and "takes at most 255" in msg
    assert msg.endswith("; give a shorter out\n")
