"""Config parsing. The bad-input cases (configs, flags, CSV data, checkpoints) live in one
catalogue: tests/test_bad_inputs.py; here only the real console-script check and the parser's
own semantics."""
import os
import re
import subprocess
import sys

import pytest

from icl_bench.bench.config import parse_config
from icl_bench.errors import ConfigError


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


@pytest.mark.parametrize("key, value, expected", [
    (("n_prompts",), True, "n_prompts: expected an integer >= 1, got True"),  # TOML true is no count
    (("grid", "noise"), [True], "grid.noise: expected a number, got True"),  # nor a number
])
def test_true_and_false_are_no_numbers(tiny_raw, key, value, expected):
    raw = tiny_raw
    for k in key[:-1]:
        raw = raw[k]
    raw[key[-1]] = value
    with pytest.raises(ConfigError, match=f"^{re.escape(expected)}$"):
        parse_config(tiny_raw)


def test_field_validators_take_their_bounds_inclusively():
    """integer(lo, hi) takes hi itself (seed = 2**63 - 1, threads = 1024); file_stem takes names of
    up to 200 characters, not starting with '.' (a hidden file, or '..')."""
    from pydantic_core import PydanticCustomError

    from icl_bench.config_base import MAX_SEED, file_stem, integer

    assert integer(0, MAX_SEED)(MAX_SEED) == MAX_SEED and integer(0, 1024)(1024) == 1024
    with pytest.raises(PydanticCustomError, match=r"must be <= 1024 \(got 1025\)"):
        integer(0, 1024)(1025)
    assert file_stem("a" * 200) == "a" * 200 and file_stem("_x.y-z") == "_x.y-z"
    for bad in ("a" * 201, ".x", "..", ".", "-x", "a/b"):
        with pytest.raises(PydanticCustomError, match="bad name"):
            file_stem(bad)


def test_a_list_index_is_dropped_from_the_key_an_error_names():
    """format_error names `<dotted.key>` without list indices (the TOML key the user wrote)."""
    from icl_bench.config_base import ConfigModel, validate

    class Listed(ConfigModel):
        values: list[int] = []

    with pytest.raises(ConfigError, match=r"^values: Input should be a valid integer"):
        validate(Listed, {"values": [1, "x"]})


def test_the_prompt_values_of_a_grid_point_count_the_query_row(tiny_raw):
    """A prompt is N context rows and one query: n_prompts * (N + 1) values, at most MAX_VALUES
    (2**27). 2**20 prompts of N = 127 are exactly that; one prompt more is refused."""
    tiny_raw["grid"] = {"N": [127], "dtype": ["float64"]}
    tiny_raw["n_prompts"] = 2**20
    assert parse_config(tiny_raw).n_prompts == 2**20
    tiny_raw["n_prompts"] = 2**20 + 1
    with pytest.raises(ConfigError, match=r"^n_prompts: n_prompts \* \(N \+ 1\) = 134217856 prompt values exceed 134217728"):
        parse_config(tiny_raw)


def test_R_may_be_the_extremes_of_its_dtype(tiny_raw):
    """The largest finite value and the smallest normal value of a dtype are an R it can hold."""
    from icl_bench.config_base import FLOAT_MAX, FLOAT_TINY

    for dtype in ("float32", "float64"):
        tiny_raw["grid"] = {"N": [5], "dtype": [dtype], "R": [FLOAT_TINY[dtype], FLOAT_MAX[dtype]]}
        assert parse_config(tiny_raw).grid["R"] == [FLOAT_TINY[dtype], FLOAT_MAX[dtype]]
        tiny_raw["grid"]["R"] = [FLOAT_TINY[dtype] / 2]
        with pytest.raises(ConfigError, match=rf"^grid\.R: R=.* underflows {dtype}"):
            parse_config(tiny_raw)


def test_a_matrix_of_exactly_max_cells_is_accepted():
    """MAX_CELLS (10**6) cells are allowed, one more are not: 1000 grid points x 1000 settings."""
    raw = {"n_prompts": 16, "grid": {"N": list(range(2, 1002))}, "solvers": {"gd": {"steps": list(range(1, 1001))}}}
    assert len(parse_config(raw).solvers["gd"]) == 1000
    raw["solvers"]["gd"]["steps"].append(1001)
    with pytest.raises(ConfigError, match=r"^grid: 1000 grid points x 1001 solver settings = 1001000 cells, more than 1000000"):
        parse_config(raw)


def test_all_solvers_counts_a_named_solver_once():
    """With all_solvers, the solvers not named in [solvers] add one setting each; a named one is
    counted by its table only: K solvers in all make points x K cells, accepted up to MAX_CELLS."""
    from icl_bench.solvers.registry import known_names

    points = 10**6 // len(known_names())
    raw = {"n_prompts": 1, "batch_size": 1, "all_solvers": True, "grid": {"N": list(range(2, 2 + points))},
           "solvers": {"ols": {}}}
    assert parse_config(raw).solvers == {"ols": [{}]}


def test_a_dask_executor_may_use_four_processes_per_cpu_and_a_scheduler_without_scheme(tiny_raw):
    """n_workers = 4 per CPU is the most a LocalCluster takes (one more is refused); a scheduler
    given as HOST:PORT, as Dask accepts it, is tcp://HOST:PORT."""
    most = 4 * (os.cpu_count() or 1)
    tiny_raw["executor"] = {"kind": "dask", "n_workers": most}
    assert parse_config(tiny_raw).executor.n_workers == most
    tiny_raw["executor"]["n_workers"] = most + 1
    with pytest.raises(ConfigError, match=rf"^executor\.n_workers: {most + 1} LocalCluster processes"):
        parse_config(tiny_raw)
    tiny_raw["executor"] = {"kind": "dask", "scheduler": "localhost:8786"}
    assert parse_config(tiny_raw).executor.scheduler == "localhost:8786"
    tiny_raw["executor"]["scheduler"] = "localhost"
    with pytest.raises(ConfigError, match=r"^executor\.scheduler: 'localhost' has no valid port"):
        parse_config(tiny_raw)


def test_a_broken_plugins_parameter_lists_are_grids_without_repeats(plugin_path, tiny_raw):
    """A plugin that fails to import has no Param to check its values, yet a list is still a grid of
    distinct values: lists of lists (or inline tables) too, compared as values."""
    tiny_raw["solvers"] = {"plugin-broken": {"k": [[1, 2], [3, 4]], "w": [{"a": 1}, {"a": 2}]}}
    assert parse_config(tiny_raw).solvers["plugin-broken"] == [
        {"k": [1, 2], "w": {"a": 1}}, {"k": [1, 2], "w": {"a": 2}}, {"k": [3, 4], "w": {"a": 1}}, {"k": [3, 4], "w": {"a": 2}}]
    for repeated in ([1, 1.0], [[1, 2], [1, 2]]):
        tiny_raw["solvers"] = {"plugin-broken": {"k": repeated}}
        with pytest.raises(ConfigError, match=rf"^solvers\.plugin-broken\.k: repeated values in {re.escape(repr(repeated))}$"):
            parse_config(tiny_raw)
