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
