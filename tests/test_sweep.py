"""The l1 sweep driver: trains the grid, writes both tables, reuses checkpoints, rejects bad configs."""
import pandas as pd
import pytest

from icl_bench import PromptSpec, sample_prompts
from icl_bench.errors import ConfigError
from icl_bench.cli import main
from icl_bench.training.config import TrainConfig, read_sweep, run_name
from icl_bench.solvers.checkpoint import save_checkpoint
from icl_bench.solvers.transformer import Transformer
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
    # rel_mse is mse_vs_ols over the variance of the OLS answers of the sweep's evaluation prompts (a mutation
    # review: nothing checked the denominator); those prompts are the row's own: N = eval_N, R, seed 3e9
    sweep = read_sweep(str(cfg)).sweep
    ols = sample_prompts(PromptSpec(N=sweep.eval_N, noise=sweep.eval_noise, R=float(table.R.iloc[0])), 128,
                         seed=3_000_000_000, dtype=TrainConfig().dtype).ols_prediction  # (the training dtype)
    assert table.rel_mse.to_numpy() == pytest.approx(table.mse_vs_ols.to_numpy() / float(ols.var()), rel=1e-12)
    csv = pd.read_csv(tmp_path / "out" / "l1.v1.csv")
    assert len(csv) == 2 and {"mse_vs_ols", "sparsity", "weight_l1"} <= set(csv.columns)
    assert {"similarity", "probe.division.r2", "hoyer"} <= set(csv.columns) and csv.similarity.between(0, 1).all()
    # the mechanism test, not only probes any accurate model passes: the LayerNorm state per run, its share per lambda
    assert {"ln.state", "fp.verdict", "ln.ln1.r2_raw"} <= set(csv.columns) and set(csv.layer2_division) <= {0, 1}
    md = (tmp_path / "out" / "l1.v1.md").read_text()
    assert "Made by: `icl-bench sweep" in md and md.count("\n| 0") == 2 and "layer2_division |" in md
    models = sorted(p.name for p in (tmp_path / "out" / "l1.v1_models").glob("*.safetensors"))
    assert len(models) == 2
    again = run_sweep(str(cfg), reuse=True, progress=False)  # no retraining: identical weights -> same numbers
    pd.testing.assert_frame_equal(again, table)


def test_reuse_analyses_on_one_torch_thread(tmp_path, monkeypatch):
    # the analysis is many small torch ops: on torch's default threads `--reuse` (no training, which
    # used to leave one thread set for the process) ran 4-8x slower (found by a new-user tryout)
    import torch

    from icl_bench.training import sweep

    cfg = tmp_path / "s.toml"
    cfg.write_text(TINY.format(out=tmp_path / "out" / "l1.v1"))
    run_sweep(str(cfg), progress=False)
    seen, analyze = [], sweep.analyze
    monkeypatch.setattr(sweep, "analyze", lambda *a, **k: seen.append(torch.get_num_threads()) or analyze(*a, **k))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run_sweep(str(cfg), reuse=True, force=True, progress=False)
        assert torch.get_num_threads() == 2  # restored
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 1]


def test_summary_says_how_many_seeds_its_shares_are_of_and_counts_nan_predictions():
    """A seed whose analysis failed left layer2_division's mean over the others while `seeds`
    counted it, and predictions left out of mse_vs_ols were not counted (found by a review)."""
    from icl_bench.training.sweep import summarise

    table = pd.DataFrame({"l1": [0.0, 0.0, 1e-3], "seed": [0, 1, 0], "rel_mse": [1e-3, 2e-3, 1e-3],
                          "n_nonfinite": [0, 3, 0], "layer2_division": [1.0, None, 0.0],
                          "analysis_error": [None, "RuntimeError: boom", None]})
    got = summarise(table).set_index("l1")
    assert got.loc[0.0, "seeds"] == 2 and got.loc[0.0, "analysed"] == 1 and got.loc[0.0, "layer2_division"] == 1.0
    assert got.loc[0.0, "n_nonfinite"] == 3 and got.loc[1e-3, "n_nonfinite"] == 0
    clean = summarise(table.assign(n_nonfinite=0, analysis_error=None))
    assert "analysed" not in clean and "n_nonfinite" not in clean  # the published table keeps its columns


def test_a_huge_lambda_names_its_run_without_a_plus(tmp_path):
    """l1 = [1e308] was refused as 'train.name: bad name l1-1e+308-seed0', a field never written."""
    from icl_bench.training.sweep import sweep_runs

    assert run_name(1e308, 0) == "l1-1e308-seed0" and run_name(1e-05, 2) == "l1-1e-05-seed2"
    cfg = tmp_path / "s.toml"
    cfg.write_text(TINY.format(out=tmp_path / "l1").replace("l1 = [0.0, 1e-3]", "l1 = [0.0, 1e308]"))
    assert [r.name for r in sweep_runs(read_sweep(str(cfg)), False)] == ["l1-0-seed0", "l1-1e308-seed0"]


def test_reuse_says_what_it_trains_because_it_was_missing(tmp_path, capsys):
    """--reuse in a folder without the checkpoints trained all of them and said nothing; then it
    said so and trained the whole sweep, in a folder a new user had run it from by mistake (a
    tryout): with none of them there it is refused, and with some it trains the rest and says so."""
    cfg = tmp_path / "s.toml"
    cfg.write_text(TINY.format(out=tmp_path / "l1"))
    assert main(["sweep", "--config", str(cfg), "--reuse", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err == (f"icl-bench: error: --reuse: none of the 2 checkpoints of this sweep is in {tmp_path / 'l1_models'} "
                   "(sweep.out is relative to the current folder); run it from the folder the sweep was made in, or "
                   "drop --reuse to train them\n"), err
    assert not (tmp_path / "l1_models").exists() and not (tmp_path / "l1.md").exists()
    run_sweep(str(cfg), progress=False)
    for suffix in (".safetensors", ".json"):
        (tmp_path / "l1_models" / f"l1-0.001-seed0{suffix}").unlink()
    run_sweep(str(cfg), reuse=True, progress=False)
    assert f"--reuse: 1 of 2 checkpoints found in {tmp_path / 'l1_models'}; training the other 1" in capsys.readouterr().out
    run_sweep(str(cfg), reuse=True, progress=False)
    assert "--reuse:" not in capsys.readouterr().out  # every one found: nothing to say


def test_analysis_prompts_are_bounded_at_the_n_the_analysis_runs_at(tmp_path):
    """The analysis of each run is at N = 20 (a query readout; a flatten readout: train.N), not at
    eval_N: the bound refused 200000 prompts at eval_N = 1000 and let 3e7 through at eval_N = 2,
    whose analyses then all failed after the training (a review)."""
    cfg = tmp_path / "s.toml"
    cfg.write_text("[sweep]\nl1 = [0.0]\neval_N = 1000\neval_prompts = 2\nanalysis_prompts = 200000\n")
    assert read_sweep(str(cfg)).sweep.analysis_prompts == 200000  # 200000 * 21 values
    cfg.write_text("[sweep]\nl1 = [0.0]\neval_N = 2\neval_prompts = 2\nanalysis_prompts = 30000000\n")
    with pytest.raises(ConfigError, match=r"^sweep.analysis_prompts: analysis_prompts \* \(N \+ 1\) = 630000000 "
                       r"prompt values exceed 134217728 \(the analysis runs at N = 20\)"):
        read_sweep(str(cfg))
    cfg.write_text("[sweep]\nl1 = [0.0]\neval_N = 4000\neval_prompts = 2\nanalysis_prompts = 40000\n"
                   "[train]\nreadout = \"flatten\"\nN = [4000]\n")  # 40000 * 4001 values: over, at train.N
    with pytest.raises(ConfigError, match=r"^sweep.analysis_prompts: .* \(the analysis runs at N = 4000\)"):
        read_sweep(str(cfg))


@pytest.mark.parametrize("text, field", [
    ("[sweep]\nl1 = []\n", "sweep.l1"),
    ("[sweep]\nl1 = [-1.0]\n", "sweep.l1"),
    ("[sweep]\nl1 = [0.0]\nseeds = 3\n", "sweep.seeds"),
    ("[sweep]\nl1 = [0.0]\nlambdas = [1]\n", "sweep.lambdas"),
    ("[sweep]\nl1 = [0.0]\n[train]\nl1 = 0.1\n", "train.l1"),
    ("[sweep]\nl1 = [0.0]\n[train]\nseed = 1\n", "train.seed"),  # (name, seed and l1 are the sweep's; a mutation review)
    ("[sweep]\nl1 = [0.0]\nseeds = [9223372036854775807]\n", "sweep.seeds"),  # not train.seed, a key never written
    # eval_prompts * (eval_N + 1) = 8 * (2^24 + 1) prompt values: over 2^27 by the query row alone
    ("[sweep]\nl1 = [0.0]\neval_N = 16777216\neval_prompts = 8\nanalysis_prompts = 8\n", "sweep.eval_prompts"),
])
def test_bad_sweep_config(tmp_path, text, field):
    cfg = tmp_path / "s.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=f"^{field}:"):
        read_sweep(str(cfg))
    assert main(["sweep", "--config", str(cfg)]) == 2


def _saved(cfg, models, **recorded):
    """Checkpoints of every run of sweep config `cfg`, as an earlier sweep saved them, whose recorded
    train_config is the run's with `recorded` applied (None: the field is not recorded)."""
    c = read_sweep(cfg)
    for lam, seed in [(lam, seed) for lam in c.sweep.l1 for seed in c.sweep.seeds]:
        run = TrainConfig.from_dict({**c.train, "name": run_name(lam, seed), "seed": seed, "l1": lam, "progress": False})
        rec = {k: v for k, v in {**run.to_dict(), **recorded}.items() if v is not None}
        save_checkpoint(Transformer(run.transformer_config()), models / run.name,
                        {"R": run.R, "N": run.N, "seed": run.seed, "train_config": rec})


def test_reuse_refuses_checkpoints_trained_with_other_settings(tmp_path, capsys):
    cfg = tmp_path / "s.toml"
    cfg.write_text(TINY.format(out=tmp_path / "out" / "l1"))
    _saved(cfg, tmp_path / "out" / "l1_models", steps=5)  # [train] said steps = 5 back then
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert main(["sweep", "--config", str(cfg), "--reuse", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("icl-bench: error: --reuse: ") and err.count("\n") == 1, err
    assert "l1-0-seed0.json was trained with steps = 5, the config now gives 6" in err, err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # no table, no retraining


def test_reuse_ignores_runtime_fields_and_fields_recorded_since(tmp_path):
    from icl_bench.training.sweep import check_reusable, sweep_runs

    cfg = tmp_path / "s.toml"
    cfg.write_text(TINY.format(out=tmp_path / "l1"))
    _saved(cfg, tmp_path / "l1_models", progress=True, threads=4, aug_scale=None)  # aug_scale: newer than the file
    for run in sweep_runs(read_sweep(cfg), progress=False):
        check_reusable(run, tmp_path / "l1_models" / run.name)
    with pytest.raises(ConfigError, match=r"^--reuse: .*l1-0-seed0\.json was trained with lr = 0\.1, "):
        _saved(cfg, tmp_path / "l1_models", lr=0.1)
        check_reusable(sweep_runs(read_sweep(cfg))[0], tmp_path / "l1_models" / "l1-0-seed0")


def test_reuse_and_train_refuse_unusable_checkpoint_files_before_training(tmp_path, capsys):
    """A truncated saved checkpoint, or a folder where a new one is to be saved, used to stop the
    sweep (or train) only after other runs had been trained and written (found by an adversarial
    review); both are refused first, and nothing is written."""
    cfg = tmp_path / "s.toml"
    cfg.write_text(TINY.format(out=tmp_path / "out" / "l1"))
    models = tmp_path / "out" / "l1_models"
    _saved(cfg, models)
    (models / "l1-0-seed0.safetensors").unlink()  # retrained ...
    data = (models / "l1-0.001-seed0.safetensors").read_bytes()
    (models / "l1-0.001-seed0.safetensors").write_bytes(data[:200])  # ... but this one cannot be reused
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert main(["sweep", "--config", str(cfg), "--reuse", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("icl-bench: error: checkpoint: ") and "l1-0.001-seed0.safetensors is not a readable" in err, err
    assert err.rstrip().endswith("(--reuse --force retrains this run over it)"), err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    # --reuse --force retrains it, as its help says (it was refused with or without --force; a review)
    assert main(["sweep", "--config", str(cfg), "--reuse", "--force", "--no-progress"]) == 0
    assert "--reuse --force: retraining l1-0.001-seed0 (checkpoint: " in capsys.readouterr().out
    assert (models / "l1-0.001-seed0.safetensors").stat().st_size > 200 and (models / "l1-0-seed0.safetensors").is_file()
    (models / "l1-0-seed0.safetensors").unlink()
    (models / "l1-0.001-seed0.safetensors").unlink()
    (models / "l1-0.001-seed0.json").unlink()
    (models / "l1-0.001-seed0.json").mkdir()  # a folder where the new checkpoint's JSON goes
    assert main(["sweep", "--config", str(cfg), "--reuse", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err == f"icl-bench: error: sweep.out: {models / 'l1-0.001-seed0.json'} exists and is not a file, so the " \
                  "checkpoint cannot be saved there; remove it\n", err
    assert not (models / "l1-0-seed0.safetensors").exists()  # nothing trained
    (tmp_path / "t.toml").write_text('[runs.m]\nsteps = 2\nbatch_size = 16\neval_every = 1\neval_prompts = 16\n')
    (tmp_path / "t" / "m.safetensors").mkdir(parents=True)
    assert main(["train", "--config", str(tmp_path / "t.toml"), "--out", str(tmp_path / "t"), "--force"]) == 2
    assert capsys.readouterr().err == (f"icl-bench: error: --out: {tmp_path / 't' / 'm.safetensors'} exists and is not a "
                                       "file, so the checkpoint cannot be saved there; remove it\n")
    assert [p.name for p in (tmp_path / "t").iterdir()] == ["m.safetensors"]


SMALL = """
[sweep]
l1 = [0.0]
out = "{out}"
eval_prompts = 16
analysis_prompts = 8
[train]
steps = 2
batch_size = 16
eval_every = 1
eval_prompts = 16
progress = false
"""


def _files(root):
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_sweep_refuses_to_overwrite_tables_and_checkpoints_without_force(tmp_path, capsys, monkeypatch):
    """A sweep replaced a user's <out>.md / <out>.csv, and without --reuse retrained over an earlier
    sweep's checkpoints (found by a review); like train / run / publish it now refuses, before any
    training, unless --force. With --reuse the tables are rewritten only if a sweep wrote them."""
    import icl_bench.training.sweep as sweep_mod

    trained = []
    real = sweep_mod.train_and_save
    monkeypatch.setattr(sweep_mod, "train_and_save", lambda run, out, **k: trained.append(run.name) or real(run, out, **k))
    cfg = tmp_path / "s.toml"
    cfg.write_text(SMALL.format(out=tmp_path / "notes"))
    (tmp_path / "notes.md").write_text("MY NOTES\n")
    before = _files(tmp_path)
    for flags, what in (([], "already exists"), (["--reuse"], "exists and is not a table written by icl-bench sweep")):
        assert main(["sweep", "--config", str(cfg), "--no-progress", *flags]) == 2
        assert capsys.readouterr().err == (f"icl-bench: error: sweep.out: {tmp_path / 'notes.md'} {what}; choose "
                                           "another out, or pass --force to overwrite it\n")
    assert _files(tmp_path) == before and not trained and not (tmp_path / "notes_models").exists()
    assert main(["sweep", "--config", str(cfg), "--force", "--no-progress"]) == 0  # the user asked: replaced
    assert (tmp_path / "notes.md").read_text().startswith("# l1 sweep (R = ") and trained == ["l1-0-seed0"]
    capsys.readouterr()  # (its one warning: analysis_prompts = 8)
    before = _files(tmp_path)
    assert main(["sweep", "--config", str(cfg), "--no-progress"]) == 2  # an earlier sweep's checkpoints
    assert capsys.readouterr().err == (f"icl-bench: error: sweep.out: {tmp_path / 'notes_models' / 'l1-0-seed0.safetensors'} "
                                       "already exists; pass --reuse to use the saved checkpoints, --force to retrain over "
                                       "them, or choose another out\n")
    assert _files(tmp_path) == before and len(trained) == 1
    assert main(["sweep", "--config", str(cfg), "--reuse", "--no-progress"]) == 0  # its own tables: rewritten
    (tmp_path / "notes.csv").write_text("MY NUMBERS\n")
    assert main(["sweep", "--config", str(cfg), "--reuse", "--no-progress"]) == 2
    assert "notes.csv exists and is not a table written by icl-bench sweep" in capsys.readouterr().err
    assert (tmp_path / "notes.csv").read_text() == "MY NUMBERS\n"
    assert main(["sweep", "--config", str(cfg), "--reuse", "--force", "--no-progress"]) == 0
    assert (tmp_path / "notes.csv").read_text().startswith("l1,seed,R,steps,") and len(trained) == 1  # reused


def test_a_checkpoint_saved_by_another_sweep_meanwhile_is_kept(tmp_path, capsys, monkeypatch):
    """Two sweeps of one config both passed the "already exists" check before training, and the
    later one overwrote the other's checkpoints silently (found by a review). Without --force the
    pair saved meanwhile is kept and this run is saved beside it; with --reuse a lone .json (no
    weights: a missing checkpoint) is still trained over, as before."""
    import os

    from icl_bench.solvers.checkpoint import load_checkpoint
    from icl_bench.training import train as train_mod

    cfg = tmp_path / "s.toml"
    cfg.write_text(SMALL.format(out=tmp_path / "l1"))
    stem = tmp_path / "l1_models" / "l1-0-seed0"
    real = train_mod.train

    def other_sweep_saves_first(c):
        out = real(c)
        save_checkpoint(out[0], stem, {"by": "the other sweep"})
        return out

    monkeypatch.setattr(train_mod, "train", other_sweep_saves_first)
    assert main(["sweep", "--config", str(cfg), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"sweep.out: {stem}.safetensors was saved by another process" in err and f"l1-0-seed0-pid{os.getpid()}" in err
    assert load_checkpoint(stem)[1]["by"] == "the other sweep" and not (tmp_path / "l1.md").exists()
    monkeypatch.setattr(train_mod, "train", real)
    stem.with_suffix(".safetensors").unlink()  # a lone .json: --reuse trains the run over it
    assert main(["sweep", "--config", str(cfg), "--reuse", "--no-progress"]) == 0
    assert "by" not in load_checkpoint(stem)[1]


def test_a_diverged_sweep_run_names_its_field_and_an_interrupted_sweep_says_how_to_go_on(tmp_path, capsys, monkeypatch):
    """A diverged sweep run was reported as `runs.<name>`, a key a sweep config does not have (its
    lr is train.lr); Ctrl-C after some runs said only "interrupted", though --reuse keeps what was
    saved (both found by a review)."""
    import shlex

    from icl_bench.training import train as train_mod

    cfg = tmp_path / "s.toml"
    cfg.write_text(SMALL.replace("[train]\n", "[train]\nlr = 1e30\n").format(out=tmp_path / "d"))
    assert main(["sweep", "--config", str(cfg), "--no-progress"]) == 2
    warning, err = capsys.readouterr().err.split("\n", 1)  # once per sweep, not once per run
    assert warning.startswith("icl-bench: WARNING: sweep.analysis_prompts = 8: the mechanism tests' thresholds")
    assert err.startswith("icl-bench: error: train.lr (sweep run l1-0-seed0): training diverged by step") and err.count("\n") == 1
    cfg.write_text(SMALL.replace("l1 = [0.0]", "l1 = [0.0, 1e-3, 1e-2]").format(out=tmp_path / "l1"))
    real, calls = train_mod.train, []

    def stop_at_the_third(c):
        calls.append(c.name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(c)

    monkeypatch.setattr(train_mod, "train", stop_at_the_third)
    assert main(["sweep", "--config", str(cfg), "--no-progress"]) == 130
    err = capsys.readouterr().err
    again = f"icl-bench sweep --config {shlex.quote(str(cfg))} --no-progress --reuse"
    assert f"icl-bench: 2 of 3 checkpoints are saved in {tmp_path / 'l1_models'}; finish the sweep with:\n  {again}\n" in err, err
    assert main(shlex.split(again)[1:]) == 0 and calls[3:] == ["l1-0.01-seed0"]  # trains only the missing one
    assert "2 of 3 checkpoints found" in capsys.readouterr().out


@pytest.mark.parametrize("key, hint", [("seeed", "; did you mean [sweep] seeds? (the sweep sets train.seed)"),
                                       ("l1x", "; did you mean [sweep] l1? (the sweep sets train.l1)"),
                                       ("nmae", " progress, threads")])
def test_a_mistyped_train_key_is_pointed_to_where_the_sweep_sets_it(tmp_path, key, hint):
    """`[train] seeed` was told "did you mean 'seed'?", a key the sweep refuses in [train]; a near
    miss of name (which the sweep sets) gets no hint (a mutation review: nothing read the hint), and
    the list of accepted keys leaves out name, seed and l1 (it listed them; the same review)."""
    cfg = tmp_path / "s.toml"
    cfg.write_text(f"[sweep]\nl1 = [0.0]\n[train]\n{key} = 1\n")
    with pytest.raises(ConfigError) as exc:
        read_sweep(str(cfg))
    assert str(exc.value).startswith(f"train.{key}: unknown key; accepted: solver, R, N,") and str(exc.value).endswith(hint), exc.value
    listed = str(exc.value).partition("accepted: ")[2].partition(";")[0].split(", ")
    assert "steps" in listed and not {"name", "seed", "l1"} & set(listed)  # the keys the sweep sets are no keys of [train]


def test_runs_are_in_table_order_lambda_by_lambda():
    """sweep_runs gives the order the sweep trains and the CSV lists the runs: every seed of a lambda,
    in the config's order, then the next lambda (a mutation review)."""
    from icl_bench.training.config import SweepConfig
    from icl_bench.training.sweep import sweep_runs

    cfg = SweepConfig.model_validate({"sweep": {"l1": [1e-3, 0.0], "seeds": [1, 0]}, "train": {"steps": 7}})
    runs = sweep_runs(cfg, progress=False)
    assert [(r.name, r.l1, r.seed, r.steps, r.progress) for r in runs] == [
        ("l1-0.001-seed1", 1e-3, 1, 7, False), ("l1-0.001-seed0", 1e-3, 0, 7, False),
        ("l1-0-seed1", 0.0, 1, 7, False), ("l1-0-seed0", 0.0, 0, 7, False)]


def test_the_summary_gives_rel_mse_from_its_min_to_its_max():
    """rel_mse_range reads min..max over a lambda's seeds (a mutation review: max..min passed)."""
    from icl_bench.training.sweep import summarise

    table = pd.DataFrame({"l1": [0.0, 0.0, 0.0, 1e-3], "seed": [0, 1, 2, 0], "rel_mse": [2e-3, 1e-3, 3e-3, 5e-3]})
    got = summarise(table).set_index("l1")
    assert got.rel_mse_range.tolist() == ["1.00e-03..3.00e-03", "5.00e-03..5.00e-03"]
    assert got.loc[0.0, "rel_mse"] == pytest.approx(2e-3) and got.seeds.tolist() == [3, 1]


def test_a_row_leaves_non_finite_predictions_out_of_its_mse_and_keeps_its_own_columns(tmp_path, monkeypatch):
    """row_for: mse_vs_ols is the mean over the finite predictions (n_nonfinite counts the others),
    analyze's own l1 / rel_mse do not replace the row's, and layer2_division is 1 exactly for the
    state 'layer-2 division' (a mutation review: a NaN mean and an inverted share passed)."""
    import math

    import torch

    from icl_bench.training import sweep as sweep_mod
    from icl_bench.training.config import Sweep
    from icl_bench.training.train import init_model

    run = TrainConfig(name="l1-0.001-seed2", seed=2, l1=1e-3, progress=False)
    stem = tmp_path / run.name
    save_checkpoint(init_model(run), stem, {"R": run.R, "N": run.N, "seed": run.seed, "train_config": run.to_dict(),
                                            "metrics": {"step": 6}})
    real = sweep_mod.load_checkpoint

    def nan_for_the_first_prompt(s):
        model, meta = real(s)
        model.register_forward_hook(lambda m, args, out: torch.cat([out[:1] * math.nan, out[1:]]))
        return model, meta

    state = ["layer-2 division"]
    monkeypatch.setattr(sweep_mod, "load_checkpoint", nan_for_the_first_prompt)
    monkeypatch.setattr(sweep_mod, "analyze", lambda model, R, **kw: {"l1": 99.0, "rel_mse": 99.0, "hoyer": 0.5,
                                                                       "ln.state": state[0]})
    sweep = Sweep(l1=[1e-3], eval_prompts=64)
    row = sweep_mod.row_for(stem, sweep)
    model = real(stem)[0]
    batch = sample_prompts(PromptSpec(N=sweep.eval_N, noise=sweep.eval_noise, R=run.R), 64, seed=3_000_000_000)
    with torch.no_grad():
        err = (model(batch.tokens).double() - batch.ols_prediction) ** 2
    assert row["n_nonfinite"] == 1 and row["mse_vs_ols"] == pytest.approx(float(err[1:].mean()), rel=1e-6)
    assert row["rel_mse"] == pytest.approx(row["mse_vs_ols"] / float(batch.ols_prediction.var()), rel=1e-12)
    assert (row["l1"], row["seed"], row["steps"], row["hoyer"]) == (1e-3, 2, 6, 0.5)
    assert row["ln.state"] == "layer-2 division" and row["layer2_division"] == 1
    state[0] = "neither"
    assert sweep_mod.row_for(stem, sweep)["layer2_division"] == 0


def test_a_link_is_never_read_as_a_sweeps_table_nor_a_dangling_one_as_absent(tmp_path):
    """written_by_sweep takes a regular file only, and check_overwrite refuses a dangling link at
    <out>.md as it refuses a file (a mutation review: neither link case was tested)."""
    from icl_bench.training.sweep import check_overwrite, written_by_sweep

    table = tmp_path / "elsewhere.md"
    table.write_text("# l1 sweep (R = 10)\n")
    link = tmp_path / "sw.md"
    link.symlink_to(table)
    assert written_by_sweep(table) and not written_by_sweep(link)
    with pytest.raises(ConfigError, match="sw.md exists and is not a table written by icl-bench sweep"):
        check_overwrite(tmp_path / "sw", reuse=True, force=False)
    link.unlink()
    link.symlink_to(tmp_path / "gone.md")  # dangling
    with pytest.raises(ConfigError, match="sw.md already exists"):
        check_overwrite(tmp_path / "sw", reuse=False, force=False)
    check_overwrite(tmp_path / "sw", reuse=False, force=True)


@pytest.mark.filterwarnings("ignore:sweep.analysis_prompts = 64")
def test_an_interrupted_sweep_counts_its_reused_checkpoints_and_names_none_when_none_is_saved(tmp_path, capsys, monkeypatch):
    """The Ctrl-C line counts the checkpoints --reuse would find (reused ones included), and is not
    printed when nothing is saved: --reuse then refuses the empty folder (a mutation review)."""
    import icl_bench.training.sweep as sweep_mod

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep_mod, "train_and_save", interrupted)
    monkeypatch.setattr(sweep_mod, "row_for", lambda stem, sweep: {"rel_mse": 0.0, "sparsity": 0.0})
    cfg = tmp_path / "s.toml"
    cfg.write_text(TINY.format(out=tmp_path / "l1"))
    with pytest.raises(KeyboardInterrupt):
        run_sweep(str(cfg), progress=False)
    assert "checkpoints are saved" not in capsys.readouterr().err
    _saved(cfg, tmp_path / "l1_models")
    for suffix in (".safetensors", ".json"):
        (tmp_path / "l1_models" / f"l1-0.001-seed0{suffix}").unlink()
    with pytest.raises(KeyboardInterrupt):
        run_sweep(str(cfg), reuse=True, progress=False)
    assert f"icl-bench: 1 of 2 checkpoints are saved in {tmp_path / 'l1_models'}; finish" in capsys.readouterr().err
