"""The CSV prompt source (icl_bench/prompts/data.py): which rows a seeded prompt draws, what that
costs in memory, and compressed files."""
from __future__ import annotations

import hashlib
import json
import tracemalloc

import numpy as np
import pandas as pd
import pytest
import tomli_w
import torch

from icl_bench.cli import main
from icl_bench.errors import ConfigError
from icl_bench.prompts import data
from icl_bench.prompts.data import DataSource, check_source, data_summary, sample_data_prompts


def _old_rows(seed: int, n_prompts: int, n_rows: int, k: int) -> np.ndarray:
    """The formula every earlier run drew its rows with (reference for bit-identical prompts)."""
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((n_prompts, n_rows)), axis=1)[:, :k]


@pytest.mark.parametrize("budget", [1, 7, 100, 2**20])  # 1 prompt per chunk, a partial last chunk, one chunk
@pytest.mark.parametrize("n_rows, k", [(50, 5), (50, 50), (1, 1), (333, 1), (333, 40)])
def test_rows_equal_the_full_argsort(monkeypatch, budget, n_rows, k):
    monkeypatch.setattr(data, "KEYS_PER_CHUNK", budget)
    for seed in (0, 7):
        got = data._draw_rows(np.random.default_rng(seed), 37, n_rows, k)
        assert got.dtype == np.int64 and got.shape == (37, k)
        np.testing.assert_array_equal(got, _old_rows(seed, 37, n_rows, k))


def test_seeded_csv_prompts_unchanged(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "KEYS_PER_CHUNK", 1000, raising=False)  # several chunks (passes on the old code too)
    rng = np.random.default_rng(1)
    frame = pd.DataFrame({"x": rng.normal(size=400), "y": rng.normal(size=400)})
    frame.to_csv(tmp_path / "d.csv", index=False)
    xs, ys = pd.read_csv(tmp_path / "d.csv")[["x", "y"]].to_numpy(np.float64).T
    batch = sample_data_prompts(DataSource(path=str(tmp_path / "d.csv"), x="x", y="y"), 9, 10.0, 50, seed=4,
                                dtype="float64")
    idx = _old_rows(4, 50, 400, 10)
    assert torch.equal(batch.x, torch.from_numpy(xs[idx[:, :9]]))
    assert torch.equal(batch.y, torch.from_numpy(ys[idx[:, :9]]))
    assert torch.equal(batch.x_query, torch.from_numpy(xs[idx[:, 9]]))
    assert torch.equal(batch.y_query, torch.from_numpy(ys[idx[:, 9]]))


def test_the_rows_are_drawn_once_per_grid_point_whatever_the_dtype(tmp_path, monkeypatch):
    """Each dtype drew the rows again, O(n_prompts x rows) apiece: 30 s a draw from 1e6 rows (a review)."""
    pd.DataFrame({"x": np.arange(300.0), "y": np.arange(300.0) % 7}).to_csv(tmp_path / "d.csv", index=False)
    source = DataSource(path=str(tmp_path / "d.csv"), x="x", y="y")
    calls = []
    draw = data._draw_rows
    monkeypatch.setattr(data, "_draw_rows", lambda *a: calls.append(a[1:]) or draw(*a))
    data._rows_of.cache_clear()
    b32, b64 = (sample_data_prompts(source, 9, 10.0, 50, seed=123, dtype=dt) for dt in ("float32", "float64"))
    assert len(calls) == 1 and torch.equal(b32.x.double(), b64.x) and torch.equal(b32.x_query.double(), b64.x_query)
    sample_data_prompts(source, 9, 10.0, 50, seed=124, dtype="float32")  # another point: its own draw
    assert len(calls) == 2


def test_chunk_holds_a_bounded_number_of_keys():
    for n_rows in (1, 65, 3000, 300_000, 10**7):
        step = data._chunk_rows(n_rows)
        assert step >= 1 and (step == 1 or step * n_rows <= data.KEYS_PER_CHUNK)


def test_peak_memory_does_not_scale_with_prompts_times_rows(tmp_path):
    # the full key matrix would be 400 x 100_000 float64 = 320 MB (+ as much again for argsort)
    n_prompts, n_rows, N = 400, 100_000, 16
    pd.DataFrame({"x": np.arange(n_rows) % 97, "y": np.arange(n_rows) % 89}).to_csv(tmp_path / "d.csv", index=False)
    source = DataSource(path=str(tmp_path / "d.csv"), x="x", y="y")
    data._columns(source)  # parsed (and cached) outside the measurement
    tracemalloc.start()
    try:
        sample_data_prompts(source, N, 10.0, n_prompts, seed=0, dtype="float64")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < n_prompts * n_rows * 8 / 10, peak  # the old argsort of every key: > 640 MB
    chunk = data._chunk_rows(n_rows) * n_rows * 16  # keys (float64) + argpartition's indices (int64)
    assert peak < 2 * chunk + 2**22, peak  # plus the (400, 17) batch and its tensors


COMPRESSED = ["gz", "zip", "bz2", "xz", "tar", "tar.gz", "tar.xz", "GZ"]


def _frame_with_gaps() -> pd.DataFrame:
    rng = np.random.default_rng(2)
    frame = pd.DataFrame({"x": rng.normal(size=60), "y": rng.normal(size=60)})
    frame.loc[[3, 40], "y"] = np.nan  # dropped rows: counted the same through every compression
    return frame


@pytest.mark.parametrize("ext", COMPRESSED)
def test_compressed_csv_gives_the_plain_files_prompts(tmp_path, ext):
    frame = _frame_with_gaps()
    frame.to_csv(tmp_path / "d.csv", index=False)
    frame.to_csv(tmp_path / f"d.csv.{ext}", index=False)  # pandas compresses by the name's ending
    assert (tmp_path / f"d.csv.{ext}").read_bytes() != (tmp_path / "d.csv").read_bytes()
    plain, packed = (DataSource(path=str(tmp_path / name), x="x", y="y") for name in ("d.csv", f"d.csv.{ext}"))
    assert check_source(packed, [20]) == packed
    assert data_summary(packed)[:2] == data_summary(plain)[:2] == (60, 2)
    a, b = (sample_data_prompts(s, 20, 10.0, 30, seed=1, dtype="float64") for s in (plain, packed))
    for k, v in a.tensors().items():
        assert torch.equal(v, getattr(b, k)) or torch.isnan(v).all() and torch.isnan(getattr(b, k)).all(), k


@pytest.mark.parametrize("ext", ["gz", "zip"])
def test_run_with_a_compressed_csv(tmp_path, capsys, ext):
    path = tmp_path / f"d.csv.{ext}"
    _frame_with_gaps().to_csv(path, index=False)
    cfg = tmp_path / "c.toml"
    cfg.write_text(tomli_w.dumps({"seed": 0, "n_prompts": 16, "batch_size": 16, "timing": {"repeats": 1},
                                  "grid": {"N": [4], "R": [10.0], "dtype": ["float64"]},
                                  "solvers": {"ols": {}}}))
    out = tmp_path / "run"
    code = main(["run", "--config", str(cfg), "--data", str(path), "--x", "x", "--y", "y", "--out", str(out),
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err, err
    assert "dropped 2 of 60 rows" in err
    table = pd.read_parquet(out / "results.parquet")
    assert (table.status == "ok").all() and (table.n_nonfinite == 0).all()
    assert (table.data_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()).all()  # the file's own bytes
    assert json.loads((out / "metadata.json").read_text())["data_rows_dropped"] == 2


def _noisy_line(path, scale: float = 1.0, rows: int = 300) -> None:
    x = np.arange(rows, dtype=float)
    pd.DataFrame({"x": x * scale, "y": (2 * x + 1 + np.random.default_rng(3).normal(size=rows)) * scale}).to_csv(
        path, index=False)


def test_a_csv_edited_during_a_run_changes_no_cell(tmp_path, monkeypatch):
    """Every cell draws from the bytes whose sha256 it records: the file was read again per grid
    point, so cells after an edit computed the new content under the old data_sha256 (and
    --resume / --cache then served those rows as the old content's)."""
    from icl_bench.bench import runner
    from icl_bench.bench.config import parse_config
    from icl_bench.bench.runner import run_matrix

    path = tmp_path / "data.csv"
    raw = {"seed": 0, "n_prompts": 16, "batch_size": 16, "timing": {"repeats": 1},
           "grid": {"N": [4, 5, 6, 7], "dtype": ["float64"]}, "solvers": {"ols": {}},
           "data": {"path": str(path), "x": "x", "y": "y"}}
    _noisy_line(path)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    clean = run_matrix(parse_config(raw), progress=False)
    task = runner.run_cell_task

    def edit_after_the_first_cell(cell, **kw):
        row = task(cell, **kw)
        _noisy_line(path, scale=1000.0)  # the same values x 1000
        return row

    _noisy_line(path)
    cfg = parse_config(raw)
    monkeypatch.setattr(runner, "run_cell_task", edit_after_the_first_cell)
    table = run_matrix(cfg, progress=False)
    assert hashlib.sha256(path.read_bytes()).hexdigest() != before  # the file did change mid-run
    assert (table.status == "ok").all() and (table.data_sha256 == before).all()
    cols = ["N", "mse_vs_target", "abs_err_median", "mse_vs_ols"]
    pd.testing.assert_frame_equal(table[cols], clean[cols])  # the edit reached no cell


def test_a_process_without_the_runs_bytes_refuses_an_edited_file(tmp_path):
    """A Dask worker has not the driver's bytes: it reads the file, and a file whose bytes no
    longer hash to the cell's data_sha256 gives an error row, not the new data under the old hash."""
    from icl_bench.bench.cells import expand_cells
    from icl_bench.bench.config import parse_config
    from icl_bench.bench.runner import run_cell

    path = tmp_path / "data.csv"
    _noisy_line(path)
    cfg = parse_config({"seed": 0, "n_prompts": 16, "batch_size": 16, "timing": {"repeats": 1},
                        "grid": {"N": [4], "dtype": ["float64"]}, "solvers": {"ols": {}},
                        "data": {"path": str(path), "x": "x", "y": "y"}})
    (cell,) = expand_cells(cfg)
    assert run_cell(cell)["status"] == "ok"
    data._SNAPSHOTS.clear()  # another process (a Dask worker): only the file on disk
    cell = cell.__class__(**{**cell.__dict__, "N": 5})  # a grid point no cache holds
    assert run_cell(cell)["status"] == "ok"  # the same bytes: drawn, and kept for the next cells
    _noisy_line(path, scale=1000.0)
    assert run_cell(cell.__class__(**{**cell.__dict__, "N": 6}))["status"] == "ok"  # kept: never read again
    data._SNAPSHOTS.clear()
    row = run_cell(cell.__class__(**{**cell.__dict__, "N": 7}))
    assert row["status"] == "error" and "data.path: " in row["message"], row
    assert "changed since the run started" in row["message"] and row["data_sha256"] == cell.data_sha256


def test_a_worker_reading_a_relative_path_from_its_own_folder_is_told_so(tmp_path, monkeypatch):
    """A Dask worker reads a relative [data] path from its own folder: the row said "No such file"
    or, with another file of that name there, "changed since the run started ... rerun", which never
    helps (a review). Both now say the path is relative and to give an absolute one."""
    from icl_bench.bench.cells import expand_cells
    from icl_bench.bench.config import parse_config
    from icl_bench.bench.runner import run_cell

    driver, worker = tmp_path / "driver", tmp_path / "worker"
    driver.mkdir(), worker.mkdir()
    _noisy_line(driver / "data.csv")
    monkeypatch.chdir(driver)
    cfg = parse_config({"seed": 0, "n_prompts": 16, "batch_size": 16, "timing": {"repeats": 1},
                        "grid": {"N": [4], "dtype": ["float64"]}, "solvers": {"ols": {}},
                        "data": {"path": "data.csv", "x": "x", "y": "y"}})
    (cell,) = expand_cells(cfg)
    assert run_cell(cell)["status"] == "ok"
    data._SNAPSHOTS.clear()  # a worker: only the files on its disk, from its folder
    monkeypatch.chdir(worker)
    hint = (f"a relative path is read from each process's own folder, here {worker}, which a Dask worker's is not the "
            "driver's: give [data] path (--data) as an absolute path on a file system the workers share")
    row = run_cell(cell.__class__(**{**cell.__dict__, "N": 5}))
    assert row["status"] == "error" and row["message"].startswith("FileNotFoundError: data.path: data.csv: no such file; ")
    assert hint in " ".join(row["message"].split()), row["message"]
    _noisy_line(worker / "data.csv", scale=3.0)  # another file of that name in the worker's folder
    row = run_cell(cell.__class__(**{**cell.__dict__, "N": 6}))
    assert "changed since the run started" in row["message"] and "or, as a relative path is read from" in row["message"]
    assert hint.split(", here")[1] in " ".join(row["message"].split()), row["message"]


@pytest.mark.parametrize("key, value, expected", [
    ("noise", [0.0, 0.1], "grid.noise: [0.0, 0.1] would be ignored: CSV prompts ([data] / --data) take y from the file"),
    ("noise", [0.1], "grid.noise: [0.1] would be ignored"),  # given is given, even the default value
    ("prompts", {"x": {"dist": "uniform", "loc": 0.0, "scale": 2.0}}, "prompts.x: would be ignored: CSV prompts"),
    ("prompts", {"slope": {"loc": 1.0}}, "prompts.slope: would be ignored"),
    ("ood", ["none", "student-t:3"], "grid.ood: student-t redraws the prompts"),  # every such cell was an error row
])
def test_settings_csv_prompts_would_ignore_are_refused(tmp_path, key, value, expected):
    """A noise grid beside [data] gave one cell per grid point (the list was replaced by NaN) and a
    [prompts] table was dropped, both silently."""
    from icl_bench.bench.config import parse_config

    path = tmp_path / "d.csv"
    _noisy_line(path, rows=40)
    raw = {"n_prompts": 16, "grid": {"N": [4]}, "solvers": {"ols": {}}, "data": {"path": str(path), "x": "x", "y": "y"}}
    if key in ("noise", "ood"):
        raw["grid"][key] = value
    else:
        raw[key] = value
    with pytest.raises(ConfigError) as exc:
        parse_config(raw)
    assert str(exc.value).startswith(expected), exc.value
    assert parse_config({**raw, "grid": {"N": [4]}, "prompts": {}}).data is not None  # neither given: accepted


def test_data_flag_with_a_packaged_matrix_drops_its_noise_grid(tmp_path, capsys):
    """`run --data` on the packaged default (noise = [0.0, 0.1, 0.5], not the user's) still runs,
    one cell per grid point without noise; a user's own config giving noise is refused instead."""
    path, out = tmp_path / "d.csv", tmp_path / "o"
    _noisy_line(path, rows=400)
    argv = ["run", "--data", str(path), "--x", "x", "--y", "y", "--solver", "ols", "--no-progress"]
    assert main([*argv, "--out", str(out)]) == 0, capsys.readouterr().err
    table = pd.read_parquet(out / "results.parquet")
    assert len(table) == 4 * 3 * 2 * 2 and table.noise.isna().all()  # N x R x dtype x device, no noise axis
    own = tmp_path / "own.toml"
    own.write_text(tomli_w.dumps({"grid": {"N": [4], "noise": [0.0, 0.5]}, "solvers": {"ols": {}}}))
    capsys.readouterr()
    assert main([*argv, "--config", str(own), "--out", str(tmp_path / "o2")]) == 2
    assert capsys.readouterr().err.startswith("icl-bench: error: grid.noise: [0.0, 0.5] would be ignored")
    assert not (tmp_path / "o2").exists()
    ood = [*argv[:-1], "--config", "ood", "--out", str(tmp_path / "o3"), "--no-progress"]  # its student-t values are
    assert main(ood) == 0, capsys.readouterr().err  # dropped too (they need the generator): the other maps run
    table = pd.read_parquet(tmp_path / "o3" / "results.parquet")
    assert (table.status == "ok").all() and "none" in set(table.ood) and not table.ood.str.startswith("student-t").any()
    assert ("icl-bench: --data: the packaged 'ood' matrix's ood values student-t:3 redraw x from the generator and do "
            "not apply to CSV data: left out") in capsys.readouterr().err  # it was silent (a review)


def _folder(out) -> dict:
    return {f.name: f.read_bytes() for f in sorted(out.iterdir())}


def _small_csv_run(tmp_path, name: str):
    """(CSV path, run folder, argv) of a finished one-cell `ols` run on a 40-row CSV."""
    path, out = tmp_path / name, tmp_path / "o"
    _noisy_line(path, rows=40)
    cfg = tmp_path / "c.toml"
    cfg.write_text(tomli_w.dumps({"n_prompts": 16, "batch_size": 16, "timing": {"repeats": 1}, "grid": {"N": [4]},
                                  "solvers": {"ols": {}}}))
    argv = ["run", "--config", str(cfg), "--data", str(path), "--x", "x", "--y", "y", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    return path, out, argv


@pytest.mark.parametrize("old_folder", [False, True])
def test_resume_after_the_csv_was_edited_is_refused_and_changes_nothing(tmp_path, capsys, old_folder):
    """--resume on edited --data bytes recomputed every cell and silently replaced the table; now
    one line naming the file, nothing in the folder touched. old_folder: a run folder written
    before config.json kept the digest (the one in its results table is used)."""
    path, out, argv = _small_csv_run(tmp_path, "mut.csv")
    digest = json.loads((out / "config.json").read_text())["data_sha256"]
    if old_folder:
        saved = json.loads((out / "config.json").read_text())
        del saved["data_sha256"]
        (out / "config.json").write_text(json.dumps(saved, sort_keys=True))
    kept = path.read_bytes()
    before = _folder(out)
    path.write_bytes(kept + b"5,11\n")
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"icl-bench: error: --data: the bytes of {path} changed since the run in {out} was made")
    assert "give a new --out" in err and "restore the file" in err and err.count("\n") == 1, err
    assert _folder(out) == before  # nothing in the folder changed
    path.write_bytes(kept)  # restored: the run resumes, every cell reused
    assert main([*argv, "--resume"]) == 0
    assert json.loads((out / "metadata.json").read_text())["n_cells_reused"] == 1
    assert json.loads((out / "config.json").read_text())["data_sha256"] == digest  # an old record is upgraded
    # (a mutation review: left without it, a later resume with no results table to fall back on lost the refusal)


def test_a_csv_run_records_no_generator_settings_and_resumes_an_older_record(tmp_path, capsys):
    """config.json and metadata.json of a CSV run recorded [prompts] (standard normal x, slope and
    intercept) and grid.noise = [0.1], defaults that described prompts never drawn. They are left
    out now; a folder whose config.json still has them resumes (with or without --config)."""
    path, out, argv = _small_csv_run(tmp_path, "d.csv")
    for doc in (json.loads((out / "config.json").read_text()), json.loads((out / "metadata.json").read_text())["config"]):
        assert "prompts" not in doc and "noise" not in doc["grid"] and doc["data"]["x"] == "x", doc
    saved = json.loads((out / "config.json").read_text())
    saved["grid"]["noise"] = [0.1]  # as runs before this change recorded it
    saved["prompts"] = {k: {"dist": "normal", "loc": 0.0, "scale": 1.0} for k in ("intercept", "slope", "x")}
    (out / "config.json").write_text(json.dumps(saved, sort_keys=True))
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0, capsys.readouterr().err
    assert json.loads((out / "metadata.json").read_text())["n_cells_reused"] == 1
    (out / "config.json").write_text(json.dumps(saved, sort_keys=True))
    assert main(["run", "--out", str(out), "--resume", "--no-progress"]) == 0, capsys.readouterr().err
    assert json.loads((out / "metadata.json").read_text())["n_cells_reused"] == 1


def test_an_empty_trailing_field_keeps_the_columns(tmp_path):
    """`x,y` then rows `1,2,` (a delimiter at each line's end): pandas took the first field as the
    index, so x read as 2 and y as empty (every row dropped); the columns now stay in place."""
    path = tmp_path / "d.csv"
    path.write_text("x,y\n" + "".join(f"{i},{2 * i + 1},\n" for i in range(8)))
    source = check_source(DataSource(path=str(path), x="x", y="y"), [4])
    xs, ys = data._columns(source)
    np.testing.assert_array_equal(xs, np.arange(8.0))
    np.testing.assert_array_equal(ys, 2 * np.arange(8.0) + 1)


def test_integers_beyond_64_bits_are_numbers(tmp_path):
    """pandas leaves a column holding 99999999999999999999 untyped (Python ints; with a negative
    value, text): it was refused as "not numeric (data row 1: '0')", naming a row that holds a
    number. Every cell is a number, so the column reads as the same values written in float form."""
    path = tmp_path / "d.csv"
    rows = [f"{i},{2 * i + 1}" for i in range(11)] + ["99999999999999999999,5", "-1" + "0" * 400 + ",7", "3,-1"]
    path.write_text("x,y\n" + "\n".join(rows) + "\n")
    source = check_source(DataSource(path=str(path), x="x", y="y"), [4])
    xs, ys = data._columns(source)
    np.testing.assert_array_equal(xs, [*range(11), 1e20, 3.0])  # 10**400 overflows to -inf: its row is dropped
    np.testing.assert_array_equal(ys, [*(2 * np.arange(11) + 1), 5.0, -1.0])
    assert data_summary(source)[:2] == (14, 1)
    path.write_text("x,y\n" + "\n".join(rows[:12]) + "\nabc,9\n")  # a cell that is no number is still named
    with pytest.raises(ConfigError, match=r"^data\.x: column 'x' is not numeric \(data row 13: 'abc'\)"):
        check_source(DataSource(path=str(path), x="x", y="y"), [4])


def test_a_folder_as_data_path_is_named_a_folder(tmp_path):
    """[data] path = a folder read 'no such file' though it exists (found by a review)."""
    with pytest.raises(ConfigError, match=rf"^data.path: '{tmp_path}' is a folder; accepted: a CSV file"):
        check_source(DataSource(path=str(tmp_path), x="x", y="y"), [4])


def test_missing_cells_in_a_column_pandas_left_as_text_are_dropped(tmp_path):
    """An integer beyond 64 bits makes pandas keep a column as text, and then '' and 'nan' stay
    strings: they were refused as 'not numeric (data row 3: '')' though the message lists them as
    accepted (found by a review). They are missing values: their rows are dropped."""
    rows = ["x,y", "0,99999999999999999999", "1,1.5", "2,", "3,nan"] + [f"{i},{2 * i}" for i in range(4, 24)]
    (tmp_path / "d.csv").write_text("\n".join(rows) + "\n")
    src = check_source(DataSource(path=str(tmp_path / "d.csv"), x="x", y="y"), [10])
    n_rows, n_dropped, _ = data_summary(src)
    assert (n_rows, n_dropped) == (24, 2)
    (tmp_path / "e.csv").write_text("\n".join(rows + ["24,abc"]) + "\n")
    with pytest.raises(ConfigError, match=r"^data.y: column 'y' is not numeric \(data row 25: 'abc'\)"):
        check_source(DataSource(path=str(tmp_path / "e.csv"), x="x", y="y"), [10])


def test_a_device_is_not_a_csv_file():
    """[data] path = "/dev/null" read "no such file" (found by a review)."""
    with pytest.raises(ConfigError, match=r"^data.path: '/dev/null' is not a regular file"):
        check_source(DataSource(path="/dev/null", x="x", y="y"), [5])


def test_an_unreadable_file_is_one_line(tmp_path, monkeypatch):
    """A file without read permission raised UnboundLocalError (the error handler read the bytes
    that were never read; found by a review)."""
    from pathlib import Path

    (tmp_path / "d.csv").write_text("x,y\n" + "".join(f"{i},{i}\n" for i in range(20)))

    def denied(self):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(ConfigError, match=r"^data.path: cannot read '.*d.csv' \(Permission denied\); accepted: a readable CSV file$"):
        check_source(DataSource(path=str(tmp_path / "d.csv"), x="x", y="y"), [5])


def test_a_row_with_one_field_too_many_is_named_by_its_line(tmp_path):
    """One row with a trailing comma read 'cannot read ... as CSV (ParserError)': no line to fix."""
    (tmp_path / "d.csv").write_text("x,y\n" + "".join(f"{i},{i}\n" for i in range(31)) + "31,31,\n")
    with pytest.raises(ConfigError, match=r"\(ParserError: .*Expected 2 fields in line 33, saw 3\); accepted: UTF-8 CSV text"):
        check_source(DataSource(path=str(tmp_path / "d.csv"), x="x", y="y"), [5])


def test_a_file_swapped_after_its_check_is_not_what_the_run_reads(tmp_path):
    """The file was read by the check, again for the dropped-rows note and again for the cells: a
    file swapped in between ran on bytes that never passed the check (error rows with another
    file's digest, found by a review). The run draws from the bytes the check accepted."""
    good = "x,y\n" + "".join(f"{i},{2 * i}\n" for i in range(20))
    path = tmp_path / "d.csv"
    path.write_text(good)
    src = check_source(DataSource(path=str(path), x="x", y="y"), [5])
    path.write_text("x,y\n" + "".join(f"{i},abc\n" for i in range(20)))  # swapped after the check
    digest = data.snapshot(src)
    assert digest == hashlib.sha256(good.encode()).hexdigest()
    assert data_summary(src, digest)[:2] == (20, 0)


def test_ill_posed_csv_windows_are_not_counted_as_failures(tmp_path, capsys):
    """x in {0, 1}: a context of N = 3 rows is constant (ill-posed, no least-squares answer) about
    a quarter of the time. Every solver answers NaN there, as it must: the row counts those prompts
    in n_ill_posed, not as failures, the headline flags no NaN and says how many prompts were
    ill-posed, and the MSE vs OLS is pooled over the prompts it was taken over."""
    from icl_bench.report import aggregate as report

    rng = np.random.default_rng(0)
    x = rng.integers(0, 2, size=2000).astype(float)
    pd.DataFrame({"x": x, "y": 2 * x + rng.normal(size=2000)}).to_csv(tmp_path / "d.csv", index=False)
    raw = {"n_prompts": 128, "batch_size": 128, "timing": {"repeats": 1}, "grid": {"N": [3, 20], "dtype": ["float64"]},
           "data": {"path": str(tmp_path / "d.csv"), "x": "x", "y": "y"}, "solvers": {"ols": {}, "gd": {}}}
    for seed in (0, 1):  # two seeds: two draws of windows, pooled by publish
        (tmp_path / "c.toml").write_text(tomli_w.dumps(dict(raw, seed=seed)))
        assert main(["run", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / f"s{seed}"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "NaN/inf predictions" not in out
    table, _ = report.load_runs([tmp_path / "s0", tmp_path / "s1"])
    short = table[table.N == 3]
    k = short.n_ill_posed
    assert (k > 10).all() and (k < 64).all() and (short.n_nonfinite == k).all() and (short.n_nonfinite_well_posed == 0).all()
    assert (table[table.N == 20].n_ill_posed == 0).all()
    summary = report.aggregate(table)
    gd = summary[(summary.solver == "gd") & (summary.N == 3)].iloc[0]
    rows = short[short.solver == "gd"]
    expected = float((rows.mse_vs_ols * (128 - rows.n_ill_posed)).sum() / (256 - rows.n_ill_posed.sum()))
    assert gd.mse_vs_ols == pytest.approx(expected, rel=1e-12) and gd.n_ill_posed == rows.n_ill_posed.sum()
    assert main(["publish", str(tmp_path / "s0"), str(tmp_path / "s1"), "--out", str(tmp_path / "pub")]) == 0
    headline = (tmp_path / "pub" / "headline.md").read_text()
    assert " NaN)" not in headline
    assert "ill-posed prompts" in headline and f"N=3: {int(rows.n_ill_posed.sum())} of 256" in headline
    # a run from before the columns beside a new one: its seed counts every NaN as failed, the new
    # seed stays exact (the whole group fell back to the old count)
    old = tmp_path / "old"
    old.mkdir()
    pd.read_parquet(tmp_path / "s1" / "results.parquet").drop(columns=["n_ill_posed", "n_nonfinite_well_posed"]) \
        .to_parquet(old / "results.parquet")
    mixed = report.aggregate(report.load_runs([tmp_path / "s0", old])[0])
    gd = mixed[(mixed.solver == "gd") & (mixed.N == 3)].iloc[0]
    new, before = rows[rows.seed == 0].iloc[0], rows[rows.seed == 1].iloc[0]
    assert (gd.n_ill_posed, gd.n_nonfinite_well_posed) == (new.n_ill_posed, before.n_nonfinite)
    bad = table.assign(n_ill_posed=table.n_ill_posed.where(table.solver != "ols", 999))  # more than n_prompts
    bad.drop(columns=["run", "series", "series_rank"]).to_parquet(old / "results.parquet")
    with pytest.raises(ConfigError, match="column 'n_ill_posed' holds 999 in an ok row of n_prompts 128"):
        report.load_runs([old])
    bad = table.assign(n_ill_posed=64, n_nonfinite_well_posed=table.n_nonfinite.clip(upper=64))  # each <= 128,
    bad.loc[bad.solver == "ols", ["n_nonfinite", "n_nonfinite_well_posed"]] = 100  # together more
    bad.drop(columns=["run", "series", "series_rank"]).to_parquet(old / "results.parquet")
    with pytest.raises(ConfigError, match="expected n_ill_posed \\+ n_nonfinite_well_posed <= n_prompts"):
        report.load_runs([old])


def test_a_relative_data_path_in_both_folders_is_refused(tmp_path, monkeypatch, capsys):
    """A relative [data] path is looked up in the current folder, then beside the config. Found in
    both as two different files, the current folder's won silently, and the prompts column named
    only "data.csv" (found by a new-user tryout): now that is refused, naming both. Found in one
    folder, or as one file in both (run from the config's folder), it is used as before."""
    rows = lambda b: "x,y\n" + "\n".join(f"{i},{b * i + 1}" for i in range(20)) + "\n"  # noqa: E731
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cwd").mkdir()
    (tmp_path / "cfg" / "data.csv").write_text(rows(2))
    src = DataSource(path="data.csv", x="x", y="y")
    monkeypatch.chdir(tmp_path / "cwd")
    assert check_source(src, [4], tmp_path / "cfg").path == str(tmp_path / "cfg" / "data.csv")  # beside the config only
    monkeypatch.chdir(tmp_path / "cfg")
    assert check_source(src, [4], tmp_path / "cfg").path == "data.csv"  # one file, reached both ways
    monkeypatch.chdir(tmp_path / "cwd")
    (tmp_path / "cwd" / "data.csv").write_text(rows(-1))
    with pytest.raises(ConfigError, match=rf"^data\.path: 'data.csv' names two different files, '{tmp_path}/cwd/data.csv' "
                                          rf"\(from the current folder\) and '{tmp_path}/cfg/data.csv' \(beside the config\)"):
        check_source(src, [4], tmp_path / "cfg")
    assert check_source(src, [4]).path == "data.csv"  # no config folder: the current folder's
    (tmp_path / "cfg" / "m.toml").write_text(tomli_w.dumps({"n_prompts": 8, "grid": {"N": [4]}, "solvers": {"ols": {}},
                                                          "data": {"path": "data.csv", "x": "x", "y": "y"}}))
    assert main(["run", "--config", str(tmp_path / "cfg" / "m.toml"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("icl-bench: error: data.path: 'data.csv' names two different files") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
    # a path typed on the command line means the current folder's file: --data is not looked up beside
    # the config (it was, and then refused as ambiguous; found by an adversarial tester)
    (tmp_path / "cfg" / "plain.toml").write_text(tomli_w.dumps({"n_prompts": 8, "grid": {"N": [4]}, "solvers": {"ols": {}}}))
    argv = ["run", "--config", str(tmp_path / "cfg" / "plain.toml"), "--data", "data.csv", "--x", "x", "--y", "y", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "out2")]) == 0, capsys.readouterr().err
    used = pd.read_parquet(tmp_path / "out2" / "results.parquet").data_sha256
    assert (used == hashlib.sha256((tmp_path / "cwd" / "data.csv").read_bytes()).hexdigest()).all()  # the cwd's file
    (tmp_path / "cwd" / "data.csv").unlink()  # only beside the config now: not found from the command line
    assert main([*argv, "--out", str(tmp_path / "out3")]) == 2 and "--data" in capsys.readouterr().err


def test_a_column_with_an_empty_header_name_can_still_be_chosen(tmp_path):
    """The check against repeated names (pandas renames a second x to x.1) refused pandas' name for a
    column whose header is empty ('Unnamed: 0'), so that column could not be used at all (a review)."""
    from icl_bench.prompts.data import DataSource, check_source

    path = tmp_path / "d.csv"
    path.write_text(",y\n" + "".join(f"{i},{2 * i + 1}\n" for i in range(8)))
    assert check_source(DataSource(path=str(path), x="Unnamed: 0", y="y"), [4]).x == "Unnamed: 0"


def test_the_dropped_rows_note_names_data_rows_from_one_and_n_needs_n_plus_one_finite_rows(tmp_path):
    """The note of rows left out named them 0-based, and N equal to the number of finite rows
    passed the up-front check, so every cell failed later (found by a mutation review)."""
    (tmp_path / "d.csv").write_text("x,y\n" + "".join(f"{i},{'' if i == 3 else 2 * i}\n" for i in range(8)))
    src = DataSource(path=str(tmp_path / "d.csv"), x="x", y="y")
    rows, dropped, note = data_summary(src)
    assert (rows, dropped) == (8, 1) and note.endswith("(data rows 4)"), note  # the 4th data row: i = 3
    check_source(src, [6])
    with pytest.raises(ConfigError, match=r"N=7 needs at least 8 rows with finite x and y; d.csv has 7"):
        check_source(src, [7])
