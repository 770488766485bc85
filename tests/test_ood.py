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
