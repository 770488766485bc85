"""The d >= 2 fingerprint fires on known closed forms and on known GD, and stays quiet on a non-solver."""
from __future__ import annotations

import pytest
import torch

from icl_bench.analysis.fingerprint_mv import MAPS, fingerprint_mv
from icl_bench.solvers.gd_mv import build_gd_lsa_mv, gd_predict_mv
from icl_bench.solvers.ln_closed_form_mv import ln_closed_form_mv_predict
from icl_bench.prompts.ols_mv import ols_predict_mv
from icl_bench.prompts.generator import PromptSpec, sample_prompts
from icl_bench.prompts.multivariate import sample_prompts_mv


@pytest.fixture(scope="module")
def batch():
    return sample_prompts_mv(PromptSpec(N=30, noise=0.1, R=1e3), 200, d=3, seed=0, dtype="float64")


def test_maps_leave_ols_unchanged(batch):
    for m in MAPS:
        assert torch.allclose(m.apply(batch).ols_prediction, batch.ols_prediction, rtol=1e-9, atol=1e-9), m.name


def test_closed_forms_are_closed_form_like(batch):
    assert fingerprint_mv(lambda b: ols_predict_mv(b.x, b.y, b.x_query), batch)["verdict"] == "closed-form-like"
    ln = fingerprint_mv(lambda b: ln_closed_form_mv_predict(b.x, b.y, b.x_query, b.R), batch)
    assert ln["verdict"] == "closed-form-like" and max(ln["scores"].values()) < 1e-6


@pytest.mark.parametrize("K", [1, 4, 16])
def test_gd_and_gd_lsa_are_gd_like_at_their_K(batch, K):
    gd = fingerprint_mv(lambda b: gd_predict_mv(b.x, b.y, b.x_query, K, 0.4), batch)
    lsa = fingerprint_mv(lambda b: build_gd_lsa_mv(K, 0.4, b.R, 3)(b.tokens), batch)
    assert gd["verdict"] == lsa["verdict"] == "GD-like" and gd["gd_steps"] == lsa["gd_steps"] == K
    assert gd["scores"]["x1*10"] > 100 * gd["scores"]["identity"]  # anisotropic scaling breaks GD


def test_a_non_solver_is_neither_and_d1_is_refused(batch):
    assert fingerprint_mv(lambda b: b.y.mean(dim=1), batch)["verdict"] == "neither"
    with pytest.raises(ValueError, match="^d:"):
        fingerprint_mv(lambda b: b.y.mean(dim=1), sample_prompts(PromptSpec(N=10), 8, seed=0, dtype="float64"))
