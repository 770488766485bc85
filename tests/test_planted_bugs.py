"""Tests that fail for small deliberate bugs the rest of the suite once let through.

Each test names the bug it is built to catch; each was checked by planting that bug.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from icl_bench import PromptSpec, sample_prompts
from icl_bench.bench import timing
from icl_bench.prompts.data import DataSource, sample_data_prompts
from icl_bench.training.config import TrainConfig
from icl_bench.training.train import init_model, penalised, train


@pytest.mark.parametrize("sigma", [0.1, 0.5])
def test_query_label_carries_the_noise(sigma):
    """Bug: y_query = y_query_clean (the query's label loses its noise)."""
    batch = sample_prompts(PromptSpec(N=5, noise=sigma), 20000, seed=1, dtype="float64")
    resid = batch.y_query - batch.y_query_clean  # (B,)
    assert float(resid.std()) == pytest.approx(sigma, rel=0.03)
    assert abs(float(resid.mean())) < 4 * sigma / 20000**0.5
    ctx = batch.y - (batch.intercept[:, None] + batch.slope[:, None] * batch.x)  # context noise, same sigma
    assert float(ctx.std()) == pytest.approx(sigma, rel=0.03)
    assert abs(float(torch.corrcoef(torch.stack([resid, ctx[:, 0]]))[0, 1])) < 0.03  # fresh draws


def test_every_clock_read_follows_a_cuda_synchronize(monkeypatch):
    """Bug: timing never synchronises CUDA (queued kernels escape the timer). Runs without a GPU:
    torch.cuda.synchronize and the clock are replaced by recorders."""
    events = []
    t = [0.0]

    def clock():
        t[0] += 0.01
        events.append("clock")
        return t[0]

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    monkeypatch.setattr(timing, "_clock", clock)
    timing.time_passes(lambda: events.append("pass"), "cuda", repeats=3, max_seconds=10.0, min_sample_s=0.0)
    assert events.count("pass") >= 3 and events.count("sync") >= 3
    pending = False  # a pass ran since the last synchronize
    for e in events:
        if e == "pass":
            pending = True
        elif e == "sync":
            pending = False
        else:
            assert not pending, f"clock read with unsynchronised work queued: {events}"


def test_csv_query_row_is_never_a_context_row(tmp_path):
    """Bug: the query row is drawn among the prompt's context rows (the answer leaks)."""
    n = 40
    path = tmp_path / "ids.csv"
    path.write_text("x,y\n" + "".join(f"{i},{1000 + i}\n" for i in range(n)))  # x = row id, y = 1000 + id
    batch = sample_data_prompts(DataSource(path=str(path), x="x", y="y"), 12, 10.0, 500, seed=3, dtype="float64")
    x, u = batch.x.numpy(), batch.x_query.numpy()
    for ctx, q in zip(x, u):
        assert q not in set(ctx) and len(set(ctx)) == len(ctx)  # query apart, context rows distinct
    assert np.array_equal(batch.y_query.numpy(), 1000 + u) and np.array_equal(batch.y.numpy(), 1000 + x)
    assert len(set(u.tolist())) == n  # every row serves as a query somewhere (not a fixed row)


def test_l1_penalises_exactly_the_weight_matrices():
    """Bug: the l1 penalty also hits the LayerNorm gains and biases (or misses a matrix)."""
    model = init_model(TrainConfig(precondition_R=0.0))
    want = {id(p) for name, p in model.named_parameters() if ".ln." not in name}
    lns = {id(p) for name, p in model.named_parameters() if ".ln." in name}
    got = [id(p) for p in penalised(model)]
    assert lns and len(got) == len(set(got))  # the model has LN parameters; nothing counted twice
    assert set(got) == want


@pytest.mark.parametrize("target", ["ols", "noisy"])
def test_first_step_loss_is_against_the_intended_target(target):
    """Bug: training regresses on the noisy y_query when the config says OLS (or the reverse), or
    the penalty is summed over the wrong tensors. The first step's loss is recomputed by hand."""
    cfg = TrainConfig(seed=5, N=[8, 12], R=10.0, steps=1, batch_size=64, eval_every=1, eval_prompts=64,
                      l1=1e-3, target=target, progress=False, dtype="float64")
    _, history = train(cfg)
    model = init_model(cfg)  # the weights the first step saw
    N = random.Random(cfg.seed).choice(cfg.N)
    batch = sample_prompts(PromptSpec(N=N, noise=cfg.noise, R=cfg.R), cfg.batch_size,
                           seed=cfg.seed * 1_000_000 + 1, dtype="float64")
    y = batch.ols_prediction if target == "ols" else batch.y_query
    with torch.no_grad():
        mse = float(((model(batch.tokens) - y) ** 2).mean())
        weights = [p for name, p in model.named_parameters() if ".ln." not in name]
        penalty = cfg.l1 * float(sum(p.abs().sum() for p in weights))
    assert history[1]["step"] == 1
    assert history[1]["train_mse"] == pytest.approx(mse, rel=1e-10)
    assert history[1]["loss"] == pytest.approx(mse + penalty, rel=1e-10)
    other = batch.y_query if target == "ols" else batch.ols_prediction
    with torch.no_grad():
        assert float(((model(batch.tokens) - other) ** 2).mean()) != pytest.approx(mse, rel=1e-3)
