"""Every bad-config case: one line naming the key, exit code 2, no traceback, no output folder."""
import copy
import subprocess
import sys

import pytest
import tomli_w

from icl_bench.cli import main
from icl_bench.config import parse_config


def _drop(raw, *path):
    d = raw
    for k in path[:-1]:
        d = d[k]
    del d[path[-1]]


def _set(raw, value, *path):
    d = raw
    for k in path[:-1]:
        d = d.setdefault(k, {})
    d[path[-1]] = value


CASES = [  # (id, edit of the tiny config, text that must start the message after "icl-bench: error: ")
    ("unknown-top-key", lambda r: _set(r, 1, "sed"), "sed: unknown key; accepted: seed, n_prompts"),
    ("unknown-grid-key", lambda r: _set(r, [1], "grid", "M"), "grid.M: unknown key; accepted: N, noise, R, dtype, device"),
    ("seed-type", lambda r: _set(r, "zero", "seed"), "seed: expected an integer >= 0"),
    ("n_prompts-zero", lambda r: _set(r, 0, "n_prompts"), "n_prompts: must be >= 1"),
    ("batch-float", lambda r: _set(r, 2.5, "batch_size"), "batch_size: expected an integer >= 1"),
    ("N-small", lambda r: _set(r, [1, 10], "grid", "N"), "grid.N: must be >= 2"),
    ("N-float", lambda r: _set(r, [10.5], "grid", "N"), "grid.N: expected an integer >= 2"),
    ("noise-negative", lambda r: _set(r, [-0.1], "grid", "noise"), "grid.noise: must be finite and >= 0"),
    ("R-zero", lambda r: _set(r, [0.0], "grid", "R"), "grid.R: must be finite and > 0"),
    ("R-inf", lambda r: _set(r, [float("inf")], "grid", "R"), "grid.R: must be finite and > 0"),
    ("R-nan", lambda r: _set(r, float("nan"), "grid", "R"), "grid.R: must be finite and > 0"),
    ("R-string", lambda r: _set(r, ["big"], "grid", "R"), "grid.R: expected a number"),
    ("dtype-unknown", lambda r: _set(r, ["float16"], "grid", "dtype"), "grid.dtype: unknown value 'float16'; accepted: float32, float64"),
    ("device-unknown", lambda r: _set(r, ["tpu"], "grid", "device"), "grid.device: unknown value 'tpu'; accepted: cpu, cuda"),
    ("grid-empty", lambda r: _set(r, [], "grid", "N"), "grid.N: empty list"),
    ("grid-repeat", lambda r: _set(r, [10, 10], "grid", "N"), "grid.N: repeated values"),
    ("solver-unknown", lambda r: _set(r, {}, "solvers", "olss"), "solvers.olss: unknown name 'olss'; known: "),
    ("solver-param-unknown", lambda r: _set(r, 3, "solvers", "ols", "steps"), "solvers.ols.steps: unknown parameter"),
    ("solvers-empty", lambda r: _set(r, {}, "solvers"), "solvers: empty table"),
    ("all-solvers-type", lambda r: _set(r, "yes", "all_solvers"), "all_solvers: expected true or false"),
    ("prompt-dist", lambda r: _set(r, {"dist": "cauchy"}, "prompts", "x"), "prompts.x.dist: unknown distribution 'cauchy'; accepted: normal, uniform"),
    ("prompt-scale", lambda r: _set(r, {"scale": -1.0}, "prompts", "slope"), "prompts.slope.scale: must be finite and >= 0"),
    ("prompt-key", lambda r: _set(r, {"mean": 1.0}, "prompts", "x"), "prompts.x.mean: unknown key; accepted: dist, loc, scale"),
    ("timing-repeats", lambda r: _set(r, 0, "timing", "repeats"), "timing.repeats: must be >= 1"),
    ("data-missing-file", lambda r: _set(r, {"path": "no/such.csv", "x": "x", "y": "y"}, "data"), "data.path: no such file"),
    ("data-missing-key", lambda r: _set(r, {"path": "matplotlib:msft.csv", "x": "Open"}, "data"), "data.y: required text value"),
    ("data-missing-column", lambda r: _set(r, {"path": "matplotlib:msft.csv", "x": "Open", "y": "Shut"}, "data"),
     "data.y: no column 'Shut' in msft.csv; columns: Date, Open"),
    ("data-text-column", lambda r: _set(r, {"path": "matplotlib:msft.csv", "x": "Date", "y": "Close"}, "data"), "data.x: column 'Date' is not numeric"),
    ("data-too-few-rows", lambda r: (_set(r, {"path": "matplotlib:msft.csv", "x": "Open", "y": "Close"}, "data"), _set(r, [100], "grid", "N")),
     "grid.N: N=100 needs at least 101 rows of data; msft.csv has 65"),
]


@pytest.mark.parametrize("edit, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_config_one_line_exit_2_no_output(tmp_path, capsys, tiny_raw, edit, expected):
    raw = copy.deepcopy(tiny_raw)
    edit(raw)
    cfg = tmp_path / "bad.toml"
    cfg.write_text(tomli_w.dumps(raw))
    out = tmp_path / "out"
    code = main(["run", "--config", str(cfg), "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("icl-bench: error: " + expected), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("text, expected", [
    ("seed = [", "--config: bad.toml is not valid TOML"),
    (b"seed = '\xff\xfe'", "--config: bad.toml is not UTF-8 text"),
])
def test_unreadable_config(tmp_path, capsys, text, expected):
    cfg = tmp_path / "bad.toml"
    cfg.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert main(["run", "--config", str(cfg), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.startswith("icl-bench: error: " + expected)
    assert not (tmp_path / "o").exists()


def test_cli_flag_errors(tmp_path, capsys):
    assert main(["run", "--config", str(tmp_path / "none.toml"), "--out", str(tmp_path / "o")]) == 2
    assert "--config: no such file" in capsys.readouterr().err
    assert main(["run", "--solver", "nope", "--out", str(tmp_path / "o")]) == 2
    assert "solvers.nope: unknown name 'nope'" in capsys.readouterr().err
    assert main(["run", "--data", "matplotlib:msft.csv", "--out", str(tmp_path / "o")]) == 2
    assert "--data: needs --x COLUMN and --y COLUMN" in capsys.readouterr().err
    assert main(["frobnicate"]) == 2
    assert capsys.readouterr().err.startswith("icl-bench: error: argument command: invalid choice")
    assert not (tmp_path / "o").exists()


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
