"""Runner and plugin behaviour that must never mislead: cell keys cover every input, --resume
is strict about what it continues and lenient about list order, failing or useless plugins are
reported, dirty data is announced, `train` refuses to overwrite, Ctrl-C says how to resume."""
from __future__ import annotations

import importlib
import importlib.machinery
import json
import re
import sys
import types

import numpy as np
import pandas as pd
import pytest
import tomli_w
import torch

import icl_bench.cli_run as cli_run
from icl_bench import Solver, register_solver
from icl_bench.cli import main
from icl_bench.provenance import module_digest, source_digest
from icl_bench.solvers.registry import REGISTRY

RAW = {"seed": 0, "n_prompts": 32, "batch_size": 32, "timing": {"repeats": 1},
       "grid": {"N": [4, 6], "noise": [0.1], "R": [10.0], "dtype": ["float64"]},
       "solvers": {"ols": {}}}


def _cfg(tmp_path, raw, name="c.toml"):
    path = tmp_path / name
    path.write_text(tomli_w.dumps(raw))
    return path


def _run(capsys, *argv):
    code = main(["run", "--no-progress", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("state", ["missing", "empty"])
def test_resume_needs_a_run_to_continue(tmp_path, capsys, state):
    out = tmp_path / "run"
    if state == "empty":
        out.mkdir()
    code, _, err = _run(capsys, "--config", _cfg(tmp_path, RAW), "--out", out, "--resume")
    assert code == 2 and "--resume" in err and "no run" in err
    assert not out.exists() or not any(out.iterdir())  # nothing was written


def test_resume_after_reordering_a_grid_list_reuses_every_cell(tmp_path, capsys):
    out = tmp_path / "run"
    assert _run(capsys, "--config", _cfg(tmp_path, RAW), "--out", out)[0] == 0
    first = pd.read_parquet(out / "results.parquet")
    swapped = json.loads(json.dumps(RAW))
    swapped["grid"]["N"] = [6, 4]
    code, _, err = _run(capsys, "--config", _cfg(tmp_path, swapped, "d.toml"), "--out", out, "--resume")
    assert code == 0, err
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["n_cells_reused"] == len(first) == 2
    again = pd.read_parquet(out / "results.parquet")
    assert list(again.N) == [6, 4]  # the new order, the old numbers
    assert sorted(again.mse_vs_ols) == sorted(first.mse_vs_ols)
    assert first.code_sha256.str.len().eq(64).all() and set(again.code_sha256) == set(first.code_sha256)  # reused rows too
    other = json.loads(json.dumps(RAW))
    other["n_prompts"] = 16  # a real change is still refused
    code, _, err = _run(capsys, "--config", _cfg(tmp_path, other, "e.toml"), "--out", out, "--resume")
    assert code == 2 and "another config" in err


def test_shared_cell_cache_serves_a_new_run_folder(tmp_path, capsys):
    cache = tmp_path / "cache"
    cfg = _cfg(tmp_path, RAW)
    assert _run(capsys, "--config", cfg, "--out", tmp_path / "a", "--cache", cache)[0] == 0
    assert _run(capsys, "--config", cfg, "--out", tmp_path / "b", "--cache", cache)[0] == 0
    a, b = (pd.read_parquet(tmp_path / d / "results.parquet") for d in "ab")
    assert json.loads((tmp_path / "b" / "metadata.json").read_text())["n_cells_reused"] == 2
    pd.testing.assert_frame_equal(a, b)  # the same rows, timings included: they were reused


def test_the_cell_cache_serves_rows_timed_with_the_same_threads_only(tmp_path, capsys):
    """A row timed with one torch thread was served to a run with [timing] threads = 2, whose
    metadata then named 2 threads (a review); rows of the default settings keep their keys."""
    cache = tmp_path / "cache"
    two = dict(RAW, timing={**RAW["timing"], "threads": 2})
    assert _run(capsys, "--config", _cfg(tmp_path, RAW), "--out", tmp_path / "a", "--cache", cache)[0] == 0
    for out, reused in (("b", 0), ("c", 2)):  # b: timed anew with 2 threads; c: b's rows
        assert _run(capsys, "--config", _cfg(tmp_path, two, "two.toml"), "--out", tmp_path / out, "--cache", cache)[0] == 0
        assert json.loads((tmp_path / out / "metadata.json").read_text())["n_cells_reused"] == reused
    assert _run(capsys, "--config", _cfg(tmp_path, RAW), "--out", tmp_path / "d", "--cache", cache)[0] == 0
    assert json.loads((tmp_path / "d" / "metadata.json").read_text())["n_cells_reused"] == 2  # a's rows
    c, d = (pd.read_parquet(tmp_path / x / "results.parquet") for x in "cd")
    pd.testing.assert_frame_equal(c, pd.read_parquet(tmp_path / "b" / "results.parquet"))
    pd.testing.assert_frame_equal(d, pd.read_parquet(tmp_path / "a" / "results.parquet"))


def test_the_cell_cache_serves_rows_timed_exclusively_only_to_exclusive_timing(tmp_path, capsys):
    """Rows timed while other cells ran beside them are no exclusive timing: an --exclusive-timing
    run times its cells anew and is then served its own rows (nothing tested the tag: a mutation
    review)."""
    cache, cfg = tmp_path / "cache", _cfg(tmp_path, RAW)
    for out, flags, reused in (("a", [], 0), ("b", ["--exclusive-timing"], 0), ("c", ["--exclusive-timing"], 2)):
        assert _run(capsys, "--config", cfg, "--out", tmp_path / out, "--cache", cache, *flags)[0] == 0
        assert json.loads((tmp_path / out / "metadata.json").read_text())["n_cells_reused"] == reused, out


PLUGIN = """from icl_bench import Solver, register_solver
import torch


@register_solver("test-code-edit")
class Constant(Solver):
    \"\"\"Predicts a constant.\"\"\"
    params = {}

    def predict(self, batch):
        return torch.full((batch.B,), VALUE, dtype=batch.dtype)
"""


def _runs_before_and_after_an_edit(tmp_path, capsys, monkeypatch):
    """Run folders tmp_path/a and tmp_path/b of one config and cache, the plugin solver's answer
    edited from 0 to 100 between them (as a new process would see it)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "edited_plugin.py").write_text(PLUGIN.replace("VALUE", "0.0"))
    cache, cfg = tmp_path / "cache", _cfg(tmp_path, dict(RAW, solvers={"test-code-edit": {}}))
    try:
        importlib.import_module("edited_plugin")
        assert _run(capsys, "--config", cfg, "--out", tmp_path / "a", "--cache", cache)[0] == 0
        REGISTRY.unregister("test-code-edit")
        (tmp_path / "edited_plugin.py").write_text(PLUGIN.replace("VALUE", "100.0"))
        importlib.reload(sys.modules["edited_plugin"])
        source_digest.cache_clear()  # a new process would hash the edited file
        module_digest.cache_clear()
        assert _run(capsys, "--config", cfg, "--out", tmp_path / "b", "--cache", cache)[0] == 0
    finally:
        REGISTRY.unregister("test-code-edit")
        sys.modules.pop("edited_plugin", None)
        source_digest.cache_clear()
        module_digest.cache_clear()


def test_cell_cache_and_resume_see_an_edited_solver(tmp_path, capsys, monkeypatch):
    """A cell's key holds the digest of its solver's code (provenance.code_digest): after the
    plugin's source changes, the shared cache serves nothing and the new numbers are computed."""
    _runs_before_and_after_an_edit(tmp_path, capsys, monkeypatch)
    a, b = (pd.read_parquet(tmp_path / d / "results.parquet") for d in "ab")
    assert json.loads((tmp_path / "b" / "metadata.json").read_text())["n_cells_reused"] == 0
    assert (b.mse_vs_ols > a.mse_vs_ols * 100).all()


def test_publish_refuses_rows_of_edited_code_as_repeats(tmp_path, capsys, monkeypatch):
    """Rows carry their cell's code_sha256, so publish does not pool one cell and seed computed by
    two versions of a solver as repeats (it printed the mean of 0 and 100's errors, exit 0)."""
    _runs_before_and_after_an_edit(tmp_path, capsys, monkeypatch)
    a, b = (pd.read_parquet(tmp_path / d / "results.parquet") for d in "ab")
    assert a.code_sha256.str.len().eq(64).all() and (a.code_sha256 != b.code_sha256).all()
    out = tmp_path / "pub"
    code = main(["publish", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and not out.exists(), err
    assert "test-code-edit N=4" in err and "has code_sha256 " in err and "the solver's code differs" in err, err
    old = tmp_path / "old"  # a run from before the column: not compared, as for the other digests
    old.mkdir()
    a.drop(columns=["code_sha256"]).to_parquet(old / "results.parquet")
    assert main(["publish", str(old), str(tmp_path / "b"), "--out", str(out)]) == 0


@pytest.mark.parametrize("spec", [False, True])
def test_a_script_plugin_is_hashed_from_its_file(tmp_path, monkeypatch, spec):
    """A solver defined in a script lives in `__main__`, which import cannot find (no __spec__,
    or one without a file to search): its digest comes from the script's bytes, so an edited
    script gets new cells from the cache, and an unchanged one keeps its digest."""
    script = tmp_path / "script.py"
    script.write_text("X = 1\n")
    module = types.ModuleType("test_script_main")
    module.__file__ = str(script)
    module.__spec__ = importlib.machinery.ModuleSpec("test_script_main", None) if spec else None
    monkeypatch.setitem(sys.modules, "test_script_main", module)
    digests = []
    for text in ("X = 1\n", "X = 1\n", "X = 2\n"):
        script.write_text(text)
        source_digest.cache_clear()  # a new process
        module_digest.cache_clear()
        digests.append(source_digest("test_script_main"))
    source_digest.cache_clear()
    module_digest.cache_clear()
    assert digests[0] == digests[1] != digests[2] and "" not in digests


def test_a_package_is_hashed_from_the_loaded_module_not_a_folder_of_its_name(tmp_path, monkeypatch):
    """A plugin's checkout folder in the current directory (on sys.path as '') shadowed the installed
    package in find_spec, so the same code had another digest there: false "worker's code differs"
    errors and recomputed cells (a review). The digest now follows the module that is loaded."""
    real = tmp_path / "site" / "shadowpkg"
    (real / "sub").mkdir(parents=True)
    (real / "__init__.py").write_text("")
    (real / "sub" / "__init__.py").write_text("")
    (real / "sub" / "solvers.py").write_text("X = 1\n")
    (tmp_path / "cwd" / "shadowpkg" / "shadowpkg").mkdir(parents=True)  # a checkout: no __init__.py at its top
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    module_digest.cache_clear()
    source_digest.cache_clear()
    try:
        importlib.import_module("shadowpkg.sub.solvers")
        here = module_digest("shadowpkg.sub.solvers")
        assert here == source_digest("shadowpkg")  # (no shadow: the same files as by name)
        module_digest.cache_clear()
        source_digest.cache_clear()
        monkeypatch.chdir(tmp_path / "cwd")
        monkeypatch.syspath_prepend("")  # a script run from the checkout's parent folder
        sys.modules["shadowpkg"].__spec__ = None  # find_spec then searches the path: the checkout shadows it
        assert module_digest("shadowpkg.sub.solvers") == here
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == "shadowpkg"]:
            sys.modules.pop(name)
        module_digest.cache_clear()
        source_digest.cache_clear()


def test_a_script_is_hashed_when_it_registers_its_solver(tmp_path, monkeypatch):
    """The script's file was hashed when the run first asked, so an edit made while the script ran
    lent the new file's digest to cells of the old code (found by an adversarial review)."""
    script = tmp_path / "script.py"
    script.write_text("X = 1\n")
    module = types.ModuleType("test_pinned_main")
    module.__file__ = str(script)
    monkeypatch.setitem(sys.modules, "test_pinned_main", module)
    source_digest.cache_clear()
    module_digest.cache_clear()
    try:
        before = module_digest("test_pinned_main")
        assert before == source_digest("test_pinned_main")  # a script is the one file either way
        source_digest.cache_clear()  # a new process: it runs the script as it is now
        module_digest.cache_clear()
        cls = type("Pinned", (Solver,), {"__module__": "test_pinned_main", "params": {},
                                        "predict": lambda self, batch: batch.ols_prediction})
        register_solver("test-pinned")(cls)
        script.write_text("X = 2\n")  # edited while the run goes on
        assert module_digest("test_pinned_main") == before
    finally:
        REGISTRY.unregister("test-pinned")
        source_digest.cache_clear()
        module_digest.cache_clear()


def test_a_plugin_without_a_source_file_is_never_reused_across_processes(monkeypatch):
    """A solver typed into an interactive session has no file to hash: its digest is new in
    every process (never "", which would let a later session reuse cells of other code)."""
    monkeypatch.setitem(sys.modules, "test_typed_main", types.ModuleType("test_typed_main"))
    first = source_digest("test_typed_main")
    assert source_digest("test_typed_main") == first  # stable within one process
    source_digest.cache_clear()
    module_digest.cache_clear()
    second = source_digest("test_typed_main")
    source_digest.cache_clear()
    module_digest.cache_clear()
    assert first and second and first != second


def test_a_cell_without_a_well_posed_prompt_is_skipped_with_its_reason(tmp_path, capsys):
    """N = 2 examples cannot fit d = 2 slopes and an intercept: every prompt is ill-posed, so the
    cell is skipped with that reason (and listed on stderr) instead of an "ok" row of NaN."""
    raw = dict(RAW, grid={**RAW["grid"], "N": [2, 4], "d": [1, 2]}, solvers={"ols": {}, "gd": {}})
    out = tmp_path / "run"
    code, _, err = _run(capsys, "--config", _cfg(tmp_path, raw), "--out", out)
    table = pd.read_parquet(out / "results.parquet")
    none = (table.N == 2) & (table.d == 2)
    assert code == 0 and (table[none].status == "skipped").all() and none.sum() == 2
    assert table[none].message.str.contains("N=2 examples for d=2 slopes and an intercept, at least 3").all()
    assert (table[~none].status == "ok").all() and "no well-posed prompt" in err


def _all_nan_solver():
    @register_solver("test-all-nan")
    class AllNaN(Solver):
        """Answers NaN everywhere."""
        params = {}

        def predict(self, batch):
            return torch.full((batch.B,), float("nan"), dtype=batch.dtype)

    return AllNaN


def test_a_solver_that_never_answers_is_flagged(tmp_path, capsys):
    _all_nan_solver()
    try:
        raw = dict(RAW, solvers={"ols": {}, "test-all-nan": {}})
        out = tmp_path / "run"
        code, stdout, err = _run(capsys, "--config", _cfg(tmp_path, raw), "--out", out)
        table = pd.read_parquet(out / "results.parquet")
        bad = table[table.solver == "test-all-nan"]
        assert (bad.n_nonfinite == bad.n_prompts).all()
        assert bad.message.str.contains("no finite prediction").all()
        assert (table[table.solver == "ols"].message == "").all()
        assert "test-all-nan" in err and "no finite prediction" in err
        rep = tmp_path / "rep"
        assert main(["publish", str(out), "--out", str(rep)]) == 0
        assert "no finite prediction" in (rep / "headline.md").read_text() + (rep / "index.html").read_text()
        import shutil  # a copy of the run published beside it: its cells are not counted twice (a review)

        shutil.copytree(out, tmp_path / "copy")
        assert main(["publish", str(out), str(tmp_path / "copy"), "--out", str(tmp_path / "rep2")]) == 0
        n = len(bad)
        assert (f"test-all-nan: no finite prediction (NaN / inf on every well-posed prompt) in {n} of {n} cells"
                in (tmp_path / "rep2" / "headline.md").read_text())
    finally:
        REGISTRY.unregister("test-all-nan")


def test_the_headline_warns_only_of_solvers_at_its_setting(tmp_path, capsys):
    """The headline said "Warning: test-all-nan: no finite prediction ..." though test-all-nan ran
    only in another run, at another dtype, and has no row in it (a review); the notes keep it."""
    _all_nan_solver()
    try:
        _run(capsys, "--config", _cfg(tmp_path, RAW), "--out", tmp_path / "a")
        other = dict(RAW, grid=dict(RAW["grid"], dtype=["float32"]), solvers={"test-all-nan": {}})
        _run(capsys, "--config", _cfg(tmp_path, other, "b.toml"), "--out", tmp_path / "b")
        rep = tmp_path / "rep"
        assert main(["publish", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(rep), "--at", "dtype=float64"]) == 0
        assert "no finite prediction" not in (rep / "headline.md").read_text()
        assert "test-all-nan: no finite prediction" in (rep / "index.html").read_text()
    finally:
        REGISTRY.unregister("test-all-nan")


def test_broken_plugin_is_skipped_loudly_in_the_default_run(plugin_path, tmp_path, capsys):
    raw = {k: v for k, v in RAW.items() if k != "solvers"}  # every solver, the default run's way
    raw["grid"] = dict(RAW["grid"], N=[4])
    out = tmp_path / "run"
    code, _, err = _run(capsys, "--config", _cfg(tmp_path, raw), "--out", out, "--solver", "ols")
    assert code == 0  # named solvers only: the broken plugin is not involved
    out2 = tmp_path / "run2"
    code, _, err = _run(capsys, "--config", _cfg(tmp_path, raw), "--out", out2)
    table = pd.read_parquet(out2 / "results.parquet")
    broken = table[table.solver == "plugin-broken"]
    assert code == 0, err
    assert (broken.status == "skipped").all() and broken.message.str.contains("broken on purpose").all()
    assert "WARNING" in err and "plugin-broken" in err and "broken on purpose" in err
    named = dict(raw, solvers={"plugin-broken": {}}, all_solvers=False)
    code, _, err = _run(capsys, "--config", _cfg(tmp_path, named, "n.toml"), "--out", tmp_path / "run3")
    assert code == 1  # asked for by name: its failure is the run's failure


def test_csv_rows_with_missing_values_are_dropped_and_counted(tmp_path, capsys):
    rng = np.random.default_rng(0)
    x = rng.normal(size=30)
    rows = [f"{a:.6f},{2 * a:.6f}" for a in x]
    rows[4], rows[9], rows[17] = "1.5,", ",2.0", "nan,1.0"
    data = tmp_path / "d.csv"
    data.write_text("x,y\n" + "\n".join(rows) + "\n")
    raw = dict(RAW, solvers={"ols": {}}, grid={k: v for k, v in RAW["grid"].items() if k != "noise"})  # none in CSV
    out = tmp_path / "run"
    code, _, err = _run(capsys, "--config", _cfg(tmp_path, raw), "--out", out, "--data", data, "--x", "x", "--y", "y")
    assert code == 0, err
    assert "dropped 3 of 30 rows" in err
    table = pd.read_parquet(out / "results.parquet")
    assert (table.n_nonfinite == 0).all()  # no prompt draws a dropped row
    assert json.loads((out / "metadata.json").read_text())["data_rows_dropped"] == 3


TRAIN = """
[defaults]
R = 10.0
N = [6]
steps = 2
batch_size = 16
eval_every = 1
eval_prompts = 16
progress = false

[runs.tiny]
solver = "{solver}"
"""


def test_train_refuses_a_used_out_and_unknown_solver_names(tmp_path, capsys):
    cfg = tmp_path / "t.toml"
    cfg.write_text(TRAIN.format(solver="trained-l2"))
    out = tmp_path / "models"
    assert main(["train", "--config", str(cfg), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "trained-l2" in err and "trained-l1" in err and not out.exists()
    cfg.write_text(TRAIN.format(solver="trained-l1"))
    assert main(["train", "--config", str(cfg), "--out", str(out), "--no-progress"]) == 0
    before = (out / "tiny.safetensors").read_bytes()
    capsys.readouterr()
    assert main(["train", "--config", str(cfg), "--out", str(out), "--no-progress"]) == 2
    assert "--out" in capsys.readouterr().err and (out / "tiny.safetensors").read_bytes() == before
    assert main(["train", "--config", str(cfg), "--out", str(out), "--no-progress", "--force"]) == 0


def test_ctrl_c_prints_the_resume_command(tmp_path, capsys, monkeypatch):
    def interrupted(cfg, out, **kwargs):
        if made:
            out.mkdir(exist_ok=True)  # as run_matrix does before its first cell, with the config it records
            (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_run, "_run_matrix", interrupted)
    cfg = _cfg(tmp_path, RAW)
    made = True
    code, _, err = _run(capsys, "--config", cfg, "--out", tmp_path / "run")
    assert code == 130
    assert "interrupted" in err and f"icl-bench run --no-progress --config {cfg} --out {tmp_path / 'run'} --resume" in err
    made = False  # interrupted before the folder was made (e.g. while joining a Dask cluster): no resume line
    code, _, err = _run(capsys, "--config", cfg, "--out", tmp_path / "run2")
    assert code == 130 and err == f"icl-bench: interrupted before {tmp_path / 'run2'} was made\n"
    (tmp_path / "run3").mkdir()  # an empty --out, stopped before the store wrote its config: --resume
    code, _, err = _run(capsys, "--config", cfg, "--out", tmp_path / "run3")  # would refuse it (a tryout)
    assert code == 130 and err == f"icl-bench: interrupted before anything was stored in {tmp_path / 'run3'}\n"


def test_replacing_a_checkpoint_invalidates_its_cells(tmp_path, capsys):
    from icl_bench.solvers.checkpoint import save_checkpoint
    from icl_bench.solvers.transformer import Transformer, TransformerConfig

    models = tmp_path / "models"

    def write(seed):
        torch.manual_seed(seed)
        model = Transformer(TransformerConfig(d_in=3, d_model=4, n_layers=2, n_heads=2, layernorm=True))
        save_checkpoint(model, models / "ckpt", {"solver": "trained-l1", "R": 10.0, "N": 6})

    write(0)
    raw = dict(RAW, solvers={"trained-l1": {"models_dir": str(models)}})
    cfg, out = _cfg(tmp_path, raw), tmp_path / "run"
    assert _run(capsys, "--config", cfg, "--out", out)[0] == 0
    first = pd.read_parquet(out / "results.parquet")
    assert (first.status == "ok").all()
    (out / "metadata.json").unlink()  # as after a crash: resumable
    write(1)  # the same file names, other weights
    code, _, err = _run(capsys, "--config", cfg, "--out", out, "--resume")
    assert code == 0, err
    assert json.loads((out / "metadata.json").read_text())["n_cells_reused"] == 0
    again = pd.read_parquet(out / "results.parquet")
    assert not np.allclose(again.mse_vs_ols, first.mse_vs_ols)


FLAKY = {"fail": True}


@pytest.fixture
def flaky_solver():
    @register_solver("test-flaky")
    class Flaky(Solver):
        """Raises while FLAKY["fail"] (a bug since fixed), else predicts 0."""
        params = {}

        def predict(self, batch):
            if FLAKY["fail"]:
                raise RuntimeError("a bug since fixed")
            return torch.zeros(batch.B, dtype=batch.dtype)

    FLAKY["fail"] = True
    yield
    REGISTRY.unregister("test-flaky")


@pytest.mark.parametrize("how", ["resume", "cache"])
def test_error_rows_are_tried_again_not_replayed(tmp_path, capsys, flaky_solver, how):
    """An error (or a skip) may not recur: --resume and --cache reuse only ok cells."""
    cfg = _cfg(tmp_path, dict(RAW, solvers={"ols": {}, "test-flaky": {}}))
    first = ["--out", tmp_path / "a"] + (["--cache", tmp_path / "cache"] if how == "cache" else [])
    assert _run(capsys, "--config", cfg, *first)[0] == 1
    FLAKY["fail"] = False
    again = ["--out", tmp_path / "a", "--resume"] if how == "resume" else ["--out", tmp_path / "b", "--cache", tmp_path / "cache"]
    code, _, err = _run(capsys, "--config", cfg, *again)
    out = tmp_path / ("a" if how == "resume" else "b")
    table = pd.read_parquet(out / "results.parquet")
    assert code == 0 and (table.status == "ok").all(), err
    assert json.loads((out / "metadata.json").read_text())["n_cells_reused"] == 2  # the two ols cells


def _snapshot(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_bad_cache_or_out_paths_write_nothing(tmp_path, capsys):
    cfg = _cfg(tmp_path, RAW)
    (tmp_path / "afile").write_text("x")
    code, _, err = _run(capsys, "--config", cfg, "--out", tmp_path / "o1", "--cache", tmp_path / "afile")
    assert code == 2 and err.count("\n") == 1 and "--cache" in err and not (tmp_path / "o1").exists()
    for argv, flag in ((["--out", ""], "--out"), (["--out", tmp_path / "o2", "--cache", ""], "--cache")):
        code, _, err = _run(capsys, "--config", cfg, *argv)
        assert code == 2 and err.startswith(f"icl-bench: error: {flag}: empty path"), err
    assert not (tmp_path / "o2").exists() and not (tmp_path / "cells.sqlite").exists()
    code, _, err = _run(capsys, "--config", cfg, "--out", tmp_path / "o4", "--cache", tmp_path / "o4" / "cache")
    assert code == 2 and "inside one" in err and not (tmp_path / "o4").exists()  # a cache in --out: refused
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("x")  # a refused --out (not empty) ...
    code, _, err = _run(capsys, "--config", cfg, "--out", tmp_path / "used", "--cache", tmp_path / "newcache")
    assert code == 2 and "not empty" in err and not (tmp_path / "newcache").exists()  # ... makes no new cache
    (tmp_path / "emptycache").mkdir()  # nor fills an empty cache folder (found by an adversarial review)
    code, _, err = _run(capsys, "--config", cfg, "--out", tmp_path / "used", "--cache", tmp_path / "emptycache")
    assert code == 2 and "not empty" in err and not list((tmp_path / "emptycache").iterdir())
    (tmp_path / "pub").mkdir()
    (tmp_path / "pub" / "publish.json").write_text("{}")  # a publish folder: `publish --force` would delete the cache
    code, _, err = _run(capsys, "--config", cfg, "--out", tmp_path / "o5", "--cache", tmp_path / "pub")
    assert code == 2 and err.startswith(f"icl-bench: error: --cache: {tmp_path / 'pub'} is a folder icl-bench publish wrote")
    assert not (tmp_path / "o5").exists() and [p.name for p in (tmp_path / "pub").iterdir()] == ["publish.json"]
    code, _, err = _run(capsys, "--config", cfg, "--out", tmp_path / "o5", "--cache", tmp_path / "pub" / "cache")
    assert code == 2 and "is inside a folder icl-bench publish wrote" in err and not (tmp_path / "o5").exists()
    (tmp_path / "dang").symlink_to(tmp_path / "nowhere")  # nor a dangling link (or one above the cache), nor a loop
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for cache, msg in (("dang", f"dang is a symbolic link to {tmp_path / 'nowhere'}, which is missing"),
                       ("dang/sub", f"dang is a symbolic link to {tmp_path / 'nowhere'}, which is missing"),
                       ("loop", f"loop is a symbolic link loop (a link to {tmp_path / 'loop'}, whose links lead in a circle)")):
        code, _, err = _run(capsys, "--config", cfg, "--out", tmp_path / "o6", "--cache", tmp_path / cache)
        assert code == 2 and err.startswith("icl-bench: error: --cache: ") and msg in err, err
        assert not (tmp_path / "o6").exists() and "Traceback" not in err
    (tmp_path / "bad" / "cells.sqlite").mkdir(parents=True)  # an unusable cache is refused before --out is made
    code, _, err = _run(capsys, "--config", cfg, "--out", tmp_path / "o6", "--cache", tmp_path / "bad")
    assert code == 2 and err.startswith("icl-bench: error: --cache: ") and not (tmp_path / "o6").exists(), err
    assert _run(capsys, "--config", cfg, "--out", tmp_path / "run")[0] == 0  # a finished run ...
    before = _snapshot(tmp_path / "run")
    code, _, err = _run(capsys, "--config", cfg, "--out", tmp_path / "o3", "--cache", tmp_path / "run")
    assert code == 2 and "is a run folder" in err and not (tmp_path / "o3").exists()
    assert _snapshot(tmp_path / "run") == before  # ... is not a cache: its store is left as it was


@pytest.mark.parametrize("name", ["config.json", ".icl-bench.lock", "metadata.json"])
def test_a_folder_with_any_run_file_is_not_a_cache(tmp_path, name):
    # guards check_path's run_files: a run folder copied without its config.json still holds a run's store
    from icl_bench.bench.cache import CellCache
    from icl_bench.errors import ConfigError

    (tmp_path / "c").mkdir()
    (tmp_path / "c" / name).write_text("{}")
    with pytest.raises(ConfigError, match=rf"^--cache: .* is a run folder or inside one \({name}\)"):
        CellCache.check_path(tmp_path / "c")


def test_a_cache_that_cannot_be_created_is_refused_by_its_path_check(tmp_path, monkeypatch):
    # guards check_path's os.access: an unwritable nearest folder is refused before --out is made
    import os

    from icl_bench.bench.cache import CellCache
    from icl_bench.errors import ConfigError

    (tmp_path / "ro").mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m, **k: False if str(p) == str(tmp_path / "ro") else real(p, m, **k))
    with pytest.raises(ConfigError, match=r"^--cache: cannot create a cell cache in .*ro/a/cache \(.*ro is not a writable folder\)$"):
        CellCache.check_path(tmp_path / "ro" / "a" / "cache")
    CellCache.check_path(tmp_path / "ok" / "cache")  # a writable one passes


@pytest.mark.parametrize("damage", ["foreign-table", "config-not-an-object", "config-nested-too-deep",
                                    "config-empty", "config-null", "results-is-a-folder"])
def test_resume_into_a_damaged_folder_is_one_line_and_changes_nothing(tmp_path, capsys, damage):
    import sqlite3

    cfg, out = _cfg(tmp_path, RAW), tmp_path / "run"
    assert _run(capsys, "--config", cfg, "--out", out)[0] == 0
    if damage == "foreign-table":
        (out / "cells.sqlite").unlink()
        with sqlite3.connect(out / "cells.sqlite") as db:
            db.execute("CREATE TABLE cells (key TEXT PRIMARY KEY, foo)")
    elif damage == "config-not-an-object":
        (out / "config.json").write_text("[]")
    elif damage == "config-nested-too-deep":  # was a RecursionError traceback from json
        (out / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    elif damage in ("config-empty", "config-null"):  # both read "holds a run of another config"
        (out / "config.json").write_text("" if damage == "config-empty" else "null")
    else:
        (out / "results.parquet").unlink()
        (out / "results.parquet").mkdir()
    before = _snapshot(out)
    code, _, err = _run(capsys, "--config", cfg, "--out", out, "--resume")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    if damage == "config-nested-too-deep":
        assert f"--resume: {out / 'config.json'} nests JSON too deeply to read" in err, err
    expected = {"config-empty": "cannot be read as JSON (JSONDecodeError): not an icl-bench run folder",
                "config-null": "holds null, not a run config", "config-not-an-object": "holds a list, not a run config"}
    if damage in expected:
        assert f"--resume: {out / 'config.json'} {expected[damage]}" in err, err
    assert _snapshot(out) == before


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowed one: the point
def test_a_ctrl_c_swallowed_by_a_c_callback_still_stops_the_run(tmp_path, monkeypatch):
    """Ctrl-C during a numba compile lands in llvmlite's ctypes callback, which prints "Exception
    ignored" and goes on, so the run used to finish and exit 0 (found by an adversarial review).
    Here a ctypes callback receives the SIGINT the same way: the run stops after that cell, and
    keeps it."""
    import ctypes
    import os
    import signal

    import icl_bench.bench.runner as runner
    from icl_bench.bench.config import parse_config
    from icl_bench.bench.schema import RESULT_COLUMNS
    from icl_bench.bench.store import CellStore

    real, calls = runner.run_cell_task, []

    @ctypes.CFUNCTYPE(None)
    def callback():  # the handler's KeyboardInterrupt is raised in here, and swallowed by ctypes
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10_000):
            pass

    def task(cell, **kw):
        calls.append(cell)
        if len(calls) == 1:
            callback()
        return real(cell, **kw)

    monkeypatch.setattr(runner, "run_cell_task", task)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)  # what `icl-bench run` starts with
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.run_matrix(parse_config(RAW), tmp_path / "run", progress=False)
    finally:
        signal.signal(signal.SIGINT, old)
    assert len(calls) == 1 and len(CellStore(tmp_path / "run", RESULT_COLUMNS, resume=True).load()) == 1


def test_sigterm_stops_a_run_like_ctrl_c_with_the_resume_line(tmp_path, capsys):
    """`kill` (or a batch scheduler's time limit) used to end a run silently with exit 143 and no
    word of how to resume (found by a new-user tryout). Now the finished cells are kept, the
    resume line is printed, and --resume completes the run."""
    import os
    import signal

    sent = []

    @register_solver("test-sigterm")
    class SendsSigterm(Solver):
        """Answers like OLS; the process receives SIGTERM once, in its cell at N = 6."""
        params = {}

        def predict(self, batch):
            if batch.N == 6 and not sent:
                sent.append(True)  # first: the handler raises as soon as the signal arrives
                os.kill(os.getpid(), signal.SIGTERM)
            return batch.ols_prediction.to(batch.dtype)

    cfg, out = _cfg(tmp_path, dict(RAW, solvers={"test-sigterm": {}})), tmp_path / "run"
    try:
        code, _, err = _run(capsys, "--config", cfg, "--out", out)
        assert code == 143 and "icl-bench: terminated (SIGTERM); 1 of " in err, err  # (the total: checked below)
        assert "--resume" in err and "Traceback" not in err
        stopped = err
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # main() leaves the process as it found it
        code, _, err = _run(capsys, "--config", cfg, "--out", out, "--resume")
    finally:
        REGISTRY.unregister("test-sigterm")
    assert code == 0, err
    assert json.loads((out / "metadata.json").read_text())["n_cells_reused"] == 1
    table = pd.read_parquet(out / "results.parquet")
    assert (table.status == "ok").all()
    assert f"; 1 of {len(table)} cells finished, kept in {out}. Resume with:" in stopped, stopped


def test_the_interruption_line_says_which_kept_cells_resume_runs_again(tmp_path, capsys):
    """A skipped or failed cell is stored but --resume runs it again (CellStore.load): the line
    "173 of 288 cells finished, kept" counted 86 cuda cells skipped for want of a GPU among the
    kept ones (a new-user tryout). It now says how many of them --resume runs again."""
    import os
    import signal

    @register_solver("test-fails-then-sigterm")
    class FailsThenSigterm(Solver):
        """OLS; fails at N = 5, and the process receives SIGTERM in its cell at N = 6."""
        params = {}

        def predict(self, batch):
            if batch.N == 5:
                raise RuntimeError("no answer at N = 5")
            if batch.N == 6:
                os.kill(os.getpid(), signal.SIGTERM)
            return batch.ols_prediction.to(batch.dtype)

    raw = dict(RAW, solvers={"test-fails-then-sigterm": {}}, grid=dict(RAW["grid"], N=[4, 5, 6]))
    out = tmp_path / "run"
    try:
        code, _, err = _run(capsys, "--config", _cfg(tmp_path, raw), "--out", out)
    finally:
        REGISTRY.unregister("test-fails-then-sigterm")
    assert code == 143, err
    assert (f"; 2 of 3 cells finished, kept in {out} (1 of them skipped or failed, which --resume runs again). "
            "Resume with:") in err, err


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # ctypes reports what it dropped
def test_a_sigterm_that_a_c_callback_swallows_still_stops_the_run(tmp_path, capsys):
    """A SIGTERM that lands inside a C callback (llvmlite's, while numba compiles a kernel) raised
    Terminated there, which ctypes prints and drops: the run went on to the end and exited 0
    (found by an adversarial review). The runner now checks after each cell that none came."""
    import ctypes
    import os
    import signal

    def in_callback():
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10_000):  # the handler runs here; ctypes drops what it raises
            pass

    callback = ctypes.CFUNCTYPE(None)(in_callback)
    sent = []

    @register_solver("test-sigterm-c")
    class SigtermInC(Solver):
        """Answers like OLS; the process receives SIGTERM inside a C callback, in its cell at N = 6."""
        params = {}

        def predict(self, batch):
            if batch.N == 6 and not sent:
                sent.append(True)
                callback()
            return batch.ols_prediction.to(batch.dtype)

    cfg, out = _cfg(tmp_path, dict(RAW, solvers={"test-sigterm-c": {}})), tmp_path / "run"
    try:
        code, _, err = _run(capsys, "--config", cfg, "--out", out)
    finally:
        REGISTRY.unregister("test-sigterm-c")
    assert sent and code == 143 and "icl-bench: terminated (SIGTERM); 2 of 2 cells finished, kept in" in err, err
    assert not (out / "results.parquet").exists()  # stopped after the cell, not at the end of the run
    from icl_bench.bench import runner
    from icl_bench.bench.config import parse_config
    try:  # a later run in this process goes on (the SIGTERM was recorded for main's run only)
        assert len(runner.run_matrix(parse_config(RAW), progress=False)) == 2
    except KeyboardInterrupt as exc:  # (Terminated is one: it would end the test session)
        pytest.fail(f"a later run_matrix stopped: {exc!r}")


def test_the_no_answer_warning_names_the_parameter_setting(capsys):
    """`mean-y: no finite prediction in 2 of 12 cells` did not say which shift answered nothing,
    and counted every shift's cells (found by a plugin author's tryout)."""
    from icl_bench.bench.contract import NO_ANSWER
    from icl_bench.report.run_summary import cell_warnings

    rows = [dict(solver="mean-y", solver_params=f'{{"shift": {s}}}', N=n, R=100.0, dtype="float64", status="ok",
                 message=f"{NO_ANSWER}: NaN/inf on all 16 well-posed prompts" if s == 5 else "")
            for s in (1, 5) for n in (10, 20)]
    skipped = dict(rows[-1], N=30, status="skipped", message="CUDA is not available")  # did not run: not counted
    cell_warnings(pd.DataFrame(rows + [skipped]))
    err = capsys.readouterr().err
    assert err.startswith(f"icl-bench: WARNING: mean-y shift=5: {NO_ANSWER} in 2 of the 2 cells it ran (e.g. N=10"), err


def test_metadata_records_the_command_as_typed(monkeypatch, tmp_path):
    """metadata.json records the command that made the run (a report named only the publish
    command; found by a review): the CLI as `icl-bench ...`, whichever way it was started."""
    import sys

    from icl_bench import provenance

    for argv0 in ("/venv/bin/icl-bench", "/src/icl_bench/__main__.py"):
        monkeypatch.setattr(sys, "argv", [argv0, "run", "--out", "results/runs/my run"])
        assert provenance.command_line() == "icl-bench run --out 'results/runs/my run'"
    monkeypatch.setattr(sys, "argv", ["bench.py", "--fast"])
    assert provenance.command_line() == "python bench.py --fast"
    monkeypatch.setattr(sys, "argv", ["/venv/lib/python3.11/site-packages/pytest/__main__.py", "-q"])
    assert provenance.command_line() == "python -m pytest -q"  # not this machine's path (a serial pytest's report)
    monkeypatch.setattr(sys, "argv", [])
    assert provenance.command_line() == "python"


def test_errors_vs_target_and_truth_are_over_the_well_posed_prompts_for_every_solver():
    """A plugin that answers a prompt with no least-squares answer (x constant) had that answer in
    its error vs the observed y, while ols (NaN there) was scored without it: 'mean-y 0.678' beside
    'ols 0.0183' were means over 512 and 187 prompts (found by a new-user tryout)."""
    import torch

    from icl_bench import make_batch
    from icl_bench.bench.metrics import prediction_metrics

    x = [[1.0, 2.0, 3.0], [1.0, 1.0, 1.0], [0.0, 1.0, 3.0]]  # the second prompt is ill-posed
    batch = make_batch(x, [[1.0, 2.0, 3.0]] * 3, [4.0, 4.0, 4.0], R=10.0, y_query=[4.0, 9.0, 5.0])
    answer = torch.tensor([4.5, 100.0, 5.5], dtype=torch.float64)  # finite everywhere, a mean-y-like plugin
    m = prediction_metrics(answer, batch)
    assert m["mse_vs_target"] == pytest.approx((0.5 ** 2 + 0.5 ** 2) / 2)  # not with (100 - 9)^2
    assert (m["n_ill_posed"], m["n_nonfinite"], m["n_nonfinite_well_posed"]) == (1, 0, 0)


NEEDS_DEP = '''
    import dep_not_yet_installed  # the plugin's own dependency, installed later
    import torch
    from icl_bench import Param, Solver

    class NeedsDep(Solver):
        """Predicts the shift."""
        params = {"shift": Param(0.0, "the prediction")}

        def predict(self, batch):
            return torch.full((batch.B,), self.values["shift"], dtype=batch.dtype)
'''


def test_a_plugin_that_failed_to_load_resumes_with_its_list_of_values(tmp_path, monkeypatch, capsys):
    """A plugin that could not load kept its parameter list unexpanded: one error row per grid
    point, config.json recorded `shift = [0.0, 1.0]` as one value, and once the dependency was
    installed --resume refused it ('expected float') while --config refused the file as another
    config: the run could not be finished (a review). The list is a grid here too."""
    from conftest import write_plugin

    site = write_plugin(tmp_path / "site", "dep-plugin", {"needs-dep": "needs_dep:NeedsDep"}, {"needs_dep": NEEDS_DEP})
    monkeypatch.syspath_prepend(str(site))
    REGISTRY.reset()
    try:
        cfg = _cfg(tmp_path, dict(RAW, all_solvers=False, solvers={"ols": {}, "needs-dep": {"shift": [0.0, 1.0]}}))
        assert _run(capsys, "--config", cfg, "--out", tmp_path / "run")[0] == 1
        first = pd.read_parquet(tmp_path / "run" / "results.parquet")
        repeated = _cfg(tmp_path, dict(RAW, solvers={"needs-dep": {"shift": [1, 1.0]}}), name="r.toml")
        code, _, err = _run(capsys, "--config", repeated, "--out", tmp_path / "r")  # one cell of a float parameter
        assert code == 2 and err.strip().endswith("solvers.needs-dep.shift: repeated values in [1, 1.0]"), err
        broken = first[first.solver == "needs-dep"]
        assert list(broken.status) == ["error"] * 4 and broken.solver_params.nunique() == 2  # 2 N x 2 values
        (site / "dep_not_yet_installed.py").write_text("")  # the dependency is installed
        REGISTRY.reset()
        code, _, err = _run(capsys, "--out", tmp_path / "run", "--resume")  # the recorded config
        table = pd.read_parquet(tmp_path / "run" / "results.parquet")
        assert code == 0 and (table.status == "ok").all(), err
        mine = table[table.solver == "needs-dep"]
        assert len(mine) == 4 and mine.mse_vs_target.notna().all() and mine.solver_params.nunique() == 2
    finally:
        sys.modules.pop("needs_dep", None)
        sys.modules.pop("dep_not_yet_installed", None)
        REGISTRY.reset()


def test_a_plugins_code_digest_covers_its_distributions_other_packages_and_requirements(tmp_path, monkeypatch):
    """A distribution shipping its maths in a second package (`mylib` beside the solver's `wrapsolv`)
    got its old cells back from --cache and --resume after `mylib` changed: the digest covered the
    solver's own package only (a plugin author's review). It now covers the distribution's other
    top-level packages and the versions of what it requires (extras left out)."""
    import numpy as np

    from icl_bench import provenance

    info = tmp_path / "wrap_dist-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: wrap-dist\nVersion: 1.0\nRequires-Dist: numpy>=1\n"
                                   "Requires-Dist: not-installed-pkg\nRequires-Dist: extra-only; extra == \"fast\"\n")
    (info / "top_level.txt").write_text("mylib\nwrapsolv\n..\nnot_importable_here\n")  # (RECORD-guessed names)
    for pkg, src in (("wrapsolv", "from mylib import shrink\n"), ("mylib", "def shrink():\n    return 1.0\n")):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text(src)
    monkeypatch.syspath_prepend(str(tmp_path))

    def fresh():
        for f in (provenance._tops, provenance.distribution_parts, source_digest, module_digest):
            f.cache_clear()

    try:
        fresh()
        parts = provenance.distribution_parts("wrapsolv")
        assert parts == (f"mylib:{source_digest('mylib')}", "not_importable_here:absent", f"numpy={np.__version__}",
                         "not-installed-pkg=absent")  # '..' skipped; a name import cannot find is no random digest
        before = provenance.code_digest("wrapsolv")
        (tmp_path / "mylib" / "__init__.py").write_text("def shrink():\n    return 0.5\n")
        fresh()
        assert provenance.code_digest("wrapsolv") != before
        assert provenance.distribution_parts("icl_bench_baselines") == ()  # icl-bench's own: code_digest has it
    finally:
        fresh()


def test_a_log_line_during_a_run_with_a_progress_bar_starts_on_its_own_line(monkeypatch, capsys):
    """The "compiled a fused kernel" line was written straight after the progress bar, glued to
    it ("0/144 [00:00<?, ?cell/s]icl-bench: compiled ..."; a new-user tryout): log records now go
    through tqdm while the bar is shown, which clears the bar, prints the line and redraws it."""
    import logging

    import icl_bench.bench.runner as runner
    from icl_bench.bench.config import parse_config

    line = "icl-bench: compiled a fused kernel (a test)"
    run_cell = runner.run_cell

    def logs_then_runs(*args, **kwargs):
        logging.getLogger("icl_bench.solvers.fused").warning(line)  # (as fused._first_call logs it)
        return run_cell(*args, **kwargs)

    monkeypatch.setattr(runner, "run_cell", logs_then_runs)
    monkeypatch.setattr(logging.root, "handlers", [])  # as in `icl-bench run` (pytest's own handlers capture logs)
    runner.run_matrix(parse_config(RAW), None, progress=True)
    err = capsys.readouterr().err
    starts = [m.start() for m in re.finditer(re.escape(line), err)]
    assert len(starts) == 2 and all(err[i - 1] in "\r\n" for i in starts), err
