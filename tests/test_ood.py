"""OOD prompts: shifts and scales of x keep the OLS prediction; Student-t x is heavy-tailed with
the same line; outliers replace the asked fraction of context y; bad values are config errors."""
import math

import pytest
import torch

from icl_bench.errors import ConfigError
from icl_bench.prompts.ood import OUTLIER_SIZE, apply_ood, parse_ood
from icl_bench.prompts.generator import PromptSpec, sample_prompts


@pytest.fixture(scope="module")
def batch():
    return sample_prompts(PromptSpec(N=20, noise=0.1, R=100.0), 512, seed=0, dtype="float64")


@pytest.mark.parametrize("value", ["x-shift:5", "x-shift:-1", "x-scale:10", "x-scale:0.1"])
def test_x_maps_keep_ols_and_truth(batch, value):
    out = apply_ood(batch, value, seed=1)
    torch.testing.assert_close(out.ols_prediction, batch.ols_prediction, rtol=1e-8, atol=1e-8)
    assert torch.equal(out.y, batch.y) and torch.equal(out.y_query, batch.y_query)
    assert not torch.equal(out.x, batch.x) and out.tokens.shape == batch.tokens.shape


def test_student_t_is_heavy_tailed_on_the_same_line(batch):
    out = apply_ood(batch, "student-t:3", seed=1)
    kurt = lambda v: float(((v - v.mean()) ** 4).mean() / v.var() ** 2)  # noqa: E731
    assert kurt(out.x.reshape(-1)) > 6 and kurt(batch.x.reshape(-1)) < 3.5
    torch.testing.assert_close(out.y_query_clean, batch.intercept + batch.slope * out.x_query)
    resid = out.y - batch.intercept[:, None] - batch.slope[:, None] * out.x
    torch.testing.assert_close(resid, batch.y - batch.intercept[:, None] - batch.slope[:, None] * batch.x)
    assert torch.equal(apply_ood(batch, "student-t:3", seed=1).x, out.x)  # reproducible


def test_outliers_replace_the_fraction(batch):
    out = apply_ood(batch, "outliers:0.1", seed=1)
    changed = (out.y != batch.y).sum(1)
    assert bool((changed == 2).all()) and bool((out.y[out.y != batch.y].abs() == OUTLIER_SIZE).all())
    assert torch.equal(out.x, batch.x) and not torch.allclose(out.ols_prediction, batch.ols_prediction)


def test_none_and_bad_values(batch):
    assert apply_ood(batch, "none", seed=0) is batch and math.isnan(parse_ood("none")[1])
    for bad in ["x-scale:0", "outliers:0", "outliers:2", "student-t:-1", "x-shift:nan", "shift:5", "x-shift", 5]:
        with pytest.raises(ConfigError, match="grid.ood"):
            parse_ood(bad)


def test_matrix_ood_axis_gives_every_solver_ood_rows(tmp_path):
    from icl_bench.bench.cells import expand_cells
    from icl_bench.bench.config import parse_config
    from icl_bench.bench.runner import run_matrix

    raw = {"seed": 0, "n_prompts": 64, "batch_size": 64, "timing": {"repeats": 1},
           "grid": {"N": [12], "noise": [0.1], "R": [100.0], "dtype": ["float64"], "device": ["cpu"],
                    "ood": ["none", "x-shift:5", "x-scale:10", "student-t:3", "outliers:0.1"]},
           "solvers": {"ols": {}, "gd": {"steps": [4]}}}
    cfg = parse_config(raw)
    cells = expand_cells(cfg)
    plain = [c for c in cells if c.ood == "none"]
    assert plain[0].key == expand_cells(parse_config({**raw, "grid": {**raw["grid"], "ood": ["none"]}}))[0].key
    table = run_matrix(cfg, tmp_path / "run", progress=False)
    assert set(table["ood"]) == set(raw["grid"]["ood"]) and (table["status"] == "ok").all()
    ols = table[table.solver == "ols"].set_index("ood")["mse_vs_ols"]
    gd = table[table.solver == "gd"].set_index("ood")["mse_vs_ols"]
    assert (ols < 1e-20).all()  # OLS is least squares on whatever prompts it sees
    assert gd["x-scale:10"] > 100 * gd["none"] and gd["x-shift:5"] > 10 * gd["none"]  # GD is not invariant
    for bad in ["x-scale:0", "shift:5"]:
        with pytest.raises(ConfigError, match="grid.ood"):
            parse_config({**raw, "grid": {**raw["grid"], "ood": [bad]}})


@pytest.mark.parametrize("value", ["outliers:0.25", "student-t:3"])
def test_a_cells_ood_draws_are_seeded_apart_from_its_prompts(value):
    """A grid point's map draws from prompt_seed + 1: the stream the prompts (slopes first) came
    from is not reused, so the outliers' places and the noise are not a function of the slopes
    (a mutation review: seeding the map with the prompts' own seed passed every test)."""
    from icl_bench.bench.cells import cell_prompts, prompt_seed

    source = '{"intercept": {"dist": "normal", "loc": 0.0, "scale": 1.0}, "slope": {"dist": "normal", "loc": 0.0, ' \
             '"scale": 1.0}, "x": {"dist": "normal", "loc": 0.0, "scale": 1.0}}'
    got = cell_prompts(source, 12, 0.1, 100.0, 64, 5, "float64", "cpu", 1, value)
    pseed = prompt_seed(5, 12, 0.1)
    plain = sample_prompts(PromptSpec(N=12, noise=0.1, R=100.0), 64, seed=pseed, dtype="float64")
    assert torch.equal(got.y, apply_ood(plain, value, seed=pseed + 1).y)
    assert not torch.equal(got.y, apply_ood(plain, value, seed=pseed).y)


def test_student_t_keeps_the_query_noise():
    """The query's label noise was dropped under student-t (yq = yc): mse_vs_target too low by
    noise^2 (found by a mutation review). The query keeps the batch's own noise draw."""
    b = sample_prompts(PromptSpec(N=20, noise=0.1), 4096, seed=0, dtype="float64")
    o = apply_ood(b, "student-t:3", seed=1)
    assert torch.allclose(o.y_query - o.y_query_clean, b.y_query - b.y_query_clean, rtol=0, atol=1e-12)
    assert float((o.y_query - o.y_query_clean).std()) == pytest.approx(0.1, rel=0.05)


@pytest.mark.parametrize("value, k", [("outliers:0.01", 1), ("outliers:0.3", 2), ("outliers:1", 5)])
def test_outliers_round_the_count_and_replace_at_least_one(value, k):
    """k = max(1, round(F N)) labels per prompt (N = 5: 0.05 -> 1, 1.5 -> 2, 5 -> 5); F = 1 is
    accepted, as the accepted values say (mutation review: truncation, no floor of one, F < 1)."""
    b = sample_prompts(PromptSpec(N=5, noise=0.1), 64, seed=0, dtype="float64")
    assert parse_ood(value)[1] == float(value.split(":")[1])
    out = apply_ood(b, value, seed=1)
    assert bool(((out.y != b.y).sum(1) == k).all())
