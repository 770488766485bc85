"""Config parsing. The bad-input cases (configs, flags, CSV data, checkpoints) live in one
catalogue: tests/test_bad_inputs.py; here only the real console-script check and the parser's
own semantics."""
import subprocess
import sys

from icl_bench.bench.config import parse_config


def test_no_traceback_through_the_console_script(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[grid]\nR = [-1.0]\n")
    p = subprocess.run([sys.executable, "-m", "icl_bench", "run", "--config", str(cfg), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr == "icl-bench: error: grid.R: must be finite and > 0 (got -1.0)\n"
    assert not (tmp_path / "o").exists()


def test_scalars_are_fixed_values_and_lists_are_axes(tiny_raw):
    tiny_raw["grid"]["N"] = 7
    tiny_raw["solvers"] = {"ols": {}}
    cfg = parse_config(tiny_raw)
    assert cfg.grid["N"] == [7] and cfg.solvers == {"ols": [{}]}


def test_a_byte_order_mark_is_skipped(tmp_path):
    from icl_bench.bench.config import load_config
    from icl_bench.config_base import read_toml

    text = "seed = 3\n[grid]\nN = [7]\n[solvers.ols]\n"
    (tmp_path / "plain.toml").write_text(text)
    (tmp_path / "bom.toml").write_bytes(b"\xef\xbb\xbf" + text.encode())  # as some Windows editors save UTF-8
    assert read_toml(tmp_path / "bom.toml") == read_toml(tmp_path / "plain.toml") == {"seed": 3, "grid": {"N": [7]},
                                                                                        "solvers": {"ols": {}}}
    assert load_config(tmp_path / "bom.toml") == load_config(tmp_path / "plain.toml")


def test_minus_zero_is_zero(tiny_raw):
    import math

    from icl_bench.bench.cells import expand_cells

    keys = []
    for v in (0, 0.0, -0.0):
        tiny_raw["grid"]["noise"] = [v]
        cfg = parse_config(tiny_raw)
        assert math.copysign(1.0, cfg.grid["noise"][0]) == 1.0
        keys.append(sorted(c.key for c in expand_cells(cfg)))
    assert keys[0] == keys[1] == keys[2]  # one value, one set of cells (and prompt seeds)


def test_a_matrix_times_on_one_torch_thread_unless_told():
    """A config without [timing] ran at torch's default threads (2 here): under load a plugin's cells
    timed 250x slower than on one thread, with concurrency 1 (found by a new-user tryout). The design
    asks one thread per run; threads = 0 still keeps torch's default."""
    from icl_bench.bench.config import parse_config

    raw = {"grid": {"N": [4]}, "solvers": {"ols": {}}}
    assert parse_config(raw).timing.threads == 1
    assert parse_config({**raw, "timing": {"threads": 0}}).timing.threads == 0


def test_a_packaged_configs_bare_name_is_not_hidden_by_the_current_folder(tmp_path, monkeypatch, capsys):
    """With a folder `train/` (a common data folder) or `default/` in the current folder, a bare
    `icl-bench train` / `icl-bench run` failed with "--config: 'train' is a folder", and so did the
    resume command a run prints (`--config ood --out ood`); a file named `l1_sweep` was read as
    the sweep config (found by a new-user tryout). A bare name is the packaged config; a path names
    the local one."""
    import pytest
    from pathlib import Path

    from icl_bench import resources
    from icl_bench.cli import main
    from icl_bench.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    for name in ("default", "train", "ood"):
        (tmp_path / name).mkdir()
    (tmp_path / "l1_sweep").write_text("not = 'a sweep'\n")
    for name in ("default", "train", "ood", "l1_sweep"):
        assert resources.config_path(name) == resources.configs_dir() / f"{name}.toml"
    assert resources.config_path("./l1_sweep") == Path("l1_sweep")  # the local file, by its path
    (tmp_path / "default.toml").write_text("[grid]\nN = [5]\n")  # a path with its suffix: the local file
    assert resources.config_path("default.toml") == Path("default.toml")
    with pytest.raises(ConfigError, match="no such file 'mine'"):
        resources.config_path("mine")
    with pytest.raises(ConfigError, match=r"^--config: no such file './trained'; packaged"):  # a path is only that
        resources.config_path("./trained")  # file: it fell back to the packaged config (`./train` ran its 12 runs)
    (tmp_path / "ood").rmdir()
    (tmp_path / "ood").symlink_to(tmp_path / "gone.toml")
    with pytest.raises(ConfigError, match=rf"^--config: ./ood is a link to {tmp_path / 'gone.toml'}, which does not exist$"):
        resources.config_path("./ood")
    assert resources.config_path("ood.toml") == resources.configs_dir() / "ood.toml"  # a name with its suffix: as before
    capsys.readouterr()
    assert main(["run", "--config", "a" * 300]) == 2  # named --config, not the package's folder (a review)
    assert capsys.readouterr().err == f"icl-bench: error: --config: {'a' * 300}: File name too long\n"
    assert main(["run", "--config", "default", "--solver", "nope"]) == 2  # reaches the solver check, not "a folder"
    assert "--solver: unknown" in capsys.readouterr().err
