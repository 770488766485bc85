"""The d > 1 paths of the built-in solvers, and the skip of solvers that have none."""
from __future__ import annotations

import pytest
import torch

from icl_bench.solvers.gd_mv import gd_predict_mv
from icl_bench.solvers.ln_closed_form_mv import build_ln_construction_mv
from icl_bench.prompts.generator import PromptSpec, sample_prompts
from icl_bench.prompts.multivariate import make_batch_mv, sample_prompts_mv
from icl_bench.solvers.base import SkipCell
from icl_bench.solvers.multivariate import (check_regressors, gd_mv, ln_closed_form_mv, ols_mv, scipy_lstsq_mv,
                                  standardize_mv)


@pytest.fixture(scope="module")
def batch():
    return sample_prompts_mv(PromptSpec(N=30, noise=0.1, R=1e3), 200, d=3, seed=4, dtype="float64")


def test_least_squares_paths_agree_with_the_reference(batch):
    assert torch.allclose(ols_mv(batch), batch.ols_prediction, rtol=1e-12, atol=1e-12)
    assert torch.allclose(scipy_lstsq_mv(batch), batch.ols_prediction, rtol=1e-10, atol=1e-10)
    b32 = sample_prompts_mv(PromptSpec(N=30, noise=0.1), 200, d=3, seed=4, dtype="float32")
    p32 = ols_mv(b32)
    assert p32.dtype == torch.float32 and ((p32.double() - b32.ols_prediction) ** 2).mean() < 1e-10


def test_gd_and_ln_paths(batch):
    assert torch.equal(gd_mv(batch, 7, 0.3, "masked"), gd_predict_mv(batch.x, batch.y, batch.x_query, 7, 0.3))
    model = build_ln_construction_mv(1e3, 3)
    plain = ln_closed_form_mv(batch, model, standardize=False)
    std = ln_closed_form_mv(batch, model, standardize=True)
    assert ((plain - batch.ols_prediction) ** 2).mean() < 1e-8
    assert ((std - batch.ols_prediction) ** 2).mean() < 1e-9


def test_standardize_handles_data_far_from_the_unit_scale():
    b = sample_prompts_mv(PromptSpec(N=30, noise=0.1, R=100.0), 200, d=2, seed=1, dtype="float64")
    far = make_batch_mv(300.0 + 50.0 * b.x, b.y * 40.0, 300.0 + 50.0 * b.x_query, R=100.0)
    model = build_ln_construction_mv(100.0, 2)
    rel = lambda p: float(((p - far.ols_prediction) ** 2).mean() / far.ols_prediction.var())  # noqa: E731
    assert rel(ln_closed_form_mv(far, model, standardize=True)) < 1e-6
    assert rel(ln_closed_form_mv(far, model, standardize=False)) > 1e-3  # the raw tokens break R >> data
    xs, ys, us, yb, sy = standardize_mv(far.x, far.y, far.x_query)
    assert torch.allclose(xs.mean(1), torch.zeros(200, 2, dtype=torch.float64), atol=1e-12)


def test_ill_posed_prompts_are_nan_in_every_path():
    x = torch.randn(3, 10, 2, dtype=torch.float64)
    x[1, :, 1] = 2 * x[1, :, 0]
    b = make_batch_mv(x, torch.randn(3, 10, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64), R=100.0)
    model = build_ln_construction_mv(100.0, 2)
    for pred in (ols_mv(b), scipy_lstsq_mv(b), gd_mv(b, 4, 0.3, "masked"), ln_closed_form_mv(b, model, False)):
        assert torch.isnan(pred[1]) and torch.isfinite(pred[[0, 2]]).all()


def test_float32_ols_is_nan_where_its_own_dtype_cannot_resolve_the_design():
    """Proportions (x2 = 1 - x1 in float64, cast to float32): the float64 reference answers them,
    float32 arithmetic cannot (a review first asked that ols follow the reference alone; its answers
    then had no correct digit, MSE 5e5). float32 ols is NaN exactly where the rule with float32's
    eps fires, and the reference's own NaN (float64 prompts, truly collinear) stays everyone's."""
    from icl_bench.prompts.ols_mv import ols_fit_mv

    g = torch.Generator().manual_seed(0)
    p, q = torch.rand(200, 30, generator=g, dtype=torch.float64), torch.rand(200, generator=g, dtype=torch.float64)
    args = (torch.stack([p, 1 - p], -1), torch.randn(200, 30, generator=g, dtype=torch.float64), torch.stack([q, 1 - q], -1))
    b64, b32 = (make_batch_mv(*args, R=100.0, dtype=dt) for dt in ("float64", "float32"))
    assert torch.isnan(b64.ols_prediction).all() and torch.isnan(ols_mv(b64)).all()
    own = ols_fit_mv(b32.x, b32.y, torch.float32)["ill_posed"]
    assert torch.isfinite(b32.ols_prediction).all() and bool(own.all())
    assert torch.equal(torch.isnan(ols_mv(b32)), own) and torch.isfinite(scipy_lstsq_mv(b32)).all()


def test_solver_without_a_multivariate_path_is_skipped_with_the_reason(batch):
    class OneD:
        name = "my-plugin"

    class Multi:
        name = "mine"
        multivariate = True

    with pytest.raises(SkipCell, match=r"my-plugin handles one regressor only \(d = 1\); this cell has d = 3"):
        check_regressors(OneD(), batch)
    check_regressors(Multi(), batch)  # no skip
    check_regressors(OneD(), sample_prompts(PromptSpec(N=5), 4, seed=0))  # d = 1: every solver runs
