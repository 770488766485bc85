"""Training: a tiny run learns (loss falls >= 10x), is reproducible, and configs are validated."""
import math
import os
import warnings

import pytest
import torch

from icl_bench.errors import ConfigError
from icl_bench.cli import main as cli_main
from icl_bench.training.config import TrainConfig, load_runs
from icl_bench.training.train import init_model, lr_factor, precondition, train, unprecondition


def main(argv):
    return cli_main(["train", *argv])

TINY = dict(R=10.0, N=[12], steps=300, batch_size=128, eval_every=100, eval_prompts=512, lr=1e-2, progress=False)


def test_tiny_run_loss_falls_tenfold():
    _, history = train(TrainConfig(**TINY, l1=1e-5))  # speed is benchmarks/' business, not a test's
    first, last = history[0]["eval_mse_vs_ols"], history[-1]["eval_mse_vs_ols"]
    assert math.isfinite(last) and last <= first / 10, (first, last)
    assert history[-1]["step"] == TINY["steps"] and 0 <= history[-1]["sparsity"] <= 1


def test_reproducible_and_seed_matters():
    cfg = dict(TINY, steps=20, eval_every=10)
    a, _ = train(TrainConfig(**cfg))
    b, _ = train(TrainConfig(**cfg))
    c, _ = train(TrainConfig(**cfg, seed=1))
    for (k, va), vb, vc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(va, vb), k
    assert not all(torch.equal(va, vc) for va, vc in zip(a.state_dict().values(), c.state_dict().values()))


def test_the_init_ignores_the_default_dtype_and_leaves_the_callers_random_stream():
    """init_model built its modules in the process's default dtype: under float64 nn.Linear's init
    drew other values and shifted every later draw, so one config and seed gave another model; and
    it re-seeded the caller's global generator (both found by a review)."""
    cfg = TrainConfig(**TINY)
    a = init_model(cfg).state_dict()
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        b = init_model(cfg).state_dict()
    finally:
        torch.set_default_dtype(before)
    assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    torch.manual_seed(12345)
    expected = torch.rand(3)
    torch.manual_seed(12345)
    init_model(cfg)
    assert torch.equal(torch.rand(3), expected)


def test_training_leaves_the_thread_count_as_it_found_it():
    """train() set torch's thread count to cfg.threads for the rest of the process (found again by
    a review); it is restored, after a training that raises too."""
    before = torch.get_num_threads()
    other = 2 if before != 2 else 3
    torch.set_num_threads(other)
    try:
        train(TrainConfig(**dict(TINY, steps=2, eval_every=1, eval_prompts=16, batch_size=8, threads=1)))
        assert torch.get_num_threads() == other
        with pytest.raises(AttributeError):
            train(TrainConfig(**dict(TINY, steps=2, threads=1)), model="not a model")
        assert torch.get_num_threads() == other
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("before", [False, True])
def test_training_leaves_the_process_flushing_subnormals_as_it_found_it(before):
    """train() turned on torch.set_flush_denormal for the whole process and left it on: every later
    computation (a benchmark, float32 OLS of subnormal x, which then read NaN) flushed subnormals
    to 0 (found by a review). It is restored, after a training that raises too."""
    from icl_bench.training.train import _flushing

    torch.set_flush_denormal(before)
    try:
        train(TrainConfig(**dict(TINY, steps=2, eval_every=1, eval_prompts=16, batch_size=8)))
        assert _flushing() is before
        with pytest.raises(AttributeError):  # (a model that is not one fails inside the training)
            train(TrainConfig(**dict(TINY, steps=2)), model="not a model")
        assert _flushing() is before
    finally:
        torch.set_flush_denormal(False)


def test_preconditioning_keeps_the_function():
    cfg = TrainConfig(**dict(TINY, R=1000.0, precondition_R=1.0))
    model = init_model(cfg)
    tokens = torch.randn(4, 13, 3)
    tokens[..., 2] = 1000.0
    before = model(tokens)
    precondition(model, cfg)
    torch.testing.assert_close(model(tokens), before)
    unprecondition(model)
    torch.testing.assert_close(model(tokens), before)
    assert set(model.state_dict()) == set(init_model(cfg).state_dict())  # a plain Transformer again


def test_schedule_warmup_then_decay():
    cfg = TrainConfig(**dict(TINY, steps=100, warmup_frac=0.1))
    f = [lr_factor(cfg, s) for s in range(100)]
    assert f[0] < f[5] < f[9] == 1.0 and f[50] < 1.0 and f[99] < 0.01
    # the cosine starts where the warm-up ends: 1 at step 10, half way (0.5 (1 - 1e-3) + 1e-3) at step 55
    assert f[10] == pytest.approx(1.0) and f[55] == pytest.approx(0.5005)


def test_flatten_readout_and_noisy_target_train():
    model, history = train(TrainConfig(**dict(TINY, steps=30, eval_every=10, readout="flatten", target="noisy", dtype="float64")))
    assert model.cfg.readout == "flatten" and model.cfg.N == 12 and model.readout.weight.dtype == torch.float64
    assert math.isfinite(history[-1]["eval_mse_vs_ols"])


@pytest.mark.parametrize("bad", [
    {"N": []}, {"N": [1]}, {"R": 0.0}, {"R": float("nan")}, {"target": "truth"}, {"readout": "mean"},
    {"schedule": "step"}, {"dtype": "float16"}, {"readout": "flatten", "N": [10, 20]}, {"steps": 0},
    {"lr": 0.0}, {"l1": -1.0}, {"warmup_frac": 1.0}, {"keys": "causal"}, {"noise": "0.1"}, {"layernorm": 1},
    {"lr": True},
])
def test_bad_config_one_line_error(bad):
    with pytest.raises(ConfigError) as exc:
        TrainConfig.from_dict(bad)
    field = next(iter(bad)) if not ("readout" in bad and "N" in bad) else "N"
    assert str(exc.value).startswith(f"train.{field}:") and "\n" not in str(exc.value)


def test_toml_runs_and_unknown_keys(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text('[defaults]\nR = 10.0\nsteps = 5\n[runs.a]\nl1 = 1e-4\n[runs.b]\nR = 100.0\n')
    runs = load_runs(str(path))
    assert [r["name"] for r in runs] == ["a", "b"] and runs[1]["R"] == 100.0 and runs[0]["l1"] == 1e-4
    assert TrainConfig.from_toml(str(path), "b").R == 100.0
    with pytest.raises(ConfigError, match="unknown run"):
        load_runs(str(path), ["c"])
    with pytest.raises(ConfigError, match=r"train\.stepz: unknown key"):
        TrainConfig.from_dict({"stepz": 3})
    with pytest.raises(ConfigError, match="no such file"):
        load_runs(str(tmp_path / "missing.toml"))
    path.write_text('[defaults]\nsteps = 5\n')  # read as one run whose key 'defaults' is unknown
    with pytest.raises(ConfigError, match=r"^runs: missing; \[defaults\] needs at least one \[runs.NAME\] table"):
        load_runs(str(path))


def test_cli_trains_and_saves(tmp_path, capsys):
    path = tmp_path / "t.toml"
    path.write_text('[defaults]\nsteps = 5\nbatch_size = 32\neval_every = 5\neval_prompts = 64\n'
                    '[runs.tiny]\nsolver = "trained-l1"\nR = 10.0\nl1 = 1e-4\n')
    assert main(["--config", str(path), "--out", str(tmp_path / "m"), "--no-progress"]) == 0
    assert (tmp_path / "m" / "tiny.safetensors").is_file() and "tiny: 5 steps" in capsys.readouterr().out
    assert main(["--config", str(tmp_path / "nope.toml")]) == 2


def test_a_diverged_run_writes_no_checkpoint(tmp_path, capsys):
    """lr = 1e30 saved an all-NaN checkpoint with exit 0 (found by an adversarial tester), which
    analyze and every run then read as a model; now exit 2, one line, nothing written, no warning."""
    path = tmp_path / "t.toml"
    path.write_text('[defaults]\nN = [10]\nsteps = 5\nbatch_size = 8\neval_every = 5\neval_prompts = 16\n'
                    '[runs.m1]\nsolver = "trained-l1"\nR = 100.0\nlr = 1e30\n')
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the held-out metrics of a model that answers only NaN warned
        assert main(["--config", str(path), "--out", str(tmp_path / "m"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("icl-bench: error: runs.m1.lr: training diverged by step 5") and "lower lr" in err, err
    assert "\n" not in err and not (tmp_path / "m").exists()  # (the folder it made is removed again: a review)


def test_a_run_diverged_by_its_l1_says_so_and_names_the_flat_configs_table(tmp_path, capsys):
    """A flat config (no [runs]) was named 'runs.big', a table it does not have, and l1 = 1e37 was
    advised 'lower lr' (found by a review)."""
    path = tmp_path / "t.toml"
    path.write_text('name = "big"\nl1 = 1e37\nsteps = 5\nbatch_size = 8\neval_prompts = 8\n')
    assert main(["--config", str(path), "--out", str(tmp_path / "m"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("icl-bench: error: train.lr: training diverged by step"), err
    assert err.endswith("l1 = 1e+37); no checkpoint written: lower lr or l1"), err
    path.write_text('[defaults]\nlr = 1e30\nsteps = 3\nbatch_size = 8\neval_prompts = 8\n[runs.foo]\n')
    deep = tmp_path / "a" / "b" / "c"
    assert main(["--config", str(path), "--out", str(deep), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()  # the lr is [defaults]', not [runs.foo]'s; no folder left of a/b/c
    assert err.startswith("icl-bench: error: defaults.lr (run foo): training diverged"), err
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("defaults, run, expected", [
    ("lrr = 0.1", "", "defaults.lrr (run a): unknown key; accepted: name, solver,"),
    ("noise = -0.1", "", "defaults.noise (run a): must be finite and >= 0 (got -0.1)"),
    ("noise = 0.1", "noise = -0.1", "runs.a.noise: must be finite and >= 0 (got -0.1)"),  # the run's own key
    ("", 'solver = "trained-foo"', "runs.a.solver: unknown value 'trained-foo'; accepted: '', trained-l1, "),
])
def test_a_bad_value_is_named_where_it_was_set(tmp_path, capsys, defaults, run, expected):
    """A bad key in [defaults] was reported as `runs.a.<key>`, a key [runs.a] does not have, and the
    solver's accepted values began with an empty item (", trained-l1"; a review)."""
    path = tmp_path / "t.toml"
    path.write_text(f"[defaults]\nsteps = 3\n{defaults}\n[runs.a]\n{run}\n")
    assert main(["--config", str(path), "--out", str(tmp_path / "m"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"icl-bench: error: {expected}") and err.count("\n") == 1, err
    assert not (tmp_path / "m").exists()


def test_a_run_selected_twice_trains_once(tmp_path, capsys):
    """`--run a --run a` trained a twice, the second overwriting the first's checkpoint."""
    path = tmp_path / "t.toml"
    path.write_text('[defaults]\nsteps = 2\nbatch_size = 16\neval_every = 1\neval_prompts = 16\n[runs.a]\n[runs.b]\n')
    assert main(["--config", str(path), "--out", str(tmp_path / "m"), "--run", "a", "--run", "a", "--no-progress"]) == 0
    assert capsys.readouterr().out.count("a: 2 steps") == 1
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["a.json", "a.safetensors"]


def test_an_interrupted_train_says_which_runs_are_saved_and_how_to_train_the_rest(tmp_path, capsys, monkeypatch):
    """Ctrl-C during run b of a, b, c printed only "interrupted", and the rerun was refused because
    a's checkpoint was there (found by an adversarial review)."""
    import shlex

    from icl_bench.training import train as train_mod

    path = tmp_path / "t.toml"
    path.write_text('[defaults]\nsteps = 2\nbatch_size = 16\neval_every = 1\neval_prompts = 16\n[runs.a]\n[runs.b]\n[runs.c]\n')
    real = train_mod.train_and_save

    def stop_at_b(cfg, out, **kw):
        if cfg.name == "b":
            raise KeyboardInterrupt
        return real(cfg, out, **kw)

    monkeypatch.setattr(train_mod, "train_and_save", stop_at_b)
    argv = ["train", "--config", str(path), "--out", str(tmp_path / "m"), "--run", "a", "--ru=b", "--ru", "c",
            "--no-progress"]  # (--ru: argparse's abbreviation of --run, which the printed command kept; found by a review)
    assert cli_main(argv) == 130
    err = capsys.readouterr().err
    rest = f"icl-bench train --config {shlex.quote(str(path))} --out {shlex.quote(str(tmp_path / 'm'))} --no-progress --run b --run c"
    assert f"icl-bench: saved in {tmp_path / 'm'}: a; train the rest with:\n  {rest}\n" in err, err
    assert "icl-bench: b is not saved: interrupted while training or evaluating it\n" in err, err
    monkeypatch.setattr(train_mod, "train_and_save", real)
    assert cli_main(shlex.split(rest)[1:]) == 0  # the printed command trains the rest beside a
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [f"{n}.{e}" for n in "abc" for e in ("json", "safetensors")]


@pytest.mark.parametrize("solver, layernorm", [("trained-lsa", False), ("trained-nol1", True), ("trained-l1", True),
                                               ("trained-l1-noaug", True), ("", True)])
def test_layernorm_left_out_follows_the_solver(solver, layernorm):
    """`solver = "trained-lsa"` without a layernorm key trained a model with LayerNorm, which the
    trained-lsa solver then ran under its name (found by a new-user tryout)."""
    cfg = TrainConfig.from_dict({"solver": solver, "R": 100.0})
    assert cfg.layernorm is layernorm and cfg.transformer_config().layernorm is layernorm
    assert TrainConfig.from_dict({"solver": solver, "layernorm": layernorm}).layernorm is layernorm


@pytest.mark.parametrize("force", [False, True])
def test_a_pair_saved_by_another_train_meanwhile_is_kept_without_force(tmp_path, capsys, monkeypatch, force):
    """Two `train`s of one name into one folder both passed the "already holds" check before
    training, and the one that finished last overwrote the other's checkpoint silently (found by a
    review). Without --force the pair saved meanwhile is now kept and this run is saved beside it
    (exit 2, one line naming both); with --force the newer run replaces it, as --force says."""
    from icl_bench.solvers.checkpoint import load_checkpoint, save_checkpoint
    from icl_bench.training import train as train_mod

    path = tmp_path / "t.toml"
    path.write_text('[defaults]\nsteps = 2\nbatch_size = 16\neval_every = 1\neval_prompts = 16\n[runs.a]\n')
    real = train_mod.train

    def other_process_saves_first(cfg):
        out = real(cfg)
        save_checkpoint(out[0], tmp_path / "m" / "a", {"by": "the other train"})
        return out

    monkeypatch.setattr(train_mod, "train", other_process_saves_first)
    if not force:  # a leftover of an earlier process of this PID is kept too (the run was lost; a review)
        save_checkpoint(real(TrainConfig(**dict(TINY, steps=1)))[0], tmp_path / "m" / f"a-pid{os.getpid()}", {"by": "old"})
    rc = main(["--config", str(path), "--out", str(tmp_path / "m"), "--no-progress", *(["--force"] if force else [])])
    kept = load_checkpoint(tmp_path / "m" / "a")[1]
    if force:
        assert rc == 0 and "by" not in kept and sorted(p.name for p in (tmp_path / "m").iterdir()) == ["a.json", "a.safetensors"]
        return
    assert load_checkpoint(tmp_path / "m" / f"a-pid{os.getpid()}")[1]["by"] == "old"
    alt = tmp_path / "m" / f"a-pid{os.getpid()}-1"
    err = capsys.readouterr().err
    assert rc == 2 and kept["by"] == "the other train" and err.count("\n") == 1, err
    assert f"--out: {tmp_path / 'm' / 'a.safetensors'} was saved by another process" in err and f"{alt}.safetensors" in err
    assert load_checkpoint(alt)[1]["train_config"]["name"] == "a"


def test_the_cli_prints_the_suites_own_warning_as_one_line(tmp_path, capsys):
    """`train --steps 1` of a recipe whose proximal l1 then never acts printed Python's two-line
    UserWarning with this machine's source path (found by a review): now one line."""
    import warnings

    path = tmp_path / "t.toml"
    path.write_text('[defaults]\nsteps = 10\nbatch_size = 16\neval_every = 1\neval_prompts = 16\n'
                    '[runs.p]\nl1_prox = 0.2\nl1_start = 0.5\nl1_stop = 0.8\n')
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        assert main(["--config", str(path), "--out", str(tmp_path / "m"), "--no-progress", "--steps", "1"]) == 0
    out, err = capsys.readouterr()
    assert err == "icl-bench: WARNING: p: proximal l1 never acts: (l1_start, l1_stop] x steps = (0.5, 0.8] holds no step\n"
    assert "p: 1 step, held-out" in out


def test_the_init_is_the_seeds_keeps_layernorm_at_gain_1_bias_0_and_scales_the_R_column_by_1_over_R():
    """init_model's docstring: N(0, init_scale^2) weight matrices drawn from cfg.seed, LayerNorm gain 1 /
    bias 0, and the embedding's R column (index 2) divided by R. Only the trained weights were
    compared, which differ by seed through the prompts alone (a mutation review: a fixed init seed,
    a randomised LayerNorm or another column divided by R passed)."""
    cfg = TrainConfig(**TINY)
    a, b, other = init_model(cfg), init_model(cfg), init_model(TrainConfig(**dict(TINY, seed=1)))
    mats = [name for name, _ in a.named_parameters() if ".ln." not in name]
    for name, p in a.named_parameters():
        assert torch.equal(p, b.get_parameter(name)), name
        if ".ln." in name:
            assert torch.equal(p, torch.full_like(p, 1.0 if name.endswith(".weight") else 0.0)), name
        else:
            assert not torch.equal(p, other.get_parameter(name)), name
    assert len(mats) == 10
    flat = init_model(TrainConfig(**dict(TINY, embed_r_over_R=False)))
    assert torch.equal(a.embed.weight[:, :2], flat.embed.weight[:, :2])
    torch.testing.assert_close(a.embed.weight[:, 2], flat.embed.weight[:, 2] / TINY["R"], rtol=1e-6, atol=0)
    wide = init_model(TrainConfig(**dict(TINY, init_scale=0.6)))  # the same draws at twice the std
    for name in mats:
        torch.testing.assert_close(wide.get_parameter(name), 2 * a.get_parameter(name), rtol=1e-6, atol=0)


def test_preconditioning_stores_the_R_column_in_units_where_R_is_precondition_R():
    """Adam sees W' = W * R / precondition_R in the R column (W = W' * precondition_R / R), so its
    steps there shrink by precondition_R / R; the function alone (test_preconditioning_keeps_the_function)
    holds for any scale, the inverted one included (a mutation review)."""
    cfg = TrainConfig(**dict(TINY, R=1000.0, precondition_R=10.0))
    model = init_model(cfg)
    real = model.embed.weight.detach().clone()
    precondition(model, cfg)
    stored = model.embed.parametrizations.weight.original.detach()
    assert torch.equal(stored[:, :2], real[:, :2])
    torch.testing.assert_close(stored[:, 2], real[:, 2] * 100.0, rtol=1e-6, atol=0)
    torch.testing.assert_close(model.embed.weight, real, rtol=1e-6, atol=0)


def test_cosine_has_no_warm_up_and_constant_is_flat():
    """Only onecycle was tested (a mutation review: a warm-up in cosine, or the constant schedule's
    factor given to cosine, passed)."""
    f = {s: [lr_factor(TrainConfig(**dict(TINY, steps=100, warmup_frac=0.1, schedule=s)), t) for t in range(100)]
         for s in ("cosine", "constant")}
    assert f["constant"] == [1.0] * 100
    assert f["cosine"][0] == 1.0 and f["cosine"][50] == pytest.approx(0.5005) and f["cosine"][99] < 0.01


def test_the_history_evaluates_at_0_every_eval_every_steps_and_the_last_at_the_scheduled_lr():
    """train's docstring: a row at step 0, every eval_every steps and the end, each with the lr the
    optimiser then holds (cfg.lr times the schedule's factor); nothing checked the rows' steps or lr
    (a mutation review)."""
    cfg = TrainConfig(**dict(TINY, steps=25, eval_every=10, eval_prompts=16, batch_size=8, lr=0.02))
    _, history = train(cfg)
    assert [row["step"] for row in history] == [0, 10, 20, 25]
    assert [row["lr"] for row in history] == pytest.approx([0.02 * lr_factor(cfg, row["step"]) for row in history], rel=1e-12)


def test_training_draws_step_t_from_seed_times_10_6_plus_t_and_holds_out_other_prompts(monkeypatch):
    """The seeds train's docstring and config.py's MAX_STEPS note promise: step t trains on
    seed * 10^6 + t (two training seeds never share a step's prompts) and the held-out prompts use
    seed + EVAL_SEED_OFFSET, never a training step's seed (a mutation review: held-out prompts drawn
    with step 1's seed passed)."""
    from icl_bench.training import train as train_mod

    seen, real = [], train_mod.sample_prompts
    monkeypatch.setattr(train_mod, "sample_prompts",
                        lambda spec, n, *, seed, **kw: seen.append((spec.N, n, seed)) or real(spec, n, seed=seed, **kw))
    train(TrainConfig(**dict(TINY, seed=3, steps=4, eval_every=2, eval_prompts=16, batch_size=8)))
    assert seen == [(12, 16, 3 + train_mod.EVAL_SEED_OFFSET)] + [(12, 8, 3_000_000 + t) for t in range(1, 5)]


def test_evaluate_averages_the_metrics_of_every_training_N():
    """The held-out metrics are the mean over the training N (a mutation review: the last N's alone passed)."""
    from icl_bench import PromptSpec, sample_prompts
    from icl_bench.training.train import evaluate

    model = init_model(TrainConfig(**dict(TINY, N=[8, 12])))
    batches = [sample_prompts(PromptSpec(N=n, noise=0.1, R=10.0), 64, seed=n) for n in (8, 12)]
    each = [evaluate(model, [b]) for b in batches]
    both = evaluate(model, batches)
    assert set(both) == {"eval_mse_vs_ols", "eval_rel_mse"} and each[0] != each[1]
    for k in both:
        assert both[k] == pytest.approx((each[0][k] + each[1][k]) / 2, rel=1e-12)


def test_gradients_are_clipped_at_clip_and_not_at_all_with_0(monkeypatch):
    """Nothing checked the clip value reaches clip_grad_norm_ (a mutation review: a fixed 1.0 passed)."""
    seen, real = [], torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_",
                        lambda p, max_norm, *a, **k: seen.append(max_norm) or real(p, max_norm, *a, **k))
    small = dict(TINY, steps=3, eval_every=3, eval_prompts=16, batch_size=8)
    train(TrainConfig(**small, clip=0.25))
    assert seen == [0.25] * 3
    train(TrainConfig(**small, clip=0.0))
    assert seen == [0.25] * 3


def test_training_stops_at_the_first_non_finite_loss_and_at_stop_rel_mse():
    """A diverged run stops at the evaluation that reads a non-finite loss; stop_rel_mse stops at the
    first evaluation at or below it, and not before (a mutation review: neither stop was tested)."""
    _, history = train(TrainConfig(**dict(TINY, R=100.0, N=[10], lr=1e30, steps=20, eval_every=1, eval_prompts=16, batch_size=8)))
    assert history[-1]["step"] < 20 and not math.isfinite(history[-1]["loss"])
    assert all(math.isfinite(row["loss"]) for row in history[1:-1])
    small = dict(TINY, steps=30, eval_every=10, eval_prompts=16, batch_size=8)
    assert [row["step"] for row in train(TrainConfig(**small, stop_rel_mse=1e9))[1]] == [0, 10]
    assert [row["step"] for row in train(TrainConfig(**small, stop_rel_mse=1e-12))[1]] == [0, 10, 20, 30]


def test_the_checkpoint_records_the_runs_seed(tmp_path):
    """The sweep's table reads each run's seed from its checkpoint's JSON (sweep.row_for); the sweep
    tests train seed 0 only (a mutation review: a JSON recording seed 0 for every run passed)."""
    from icl_bench.solvers.checkpoint import read_meta
    from icl_bench.training.train import train_and_save

    cfg = TrainConfig(**dict(TINY, name="s2", seed=2, steps=2, eval_every=1, eval_prompts=16, batch_size=8))
    meta = read_meta(train_and_save(cfg, tmp_path))
    assert meta["seed"] == 2 and meta["train_config"]["seed"] == 2 and meta["R"] == 10.0 and meta["N"] == [12]
    assert meta["metrics"]["step"] == 2 and [row["step"] for row in meta["history"]] == [0, 1, 2]


def test_limits_hold_the_longest_N_and_let_a_model_reach_them():
    """The prompt-value limits are of the longest training N, not the first; a folded-map count of
    exactly MAX_VALUES is accepted ("exceed"), one layer more is not (a mutation review)."""
    with pytest.raises(ConfigError, match=r"^train\.eval_prompts: eval_prompts \* \(N \+ 1\) = 200200000 prompt values"):
        TrainConfig.from_dict({"N": [2, 1000], "batch_size": 1, "eval_prompts": 200_000})
    edge = {"d_model": 16, "n_heads": 4, "batch_size": 1, "N": [2], "eval_prompts": 2}
    assert TrainConfig.from_dict({**edge, "n_layers": 128}).n_layers == 128  # 128 * 4^2 * 16^4 = 2^27
    with pytest.raises(ConfigError, match=r"^train\.d_model: n_layers \* n_heads\^2 \* d_model\^4 = 135266304 values"):
        TrainConfig.from_dict({**edge, "n_layers": 129})
