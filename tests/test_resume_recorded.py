"""`icl-bench run --resume --out DIR` without --config: the run's own config.json is read
(bench/config.py: parse_recorded), so an interrupted run resumes without the TOML it was started
from (a user who lost it was refused, with only the first command to go on)."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import tomli_w

from icl_bench import resources
from icl_bench.bench import runner
from icl_bench.bench.config import load_config, parse_config, parse_recorded
from icl_bench.bench.schema import TIMING_COLUMNS
from icl_bench.cli import main
from icl_bench.errors import ConfigError

CUSTOM = {"seed": 5, "n_prompts": 24, "batch_size": 12, "timing": {"repeats": 1},
          "grid": {"N": [4, 7], "noise": [0.3], "R": [30.0], "dtype": ["float64"]},
          "prompts": {"x": {"dist": "uniform", "loc": -1.0, "scale": 2.0}},
          "solvers": {"gd": {"steps": [2, 1]}, "ols": {}}}


def _interrupted_run(tmp_path, monkeypatch, raw: dict, after: int = 2) -> Path:
    """`raw`'s run in tmp_path/run, from a TOML that is then deleted, stopped by a Ctrl-C after
    `after` cells."""
    cfg_path, out, real, calls = tmp_path / "mine.toml", tmp_path / "run", runner.run_cell_task, []
    cfg_path.write_text(tomli_w.dumps(raw))

    def stop(cell, **kw):
        calls.append(cell)
        if len(calls) > after:
            raise KeyboardInterrupt
        return real(cell, **kw)

    monkeypatch.setattr(runner, "run_cell_task", stop)
    assert main(["run", "--config", str(cfg_path), "--out", str(out), "--no-progress"]) == 130
    monkeypatch.setattr(runner, "run_cell_task", real)
    cfg_path.unlink()  # the TOML is gone
    return out


def test_a_run_resumes_from_its_recorded_config_and_matches_an_uninterrupted_run(tmp_path, monkeypatch, capsys):
    out = _interrupted_run(tmp_path, monkeypatch, CUSTOM)
    capsys.readouterr()
    assert main(["run", "--resume", "--out", str(out), "--no-progress"]) == 0, capsys.readouterr().err
    sessions = json.loads((out / "metadata.json").read_text())["sessions"]
    assert [(s["cells_reused"], s["cells_computed"]) for s in sessions] == [(0, 2), (2, 4)]
    resumed = pd.read_parquet(out / "results.parquet").drop(columns=list(TIMING_COLUMNS))
    whole = runner.run_matrix(parse_config(CUSTOM), tmp_path / "whole", progress=False).drop(columns=list(TIMING_COLUMNS))
    pd.testing.assert_frame_equal(resumed.reset_index(drop=True), whole.reset_index(drop=True))
    assert sorted(set(zip(resumed.solver, resumed.solver_params))) == [
        ("gd", '{"steps": 1}'), ("gd", '{"steps": 2}'), ("ols", "{}")]


def test_the_rows_keep_their_order_whatever_order_the_toml_lists_the_solvers(tmp_path, monkeypatch, capsys):
    """[solvers.ols] before [solvers.gd]: the run gave its rows in the TOML's order and the resume,
    from config.json's sorted keys, in another (a review); cells are ordered by solver name."""
    raw = {**CUSTOM, "solvers": {"ols": {}, "gd": {"steps": [2, 1]}}}
    out = _interrupted_run(tmp_path, monkeypatch, raw)
    capsys.readouterr()
    assert main(["run", "--resume", "--out", str(out), "--no-progress"]) == 0, capsys.readouterr().err
    resumed = pd.read_parquet(out / "results.parquet").drop(columns=list(TIMING_COLUMNS))
    whole = runner.run_matrix(parse_config(raw), tmp_path / "whole", progress=False).drop(columns=list(TIMING_COLUMNS))
    pd.testing.assert_frame_equal(resumed.reset_index(drop=True), whole.reset_index(drop=True))
    assert resumed.solver.tolist()[:3] == ["gd", "gd", "ols"]


def test_a_session_killed_without_a_word_is_still_listed(tmp_path, monkeypatch, capsys):
    """metadata.json's `sessions` left out a session stopped by kill -9 (its record was written at its
    end; a review): it is now written at its start and reads as killed when nothing closed it."""
    from contextlib import nullcontext

    monkeypatch.setattr(runner, "_recorded", lambda *a: nullcontext())  # as kill -9: no end is recorded
    out = _interrupted_run(tmp_path, monkeypatch, CUSTOM)
    monkeypatch.undo()
    capsys.readouterr()
    assert main(["run", "--resume", "--out", str(out), "--no-progress"]) == 0, capsys.readouterr().err
    sessions = json.loads((out / "metadata.json").read_text())["sessions"]
    assert [s["status"] for s in sessions] == ["killed (no end recorded: kill -9, a crash or a power cut)", "finished"]
    assert sessions[0]["command"] and sessions[0]["cells_computed"] is None
    assert (sessions[1]["cells_reused"], sessions[1]["cells_computed"]) == (2, 4)


def test_a_csv_run_resumes_from_its_recorded_config(tmp_path, monkeypatch, capsys):
    raw = {"seed": 1, "n_prompts": 16, "batch_size": 16, "timing": {"repeats": 1},
           "grid": {"N": [5, 9], "R": [30.0], "dtype": ["float64"]}, "solvers": {"ols": {}, "gd": {}},
           "data": {"path": "matplotlib:msft.csv", "x": "Open", "y": "Close"}}
    out = _interrupted_run(tmp_path, monkeypatch, raw, after=1)
    capsys.readouterr()
    assert main(["run", "--resume", "--out", str(out), "--no-progress"]) == 0, capsys.readouterr().err
    table = pd.read_parquet(out / "results.parquet")
    assert len(table) == 4 and (table.status == "ok").all()


def test_flags_that_change_the_config_still_name_it(tmp_path, monkeypatch, capsys):
    """--solver beside --resume and no --config means the default config with that solver, as
    before: a run of another config is refused, and nothing in the folder changes."""
    out = _interrupted_run(tmp_path, monkeypatch, CUSTOM)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["run", "--resume", "--out", str(out), "--solver", "ols", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("icl-bench: error: --resume: ") and "holds a run of another config" in err
    assert err.endswith("; --solver changes the config: drop it to resume the run as it was started\n"), err
    assert err.count("\n") == 1
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_recorded_config_that_no_longer_loads_is_one_line_and_changes_nothing(tmp_path, monkeypatch, capsys):
    out = _interrupted_run(tmp_path, monkeypatch, CUSTOM)
    doc = json.loads((out / "config.json").read_text())
    doc["solvers"]["no-such-solver"] = [{}]  # e.g. a plugin since uninstalled
    (out / "config.json").write_text(json.dumps(doc))
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["run", "--resume", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"icl-bench: error: --resume: the config recorded in {out / 'config.json'} no longer "
                          "loads: solvers.no-such-solver: unknown") and err.count("\n") == 1, err
    assert err.endswith("; install the plugin that provided that solver again, then resume\n"), err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("name", resources.config_names("run"))
def test_every_packaged_matrix_round_trips_through_its_record(name):
    """What run_matrix records (to_dict without the executor) parses back to the same config."""
    cfg = load_config(resources.config_path(name))
    record = {k: v for k, v in cfg.to_dict().items() if k != "executor"}
    again = parse_recorded(json.loads(json.dumps(record)))
    assert {k: v for k, v in again.to_dict().items() if k != "executor"} == record


@pytest.mark.parametrize("solvers, match", [([], "solvers: must map"), ({"gd": []}, "solvers: must map"),
                                            ({"gd": [3]}, "solvers: must map"),
                                            ({"gd": [{"steps": -1}]}, r"solvers\.gd\.steps"),
                                            ({"gd": [{"steps": 2}, {"steps": 2}]},  # (run twice under one key)
                                             r'solvers\.gd: the parameter set \{"steps": 2\} is repeated')])
def test_a_bad_recorded_solvers_table_is_a_config_error(solvers, match):
    with pytest.raises(ConfigError, match=match):
        parse_recorded({**CUSTOM, "solvers": solvers})


def test_stored_cells_that_match_no_cell_of_the_run_are_said_to_be_recomputed(tmp_path):
    """A plugin edited between a run and its --resume changes its cells' keys: every cell was
    recomputed without a word (found by a new-user tryout). The count is now a warning."""
    import sqlite3

    from icl_bench.bench import store

    out = tmp_path / "run"
    cfg = parse_config(CUSTOM)
    runner.run_matrix(cfg, out, progress=False)
    with sqlite3.connect(out / "cells.sqlite") as db:  # a row as an older code version would have keyed it
        cols = [r[1] for r in db.execute("PRAGMA table_info(cells)")]
        key, *values, _ = db.execute(f"SELECT {', '.join(cols)} FROM cells LIMIT 1").fetchone()
        values = [float("nan") if v is None else v for v in values]
        db.execute(f"INSERT INTO cells VALUES ({', '.join('?' * len(cols))})",
                   ["old-" + key, *values, store._checksum("old-" + key, values)])
    with pytest.warns(UserWarning, match=r"--resume: 1 of the 7 finished cells stored in .* match no cell of this run "
                                         r"and are not reused: a cell's key covers the code"):
        runner.run_matrix(cfg, out, resume=True, progress=False)


def _resumed_elsewhere(tmp_path, monkeypatch, capsys, raw: dict):
    """(run folder, stderr) of a run of `raw` interrupted after one cell, then resumed with the
    recorded config from tmp_path/elsewhere, which must be refused (exit 2)."""
    out = _interrupted_run(tmp_path, monkeypatch, raw, after=1)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    capsys.readouterr()
    assert main(["run", "--resume", "--out", str(out), "--no-progress"]) == 2
    return out, capsys.readouterr().err


def test_a_relative_csv_path_is_read_from_the_folder_the_run_started_in(tmp_path, monkeypatch, capsys):
    """Resumed from another folder, the recorded relative data.path was missing and the advice was
    to give the TOML, which resolves the path differently and is refused (a review)."""
    (tmp_path / "d.csv").write_text("xx,yy\n" + "".join(f"{i},{2 * i + 1}\n" for i in range(40)))
    monkeypatch.chdir(tmp_path)
    raw = {"seed": 1, "n_prompts": 8, "batch_size": 8, "timing": {"repeats": 1}, "grid": {"N": [5, 9], "R": [30.0]},
           "solvers": {"ols": {}}, "data": {"path": "d.csv", "x": "xx", "y": "yy"}}
    out, err = _resumed_elsewhere(tmp_path, monkeypatch, capsys, raw)
    assert err.endswith("a relative data.path is read from the folder the run was started in: resume from there\n"), err
    (tmp_path / "elsewhere" / "d.csv").write_text("p,q\n" + "".join(f"{i},{i}\n" for i in range(40)))  # another d.csv
    assert main(["run", "--resume", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err  # (the advice was to give the TOML, though the file is what differs: a review)
    assert "data.x: no column 'xx' in d.csv" in err and err.endswith(
        "resume where data.path names the run's own file (a relative data.path is read from the folder the run was "
        "started in)\n"), err
    assert main(["run", "--resume", "--out", str(out), "--no-progress", "--data", "d.csv", "--x", "p", "--y", "q"]) == 2
    err = capsys.readouterr().err  # the default matrix's N = 300 against 40 rows: blamed on the file (a review)
    assert err.startswith("icl-bench: error: grid.N: N=300 needs at least 301 rows") and err.endswith(
        "(--resume with --data or --solver and no --config reads the packaged default matrix, not the run's "
        "config.json: drop them to resume the run as recorded)\n"), err
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--resume", "--out", str(out), "--no-progress"]) == 0


def test_a_relative_models_dir_is_read_from_the_folder_the_run_started_in(tmp_path, monkeypatch, capsys):
    """Resumed from another folder, a relative models_dir was missing and the advice was to give the
    TOML, which fails the same way there (found by a new-user tryout); as for data.path, the advice
    is now to resume from the folder the run was started in."""
    import shutil

    from icl_bench.resources import models_dir

    (tmp_path / "models").mkdir()
    for half in ("json", "safetensors"):
        shutil.copy(models_dir() / f"trained-lsa-R10.{half}", tmp_path / "models")
    monkeypatch.chdir(tmp_path)
    raw = {"seed": 1, "n_prompts": 8, "batch_size": 8, "timing": {"repeats": 1}, "grid": {"N": [10, 20], "R": [10.0]},
           "solvers": {"trained-lsa": {"models_dir": "models"}}}
    out, err = _resumed_elsewhere(tmp_path, monkeypatch, capsys, raw)
    assert "models_dir: no such folder 'models'" in err and err.endswith(
        "a relative models_dir is read from the folder the run was started in: resume from there\n"), err
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--resume", "--out", str(out), "--no-progress"]) == 0


def test_a_record_of_an_older_layout_is_not_sent_back_to_itself(tmp_path, monkeypatch, capsys):
    """A config.json written before grid.d existed parses with today's default added, which the
    store then refused with 'resume it with ... the config.json there is read', what the user did."""
    out = _interrupted_run(tmp_path, monkeypatch, CUSTOM)
    doc = json.loads((out / "config.json").read_text())
    del doc["grid"]["d"]  # as results/ood's config.json had it before the d axis
    (out / "config.json").write_text(json.dumps(doc))
    capsys.readouterr()
    assert main(["run", "--resume", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "read back, describes another matrix than its run's: it was written by an older icl-bench" in err, err
