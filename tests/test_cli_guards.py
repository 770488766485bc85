"""Guards found by a new-user review: limits, unwritable paths, plugins that exit, bad --checkpoint."""
import signal
import sys

import pytest
import tomli_w

from icl_bench.cli import main
from icl_bench.solvers.registry import list_solvers


def _run(capsys, argv):
    code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("edit, expected", [
    ({"timing": {"threads": 100000}}, "timing.threads: must be <= 1024"),
    ({"solvers": {"gd-lsa": {"steps": 10**9}}}, "solvers.gd-lsa.steps: must be <= 4096"),
    ({"solvers": {"gd": {"steps": 5000}}}, "solvers.gd.steps: must be <= 4096"),
])
def test_limits_are_config_errors(tmp_path, capsys, tiny_raw, edit, expected):
    tiny_raw.update(edit)
    (tmp_path / "c.toml").write_text(tomli_w.dumps(tiny_raw))
    code, err = _run(capsys, ["run", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "o")])
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"icl-bench: error: {expected}") and not (tmp_path / "o").exists()


def test_unwritable_publish_out_is_one_line(tmp_path, capsys, tiny_raw, monkeypatch):
    (tmp_path / "c.toml").write_text(tomli_w.dumps(tiny_raw))
    assert main(["run", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    capsys.readouterr()
    import icl_bench.report.publish

    for exc in (PermissionError(13, "Permission denied"), OSError(30, "Read-only file system")):
        def denied(*a, exc=exc, **k):  # as mkdtemp raises it: naming the hidden folder beside --out
            exc.filename = str(tmp_path / ".pub.k2x9q1.tmp")
            raise exc

        monkeypatch.setattr(icl_bench.report.publish.tempfile, "mkdtemp", denied)
        code, err = _run(capsys, ["publish", str(tmp_path / "run"), "--out", str(tmp_path / "pub")])
        assert code == 2 and err == f"icl-bench: error: --out: {tmp_path / 'pub'}: {exc.strerror}\n"


def test_bad_checkpoint_named_on_publish_is_exit_2(tmp_path, capsys, tiny_raw):
    (tmp_path / "c.toml").write_text(tomli_w.dumps(tiny_raw))
    assert main(["run", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    (tmp_path / "text.safetensors").write_text("not a checkpoint")
    capsys.readouterr()
    code, err = _run(capsys, ["publish", str(tmp_path / "run"), "--out", str(tmp_path / "pub"),
                              "--checkpoint", str(tmp_path / "text.safetensors")])
    assert code == 2 and err.count("\n") == 1 and not (tmp_path / "pub").exists()


def test_a_folder_named_as_checkpoint_is_one_line(tmp_path, capsys):
    """A folder is not a checkpoint (was "metadata file <folder>.json is missing"); a pair whose stem
    is also a folder's name still loads."""
    from icl_bench.solvers.checkpoint import load_checkpoint, save_checkpoint
    from icl_bench.solvers.transformer import Transformer, TransformerConfig

    (tmp_path / "ckpts").mkdir()
    code, err = _run(capsys, ["analyze", str(tmp_path / "ckpts"), "--out", str(tmp_path / "a.json")])
    assert code == 2 and err.startswith(f"icl-bench: error: checkpoint: {tmp_path / 'ckpts'} is a folder; ") and err.count("\n") == 1
    assert not (tmp_path / "a.json").exists()
    save_checkpoint(Transformer(TransformerConfig(n_layers=1, n_heads=1)), tmp_path / "ckpts")  # ckpts.json beside ckpts/
    assert load_checkpoint(tmp_path / "ckpts")[1]["format"] == "icl-bench-checkpoint"


def test_train_checks_out_before_training(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    code, err = _run(capsys, ["train", "--config", "train", "--out", str(tmp_path / "file")])
    assert code == 2 and err == f"icl-bench: error: --out: {tmp_path / 'file'} exists and is not a folder\n"


def test_train_checks_a_folder_that_takes_no_files_before_training(tmp_path, capsys, monkeypatch):
    """A read-only --out folder is refused before any step runs (simulated as in the analyze test)."""
    import tempfile

    import icl_bench.training.train as train

    def read_only(*a, **k):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(train, "train_and_save", lambda *a, **k: pytest.fail("training ran"))
    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    code, err = _run(capsys, ["train", "--run", "trained-lsa-R10", "--out", str(tmp_path)])
    assert code == 2
    assert err == (f"icl-bench: error: --out: cannot write {tmp_path / 'trained-lsa-R10'}.safetensors "
                   f"({tmp_path}: Read-only file system); give another folder\n")


def test_analyze_checks_out_before_analysing(tmp_path, capsys, monkeypatch):
    """--out under a file is refused before the analysis runs (it used to fail after it)."""
    import icl_bench.analysis.analyze as analyze

    monkeypatch.setattr(analyze, "analyze_checkpoint", lambda *a, **k: pytest.fail("analysis ran"))
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "a.json"
    code, err = _run(capsys, ["analyze", "trained-l1-R100", "--out", str(out)])
    assert code == 2 and err == f"icl-bench: error: --out: {tmp_path / 'file'} is a file, so {out} cannot be written; give another path\n"


def test_analyze_checks_a_folder_that_takes_no_files_before_analysing(tmp_path, capsys, monkeypatch):
    """A read-only folder (or /proc) as --out's folder failed only after the whole analysis, naming
    a hidden temporary file (found by a new-user tryout); it is refused first, naming --out. The
    read-only mount is simulated: the check's temporary file fails as it would there."""
    import tempfile

    import icl_bench.analysis.analyze as analyze

    def read_only(*a, **k):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(analyze, "analyze_checkpoint", lambda *a, **k: pytest.fail("analysis ran"))
    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    out = tmp_path / "a.json"
    code, err = _run(capsys, ["analyze", "trained-l1-R100", "--out", str(out)])
    assert code == 2
    assert err == f"icl-bench: error: --out: cannot write {out} ({tmp_path}: Read-only file system); give another path\n"
    assert list(tmp_path.iterdir()) == []


def test_plugin_that_exits_on_import_is_listed_as_broken(tmp_path, monkeypatch):
    from conftest import write_plugin

    import icl_bench.solvers.registry as registry

    root = write_plugin(tmp_path / "site", "exiting-plugin", {"plugin-exits": "exiting_mod:X"},
                        {"exiting_mod": "raise SystemExit('plugin exited')\n"})
    monkeypatch.syspath_prepend(str(root))
    try:
        infos = {i.name: i for i in list_solvers()}
        assert infos["plugin-exits"].error == "SystemExit: plugin exited"
        assert infos["ols"].error is None
    finally:
        registry.REGISTRY.unregister("plugin-exits")
        sys.modules.pop("exiting_mod", None)


def test_plugin_raising_generatorexit_on_import_is_listed_as_broken(tmp_path, monkeypatch):
    """Any BaseException but KeyboardInterrupt (GeneratorExit crashed list and run) marks the plugin broken."""
    from conftest import write_plugin

    import icl_bench.solvers.registry as registry

    root = write_plugin(tmp_path / "site", "genexit-plugin", {"plugin-genexit": "genexit_mod:X", "plugin-huge": "huge_mod:X"},
                        {"genexit_mod": "raise GeneratorExit('at import')\n",
                         "huge_mod": "raise ValueError('line\\n' + 'x' * 10**6)\n"})
    monkeypatch.syspath_prepend(str(root))
    try:
        infos = {i.name: i for i in list_solvers()}
        assert infos["plugin-genexit"].error == "GeneratorExit: at import"
        assert infos["ols"].error is None
        # a 10^6-character import error was listed (and put in error rows) whole: one short line now
        assert infos["plugin-huge"].error == "ValueError: line " + "x" * 495 + "… (1000005 characters)"
    finally:
        registry.REGISTRY.unregister("plugin-genexit")
        registry.REGISTRY.unregister("plugin-huge")
        sys.modules.pop("genexit_mod", None)
        sys.modules.pop("huge_mod", None)


def test_plugin_shadowing_a_builtin_or_another_plugin_is_warned(tmp_path, monkeypatch, capsys):
    from conftest import GOOD_PLUGIN, write_plugin

    first = write_plugin(tmp_path / "a", "first-plugin", {"dup-solver": "dup_a:MeanY", "ln-closed-form": "dup_a:MeanY"},
                         {"dup_a": GOOD_PLUGIN})
    second = write_plugin(tmp_path / "b", "second-plugin", {"dup-solver": "dup_b:MeanY"}, {"dup_b": GOOD_PLUGIN})
    monkeypatch.syspath_prepend(str(second))
    monkeypatch.syspath_prepend(str(first))
    import icl_bench.solvers.registry as registry

    try:
        assert main(["list"]) == 0
        out = capsys.readouterr().out
        assert "WARNING: plugin dup_a:MeanY (first-plugin) declares 'ln-closed-form', a built-in name: ignored" in out
        assert "WARNING: plugin dup_b:MeanY (second-plugin) declares 'dup-solver', already declared by dup_a:MeanY: ignored" in out
        assert registry.REGISTRY.origin("dup-solver").startswith("plugin dup_a:MeanY") and "built-in" in registry.REGISTRY.origin("ln-closed-form")
    finally:
        for name in ("dup-solver",):
            registry.REGISTRY.unregister(name)
        for mod in ("dup_a", "dup_b"):
            sys.modules.pop(mod, None)


def test_run_warns_of_plugin_name_clashes_as_list_does(tmp_path, monkeypatch, capsys):
    """A second package declaring `ols` and `ln-closed-form` got WARNING lines from `list` only; `run`
    was silent, and which `ols` ran depended on sys.path order (found by a new-user tryout). Now
    `run` prints the same lines to stderr, once, before the matrix."""
    from conftest import GOOD_PLUGIN, write_plugin

    root = write_plugin(tmp_path / "site", "shadow-plugin", {"ols": "shadow_mod:MeanY", "ln-closed-form": "shadow_mod:MeanY"},
                        {"shadow_mod": GOOD_PLUGIN})
    monkeypatch.setattr(sys, "path", [*sys.path, str(root)])  # after the suite's own distribution: its ols wins
    (tmp_path / "m.toml").write_text("n_prompts = 8\n[grid]\nN = [10]\n[solvers.gd-lsa]\n[timing]\nrepeats = 1\n")
    try:
        assert main(["list"]) == 0
        listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("WARNING: ")]
        assert len(listed) == 2 and all("shadow_mod:MeanY (shadow-plugin)" in line for line in listed), listed
        assert main(["run", "--config", str(tmp_path / "m.toml"), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
        err = capsys.readouterr().err
        assert [line for line in err.splitlines() if line.startswith("icl-bench: WARNING: plugin")] == [
            f"icl-bench: {line}" for line in listed], err  # (stderr's warnings share one prefix)
        assert "declares 'ln-closed-form', a built-in name: ignored" in err and "declares 'ols', already declared by" in err
    finally:
        sys.modules.pop("shadow_mod", None)

def test_publish_help_lists_every_axis_at_accepts(capsys):
    """`publish --help` said --at takes (N, noise, R, dtype, device); d and ood were accepted too.
    The help's list is cli.AT_AXES, pinned here to the grid axes publish validates --at against."""
    from icl_bench.bench.axes import AXIS_NAMES
    from icl_bench.cli import AT_AXES
    from icl_bench.report.load import AXES

    assert AT_AXES == AXIS_NAMES == tuple(AXES)
    with pytest.raises(SystemExit):
        main(["publish", "--help"])
    assert f"({', '.join(AXIS_NAMES)})" in " ".join(capsys.readouterr().out.split())

def test_config_help_lists_the_packaged_configs_each_command_runs(capsys):
    from icl_bench import resources

    assert resources.config_names("run") == ["default", "ood", "trained"]
    assert resources.config_names("train") == ["train"] and resources.config_names("sweep") == ["l1_sweep"]
    for command, names in (("run", "default, ood, trained"), ("train", "(train;"), ("sweep", "(l1_sweep;")):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert names in text, (command, text)
    assert "l1_sweep" not in text.replace("(l1_sweep; default: l1_sweep)", "")


def test_a_closed_stdout_is_not_reported_as_an_error():
    """`icl-bench list | head -1`: the reader goes away; no '--out: Broken pipe' error, and the exit
    code of a writer killed by SIGPIPE (141), which cannot pass for a success."""
    import subprocess

    p = subprocess.Popen([sys.executable, "-m", "icl_bench", "list"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # before the command writes (it imports torch first)
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and "error" not in err, err


def test_publish_checkpoint_takes_a_shipped_name(tmp_path, capsys, tiny_raw):
    """`publish --checkpoint trained-l1-R100` draws the shipped model, as `analyze trained-l1-R100`
    does, and records the name as typed (not this machine's path); an unknown name is one line."""
    (tmp_path / "c.toml").write_text(tomli_w.dumps(tiny_raw))
    assert main(["run", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    capsys.readouterr()
    code, err = _run(capsys, ["publish", str(tmp_path / "run"), "--out", str(tmp_path / "bad"),
                              "--checkpoint", "trained-l1-R99"])
    assert code == 2 and err.startswith("icl-bench: error: --checkpoint: no checkpoint 'trained-l1-R99' (")
    assert "trained-l1-R100" in err and err.count("\n") == 1 and not (tmp_path / "bad").exists()
    assert main(["publish", str(tmp_path / "run"), "--out", str(tmp_path / "pub"), "--checkpoint", "trained-l1-R100"]) == 0
    out = capsys.readouterr().out
    assert "--checkpoint" not in out  # no "--checkpoint ...: not drawn" note
    report = (tmp_path / "pub" / "report.md").read_text()
    assert "--checkpoint trained-l1-R100" in report and "site-packages" not in report and "icl_bench/models" not in report
    assert (tmp_path / "pub" / "plots" / "weights.png").is_file()


def test_publish_of_a_run_with_no_ok_cell_is_a_report(tmp_path, capsys, tiny_raw):
    """A run whose every cell was skipped (here a cuda grid where there is no GPU) published to a
    traceback in the mechanism section (an empty table's text column divided); now to a report that
    says what it left out."""
    raw = {**tiny_raw, "grid": {**tiny_raw["grid"], "device": ["cuda"]}, "solvers": {"ols": {}}}
    (tmp_path / "c.toml").write_text(tomli_w.dumps(raw))
    main(["run", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "run"), "--no-progress"])
    capsys.readouterr()
    assert main(["publish", str(tmp_path / "run"), "--out", str(tmp_path / "pub")]) == 0
    assert (tmp_path / "pub" / "report.md").is_file()


def test_ctrl_c_after_the_table_is_written_says_it_is_complete(tmp_path, capsys, tiny_raw, monkeypatch):
    """A Ctrl-C while the summary prints used to say only "interrupted", as if cells were lost
    (found by a new-user tryout); the table is complete then, and the message says so."""
    import icl_bench.report.run_summary

    def ctrl_c(table):
        raise KeyboardInterrupt

    monkeypatch.setattr(icl_bench.report.run_summary, "console_summary", ctrl_c)
    (tmp_path / "c.toml").write_text(tomli_w.dumps(tiny_raw))
    code = main(["run", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 130 and err.endswith(f"icl-bench: interrupted after the run had finished; its table is complete "
                                        f"in {tmp_path / 'run'}\n"), err
    assert (tmp_path / "run" / "metadata.json").is_file()


def test_odd_flags_are_named_in_their_one_line_errors(tmp_path, capsys, tiny_raw, monkeypatch):
    """Found by an adversarial review: errors that named a path or a config key instead of the flag
    typed, and a repeated --at whose last value won silently."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text(tomli_w.dumps(tiny_raw))
    assert main(["run", "--config", "c.toml", "--out", "run", "--no-progress"]) == 0
    (tmp_path / "afile").write_text("x")
    cases = [(["publish", "run", "--out", "afile/sub"], "--out: afile: File exists"),
             (["publish", "run", "--out=afile/sub"], "--out: afile: File exists"),
             (["run", "--config", "c.toml", "--out", "a" * 300], "--out: " + "a" * 300 + ": File name too long"),
             (["run", "--config", "c.toml", "--ou", "a" * 300], "--out: " + "a" * 300 + ": File name too long"),
             (["run", "--config", "c.toml", "--solver", ""], "--solver: empty name; give a solver's name (icl-bench list)"),
             (["publish", "run", "--out", "p", "--at", "N=4", "--at", "N=8"],
              "--at: N is given twice (N=4, N=8); give each axis once")]
    capsys.readouterr()
    for argv, expected in cases:
        code, err = _run(capsys, argv)
        assert code == 2 and err == f"icl-bench: error: {expected}\n", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "c.toml", "run"]


def test_ctrl_c_while_a_finished_run_shuts_down_says_it_is_complete(tmp_path, capsys, tiny_raw, monkeypatch):
    """A Ctrl-C while a Dask cluster shut down, after metadata.json was written, offered a resume
    as if cells were lost (found by a tryout of the Dask executor)."""
    import icl_bench.cli_run as cli

    real = cli._run_matrix

    def finished_then_ctrl_c(*a, **k):
        real(*a, **k)
        raise KeyboardInterrupt  # as from the executor's close()

    monkeypatch.setattr(cli, "_run_matrix", finished_then_ctrl_c)
    (tmp_path / "c.toml").write_text(tomli_w.dumps(tiny_raw))
    code = main(["run", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 130 and err == (f"icl-bench: interrupted after the run had finished; its table is complete in "
                                   f"{tmp_path / 'run'}\n"), err


def test_ctrl_c_while_the_libraries_load_is_one_line(tmp_path, monkeypatch, capsys):
    """A Ctrl-C during `import torch` (the first second of every command) left numpy / torch
    half-imported and printed unrelated tracebacks (RecursionError, a C++ abort); it is held back
    until the libraries are loaded, then the command stops with its usual line (found by a review).
    `import icl_bench.cli` itself loads neither torch nor pandas, so main() is running by then."""
    import subprocess

    from icl_bench import startup

    code = "import sys, icl_bench.cli; print('torch' in sys.modules, 'pandas' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False False\n"
    (tmp_path / "slow_lib.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGINT)\nx = sum(range(10**5))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(startup, "LIBRARIES", ("slow_lib",))
    old = signal.signal(signal.SIGINT, signal.default_int_handler)  # what `icl-bench` starts with; another
    try:  # test in this xdist worker may have left its own (the recorder then steps aside, by design)
        assert main(["list"]) == 130
    finally:
        signal.signal(signal.SIGINT, old)
    assert capsys.readouterr().err == "icl-bench: interrupted\n"
    import slow_lib

    assert slow_lib.x == sum(range(10**5))  # the import ran to its end
    # found by the review of that change: a library that fails to import (numba is optional) is
    # left to the code that needs it; a SIGINT the process ignores (a background job) stays ignored
    monkeypatch.setattr(startup, "LIBRARIES", ("no_such_library_here", "slow_lib"))
    capsys.readouterr()
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        del sys.modules["slow_lib"]
        assert startup.load_libraries() is False
        assert main(["list"]) == 0 and capsys.readouterr().err == ""
    finally:
        signal.signal(signal.SIGINT, old)
    code = "import icl_bench; print(icl_bench.solvers.registry.get_solver.__module__, 'import_module' in dir(icl_bench))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == "icl_bench.solvers.registry False\n"  # subpackages as attributes, as before the lazy names


def test_ctrl_c_while_the_command_line_imports_is_one_line():
    """The console script starts in icl_bench/__main__.py: a Ctrl-C while icl_bench.cli itself
    imports (0.2-0.4 s of pydantic, before cli.main can catch anything) printed a traceback; it is
    recorded until the import is whole, then the command stops with its usual line (a tryout)."""
    import subprocess

    code = ("import builtins, os, signal, sys\n"
            "real = builtins.__import__\n"
            "def hook(name, *a, **k):\n"
            "    if name == 'pydantic' and 'pydantic' not in sys.modules:\n"
            "        os.kill(os.getpid(), signal.SIGINT)\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = hook\n"
            "from icl_bench.__main__ import main\n"
            "rc = main()\n"
            "print(rc, 'icl_bench.cli' in sys.modules, sys.modules['pydantic'].__name__)\n")
    proc = subprocess.run([sys.executable, "-c", code, "list"], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "130 True pydantic\n", "icl-bench: interrupted\n")
    proc = subprocess.run([sys.executable, "-m", "icl_bench", "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("icl-bench ")  # without a Ctrl-C: the command runs


def test_publish_force_deletes_only_what_an_earlier_publish_wrote(tmp_path, capsys, tiny_raw):
    """publish --force replaced all of --out: a --checkpoint it was drawing from there, and models or
    notes put there after the earlier publish, were deleted (found by a review). publish.json now
    lists its files; --force refuses anything else, and a --checkpoint inside --out is refused."""
    import json

    from icl_bench.solvers.checkpoint import save_checkpoint
    from icl_bench.solvers.transformer import Transformer, TransformerConfig

    (tmp_path / "c.toml").write_text(tomli_w.dumps(tiny_raw))
    assert main(["run", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    pub = tmp_path / "pub"
    assert main(["publish", str(tmp_path / "run"), "--out", str(pub)]) == 0
    files = json.loads((pub / "publish.json").read_text())["files"]
    assert files == sorted(p.relative_to(pub).as_posix() for p in pub.rglob("*") if p.is_file())
    save_checkpoint(Transformer(TransformerConfig()), pub / "ck" / "m")  # written there after the publish
    capsys.readouterr()
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    forced = ["publish", str(tmp_path / "run"), "--out", str(pub), "--force"]
    code, err = _run(capsys, forced + ["--checkpoint", str(pub / "ck" / "m")])
    assert code == 2 and err == (f"icl-bench: error: --checkpoint: {pub / 'ck' / 'm'} is inside --out {pub}, which "
                                 "publish replaces; keep it outside\n")
    code, err = _run(capsys, forced)
    assert code == 2 and err == (f"icl-bench: error: --out: {pub} holds ck, which icl-bench publish did not write there; "
                                 "--force would delete it: move it out or choose another folder\n")
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    info = json.loads((pub / "publish.json").read_text())
    del info["files"]  # a publish.json of before the list: publish's own file names
    (pub / "publish.json").write_text(json.dumps(info))
    (pub / "ck").rename(tmp_path / "ck")
    (pub / "plots" / "mine.png").write_bytes(b"a plot of mine")
    code, err = _run(capsys, forced)
    assert code == 2 and err.startswith(f"icl-bench: error: --out: {pub} holds plots/mine.png, which"), err
    assert (pub / "plots" / "mine.png").read_bytes() == b"a plot of mine"
    (pub / "plots" / "mine.png").unlink()
    assert main(forced + ["--checkpoint", str(tmp_path / "ck" / "m")]) == 0  # drawn from outside: fine
    assert (tmp_path / "ck" / "m.safetensors").is_file() and "plots/weights.png" in json.loads((pub / "publish.json").read_text())["files"]


def test_out_as_a_dangling_link_says_so(tmp_path, capsys, tiny_raw):
    """--out a link to a folder that does not exist read '--out: cannot write to lnk (File exists)'."""
    (tmp_path / "c.toml").write_text(tomli_w.dumps(tiny_raw))
    (tmp_path / "lnk").symlink_to(tmp_path / "gone")
    code, err = _run(capsys, ["run", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "lnk"), "--no-progress"])
    assert code == 2 and err == (f"icl-bench: error: --out: {tmp_path / 'lnk'} is a link to {tmp_path / 'gone'}, which does "
                                 "not exist; create that folder or choose another --out\n")
    assert not (tmp_path / "gone").exists() and (tmp_path / "lnk").is_symlink()


def test_publish_force_over_odd_publish_json_or_an_unmovable_out(tmp_path, capsys, tiny_raw, monkeypatch):
    """A publish.json nested too deeply was a RecursionError traceback under --force; an --out that
    cannot be moved aside (a mount point: EBUSY) left an empty hidden '.old' folder behind, which the
    next --force refused (found by a review). Now: a one-line error, and nothing left over."""
    import errno
    from pathlib import Path

    (tmp_path / "c.toml").write_text(tomli_w.dumps(tiny_raw))
    assert main(["run", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    pub = tmp_path / "pub"
    assert main(["publish", str(tmp_path / "run"), "--out", str(pub)]) == 0
    (pub / "publish.json").write_text("[" * 100_000 + "]" * 100_000)
    assert main(["publish", str(tmp_path / "run"), "--out", str(pub), "--force"]) == 0  # its own names: replaced
    capsys.readouterr()
    real = Path.rename

    def busy(self, target):
        if self == pub and str(target).endswith("previous"):
            raise OSError(errno.EBUSY, "Device or resource busy", str(self))
        return real(self, target)

    monkeypatch.setattr(Path, "rename", busy)
    code, err = _run(capsys, ["publish", str(tmp_path / "run"), "--out", str(pub), "--force"])
    assert code == 2 and err == f"icl-bench: error: --out: {pub}: Device or resource busy\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml", "pub", "run"]  # no .pub.*.old, no .tmp


def test_version_is_the_installed_distributions(capsys):
    """`icl-bench --version` answers (it was an error) with the installed distribution's version."""
    from importlib.metadata import version

    from icl_bench.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"icl-bench {version('icl-bench')}"


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["--version"]])
def test_help_and_version_answer_without_loading_torch(argv):
    """`icl-bench --help` took 2 s: every command loaded numpy, torch, pandas, scipy and numba first."""
    import subprocess
    import sys

    code = ("import sys\nfrom icl_bench.cli import main\ntry:\n    main(%r)\nexcept SystemExit as e:\n"
            "    assert e.code == 0, e.code\nprint('torch' in sys.modules, 'numba' in sys.modules)" % (argv,))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False False", out.stdout


def test_a_symbolic_link_loop_is_named_in_one_line(tmp_path, capsys, tiny_raw, monkeypatch):
    """`publish` with a link loop as RUN_DIR or --out gave a `RuntimeError: Symlink loop` traceback
    (Path.resolve); `run --out loop1` said "a link to loop2, which does not exist" (found by an
    adversarial review). Each is one line saying it is a loop, exit 2, nothing written."""
    (tmp_path / "c.toml").write_text(tomli_w.dumps(tiny_raw))
    assert main(["run", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loop1").symlink_to("loop2")
    (tmp_path / "loop2").symlink_to("loop1")
    capsys.readouterr()
    loop = "loop1 is a symbolic link loop (a link to loop2, whose links lead in a circle)"
    before = sorted(p.name for p in tmp_path.iterdir())
    for argv, expected in (
            (["publish", "--out", "pub", "loop1"], f"RUN_DIR: {loop}; give the --out folder of `icl-bench run`"),
            (["publish", "--out", "pub", "run", "loop1"], f"RUN_DIR: {loop}; give the --out folder of `icl-bench run`"),
            (["publish", "--out", "loop1", "run"], f"--out: {loop}; remove it or choose another folder"),
            (["publish", "--out", "loop1/pub", "run"], f"--out: {loop}; remove it or choose another folder"),
            (["run", "--config", "c.toml", "--out", "loop1"], f"--out: {loop}; remove it or choose another folder"),
            (["run", "--config", "c.toml", "--out", "loop1", "--resume"], f"--out: {loop}; remove it or choose another folder"),
            (["run", "--config", "c.toml", "--out", "o", "--cache", "loop1"], f"--cache: {loop}; remove it or choose another folder"),
            (["train", "--out", "loop1", "--steps", "1"], f"--out: {loop}; remove it or choose another folder")):
        code, err = _run(capsys, argv)
        assert code == 2 and err == f"icl-bench: error: {expected}\n", (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_docs_lists_prints_and_refuses_in_one_line(capsys):
    """`icl-bench docs`: the docs that messages cite as docs/NAME.md, readable where only a wheel is."""
    assert main(["docs"]) == 0
    out = capsys.readouterr().out
    assert "analysis  " in out and "Mechanism analysis" in out and "scale-out" in out
    assert main(["docs", "docs/scale-out.md", "--path"]) == 0
    assert capsys.readouterr().out.strip().endswith("docs/scale-out.md")
    code, err = _run(capsys, ["docs", "analysys"])
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("icl-bench: error: NAME: no doc 'analysys' (did you mean 'analysis'?); docs: accuracy, ")
    assert main(["docs", "--path"]) == 0 and capsys.readouterr().out.strip().endswith("docs")  # the folder
    code, err = _run(capsys, ["docs", "REPORT"])
    assert code == 2 and "(did you mean 'report'?)" in err
    code, err = _run(capsys, ["docs", "results/analysis.md"])  # a docs/ name under another folder
    assert code == 2 and "no doc 'results/analysis.md'" in err


def test_docs_and_help_answer_without_loading_torch():
    """`icl-bench docs NAME`, which messages cite, took 4-5 s here: every command loaded numpy,
    torch, pandas, scipy and numba first. It and --help now load none of them."""
    import subprocess

    code = ("import sys; from icl_bench.cli import main; main(['docs', 'analysis', '--path']); "
            "sys.argv = ['icl-bench', 'run', '--help']\ntry: main()\nexcept SystemExit: pass\n"
            "print(sorted(m for m in ('numpy', 'torch', 'pandas', 'scipy', 'numba') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.splitlines()[0].endswith("docs/analysis.md"), p.stderr
    assert "usage: icl-bench run" in p.stdout and p.stdout.splitlines()[-1] == "[]", p.stdout


def test_a_full_stdout_is_named_as_stdout_by_commands_without_out(capsys, monkeypatch):
    """`icl-bench docs > /dev/full` said "--out: No space left on device": docs has no --out (a tryout)."""
    import errno

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

    for argv in (["docs"], ["docs", "analysis"], ["list"]):
        monkeypatch.setattr(sys, "stdout", Full())
        assert main(argv) == 2, argv
        monkeypatch.undo()
        assert capsys.readouterr().err == "icl-bench: error: stdout: No space left on device\n", argv


def test_analyze_of_a_solver_name_says_where_its_mechanism_is_read(capsys):
    """`icl-bench analyze ridge` said only "no checkpoint 'ridge'" (a new-user tryout)."""
    code, err = _run(capsys, ["analyze", "gd-lsa"])
    assert code == 2 and err.count("\n") == 1
    assert err.rstrip().endswith("'gd-lsa' is a solver, which analyze cannot read: its behavioural fingerprint is the "
                                 "Mechanism table of `icl-bench run --config ood --solver gd-lsa` then `icl-bench "
                                 "publish`, whose verdict judges x-shifts up to 5 and x-scales 0.1-10 only "
                                 "(docs/report.md), where analyze's fingerprint of a checkpoint also weighs x+20, so "
                                 "the two can differ (docs/analysis.md)")
    code, err = _run(capsys, ["analyze", "no-such-thing"])
    assert code == 2 and "is a solver" not in err


def test_a_mistyped_solver_table_beside_solver_is_warned(tmp_path, capsys, tiny_raw):
    """`--solver ols` with a [solvers.scipy-lstq] typo ran without a word (a new-user tryout)."""
    tiny_raw["solvers"] = {"ols": {}, "scipy-lstq": {}}
    (tmp_path / "c.toml").write_text(tomli_w.dumps(tiny_raw))
    assert main(["run", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "o"), "--solver", "ols",
                 "--no-progress"]) == 0
    assert ("icl-bench: WARNING: --solver: the config's [solvers] scipy-lstq names no known solver (a typo?); left out "
            "with the tables --solver did not select") in capsys.readouterr().err


def test_runs_started_in_one_second_get_folders_of_their_own(tmp_path, capsys, tiny_raw, monkeypatch):
    """Without --out a run wrote results/runs/<second>; three runs started together in one second
    shared the name and two were refused as "not empty; pass --resume" (found by a new-user
    tryout). The folder is now made atomically, "-2", "-3" appended when the name is taken."""
    import datetime as dt

    import icl_bench.cli_run as cli_run

    class Frozen(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return dt.datetime(2026, 12, 7, 12, 43, 47)

    monkeypatch.setattr(cli_run, "datetime", Frozen)
    monkeypatch.chdir(tmp_path)
    assert cli_run.fresh_run_folder() == tmp_path.joinpath("results/runs/20261207-124347").relative_to(tmp_path)
    assert cli_run.fresh_run_folder().name == "20261207-124347-2"  # (each is made: the next name is free)
    (tmp_path / "c.toml").write_text(tomli_w.dumps({**tiny_raw, "grid": {**tiny_raw["grid"], "N": [5], "noise": [0.0],
                                                                         "dtype": ["float64"]}}))
    assert main(["run", "--config", "c.toml", "--no-progress"]) == 0
    assert "wrote results/runs/20261207-124347-3/results.parquet" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "results/runs").iterdir()) == [
        "20261207-124347", "20261207-124347-2", "20261207-124347-3"]
    from icl_bench.errors import ConfigError

    def refused(*a, **k):  # as an unreachable --scheduler is found, after the folder is made
        raise ConfigError("--scheduler: cannot connect")

    monkeypatch.setattr(cli_run, "_run_matrix", refused)
    assert main(["run", "--config", "c.toml", "--no-progress"]) == 2
    assert not (tmp_path / "results/runs/20261207-124347-4").exists()  # no empty folder left behind


def test_a_run_without_out_stopped_before_it_wrote_leaves_no_folder(tmp_path, capsys, tiny_raw, monkeypatch):
    """The folder made before the run (fresh_run_folder) outlived a refusal or a Ctrl-C that came
    before the store wrote to it, with results/ and results/runs/, and the Ctrl-C printed a resume
    command that --resume refused ("holds no run to continue"; found by a review)."""
    import icl_bench.cli_run as cli_run
    from icl_bench.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text(tomli_w.dumps(tiny_raw))
    for stop, code in ((ConfigError("--cache: afile is a file, not a folder"), 2), (KeyboardInterrupt(), 130)):
        def refused(*a, stop=stop, **k):
            raise stop

        monkeypatch.setattr(cli_run, "_run_matrix", refused)
        assert main(["run", "--config", "c.toml", "--no-progress"]) == code
        assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml"]  # no results/, no results/runs/
        err = capsys.readouterr().err
        assert "Resume with" not in err and (code == 2 or err.startswith(
            "icl-bench: interrupted before anything was stored; the empty folder results/runs/")), err
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "runs").write_text("")  # a file where the runs go; then a link to nothing
    assert main(["run", "--config", "c.toml", "--no-progress"]) == 2
    assert capsys.readouterr().err == ("icl-bench: error: --out: not given, and results/runs is not a folder, so "
                                       "results/runs/<time> cannot be made; give --out DIR\n")
    (tmp_path / "results" / "runs").unlink()
    (tmp_path / "results" / "runs").symlink_to(tmp_path / "gone")
    assert main(["run", "--config", "c.toml", "--no-progress"]) == 2
    assert f"results/runs is a link to {tmp_path / 'gone'}, which does not exist" in capsys.readouterr().err


def test_the_resume_command_names_out_and_resume_once():
    """The printed resume line read `... --resume --resume` for a resumed run (found by a mutation
    review; argparse took it, a reader would not)."""
    from pathlib import Path

    from icl_bench.cli_run import _resume_command

    assert _resume_command(["run", "--out", "o", "--resume"], Path("o")) == "icl-bench run --out o --resume"
    assert _resume_command(["run", "--config", "my run.toml"], Path("r/x")) == \
        "icl-bench run --config 'my run.toml' --out r/x --resume"


def test_a_ctrl_c_in_a_resume_of_a_finished_run_is_not_read_as_finished(tmp_path, capsys, tiny_raw, monkeypatch):
    """A finished run's metadata.json stays while --resume retries its skipped or failed cells; a
    Ctrl-C then is not "after the run had finished" (the file predates this run): the resume line
    is printed (found by a mutation review: the file's age was not checked)."""
    import icl_bench.cli_run as cli_run

    (tmp_path / "c.toml").write_text(tomli_w.dumps(tiny_raw))
    argv = ["run", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "run"), "--no-progress"]
    assert main(argv) == 0 and (tmp_path / "run" / "metadata.json").is_file()
    capsys.readouterr()

    def stopped(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_run, "_run_matrix", stopped)
    assert main([*argv, "--resume"]) == 130
    err = capsys.readouterr().err
    assert "Resume with:" in err and "after the run had finished" not in err, err


@pytest.mark.parametrize("message, expected", [
    ("argument --workers: invalid int value: 'x'", "--workers: 'x' is not an integer (icl-bench P --help)"),
    ("argument --at: invalid float value: 'y'", "--at: 'y' is not a number (icl-bench P --help)"),
    ("argument command: invalid choice: 'nosuch' (choose from 'list', 'run')",
     "command: 'nosuch' is not one of list, run (icl-bench P --help)"),
    ("argument --steps: expected one argument", "--steps: needs a value (icl-bench P --help)"),
    ("argument --run: expected at least one argument", "--run: needs a value (icl-bench P --help)"),
    ("the following arguments are required: RUN_DIR, --out", "RUN_DIR, --out: required (icl-bench P --help)"),
    ("argument --a: not allowed with argument --b", "--a: not allowed with argument --b"),  # other argument problems
    ("ambiguous option: --s could match --solver, --scheduler", "--s: ambiguous, could be --solver, --scheduler "
     "(icl-bench P --help)"),
    ("argument --resume: ignored explicit argument 'yes'", "--resume: takes no value (got 'yes') (icl-bench P --help)"),
    ("unrecognized shape: x", "unrecognized shape: x"),
])
def test_argparse_messages_read_field_then_problem(message, expected):
    """argparse's own errors in the `field: problem` form of every other bad input (a message of an
    unknown shape is kept as argparse wrote it, never lost)."""
    from icl_bench.cli import _field_form

    assert _field_form(message, "icl-bench P") == expected


def test_unrecognized_arguments_name_the_command(capsys):
    """argparse reports unknown arguments from the top parser, which knows no command: the message
    names the command they were given to and its --help."""
    assert main(["docs", "analysis", "extra", "--more"]) == 2
    assert capsys.readouterr().err == ("icl-bench: error: extra --more: not an argument of icl-bench docs "
                                       "(icl-bench docs --help)\n")
    assert main(["list", "--x"]) == 2
    assert capsys.readouterr().err == "icl-bench: error: --x: not an argument of icl-bench list (icl-bench list --help)\n"
    assert main(["--bogus", "list"]) == 2  # given before the command: the top level's (a review)
    assert capsys.readouterr().err == "icl-bench: error: --bogus: not an argument of icl-bench (icl-bench --help)\n"
    assert main(["run", "--s", "x"]) == 2
    assert capsys.readouterr().err == ("icl-bench: error: --s: ambiguous, could be --solver, --scheduler "
                                       "(icl-bench run --help)\n")
