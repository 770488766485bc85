"""The default matrix (the packaged icl_bench/configs/default.toml) is valid and every solver in it runs."""

from icl_bench import resources
from icl_bench.bench.config import parse_config
from icl_bench.config_base import read_toml
from icl_bench.solvers.registry import known_names
from icl_bench.bench.cells import expand_cells
from icl_bench.bench.runner import run_matrix

DEFAULT = resources.config_path("default")


def test_default_matrix_shape():
    cfg = parse_config(read_toml(DEFAULT))
    assert cfg.grid.to_dict() == {"N": [10, 30, 100, 300], "noise": [0.0, 0.1, 0.5], "R": [10.0, 100.0, 1000.0], "d": [1],
                        "dtype": ["float32", "float64"], "device": ["cpu", "cuda"], "ood": ["none"]}
    cells = expand_cells(cfg)
    assert {c.solver for c in cells} == set(known_names())
    assert {c.solver_params for c in cells if c.solver == "gd-lsa"} == {'{"steps": 1}', '{"steps": 4}', '{"steps": 16}'}
    assert {c.solver_params for c in cells if c.solver == "gd"} == {'{"steps": 1}', '{"steps": 4}', '{"steps": 16}'}


def test_every_default_solver_runs_on_a_slice_of_the_default_matrix():
    raw = read_toml(DEFAULT)
    raw.update(n_prompts=64, batch_size=64, timing={"repeats": 1})
    raw["grid"].update(N=[10], noise=[0.1], R=[100.0], device=["cpu"])
    table = run_matrix(parse_config(raw), progress=False)
    assert set(table.solver) == set(known_names())
    assert (table.status != "error").all(), table[table.status == "error"][["solver", "message"]].to_string()
    for name in ("ols", "scipy-lstsq", "gd", "gd-lsa", "ln-closed-form"):
        assert (table[table.solver == name].status == "ok").all(), name
    skipped = table[table.status == "skipped"]
    assert (skipped.message.str.len() > 0).all()  # a skipped cell always says why
