"""The l1 sweep driver: trains the grid, writes both tables, reuses checkpoints, rejects bad configs."""
import pandas as pd
import pytest

from icl_bench.errors import ConfigError
from icl_bench.cli import main
from icl_bench.training.config import read_sweep
from icl_bench.training.sweep import run_sweep

TINY = """
[sweep]
l1 = [0.0, 1e-3]
seeds = [0]
out = "{out}"
eval_prompts = 128
analysis_prompts = 64
[train]
steps = 6
batch_size = 32
eval_every = 3
eval_prompts = 32
"""


def test_sweep_writes_tables_and_reuses(tmp_path):
    cfg = tmp_path / "s.toml"
    cfg.write_text(TINY.format(out=tmp_path / "out" / "l1.v1"))
    table = run_sweep(str(cfg), progress=False)
    assert len(table) == 2 and set(table.l1) == {0.0, 1e-3} and table.rel_mse.notna().all()
    csv = pd.read_csv(tmp_path / "out" / "l1.v1.csv")
    assert len(csv) == 2 and {"mse_vs_ols", "sparsity", "weight_l1"} <= set(csv.columns)
    assert {"similarity", "probe.division.r2", "hoyer"} <= set(csv.columns) and csv.similarity.between(0, 1).all()
    md = (tmp_path / "out" / "l1.v1.md").read_text()
    assert "Made by: `icl-bench sweep" in md and md.count("\n| 0") == 2
    models = sorted(p.name for p in (tmp_path / "out" / "l1.v1_models").glob("*.safetensors"))
    assert len(models) == 2
    again = run_sweep(str(cfg), reuse=True, progress=False)  # no retraining: identical weights -> same numbers
    pd.testing.assert_frame_equal(again, table)


@pytest.mark.parametrize("text, field", [
    ("[sweep]\nl1 = []\n", "sweep.l1"),
    ("[sweep]\nl1 = [-1.0]\n", "sweep.l1"),
    ("[sweep]\nl1 = [0.0]\nseeds = 3\n", "sweep.seeds"),
    ("[sweep]\nl1 = [0.0]\nlambdas = [1]\n", "sweep.lambdas"),
    ("[sweep]\nl1 = [0.0]\n[train]\nl1 = 0.1\n", "train.l1"),
])
def test_bad_sweep_config(tmp_path, text, field):
    cfg = tmp_path / "s.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=f"^{field}:"):
        read_sweep(str(cfg))
    assert main(["sweep", "--config", str(cfg)]) == 2
