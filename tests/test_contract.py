"""The solver contract the runner checks in every cell (icl_bench/bench/contract.py): torch's
process-wide defaults put back after a solver's own code, input_files() that must name what the
cell key hashes, weights() the weight columns cannot use. Misbehaving solvers: tests/test_isolation.py."""
from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

import icl_bench.solvers.registry as registry
from icl_bench import Solver, register_solver
from icl_bench.bench.config import parse_config
from icl_bench.bench.runner import run_matrix
from icl_bench.bench.schema import TIMING_COLUMNS
from icl_bench.report.run_summary import cell_warnings

RAW = {"seed": 0, "n_prompts": 24, "batch_size": 10, "timing": {"repeats": 1},
       "grid": {"N": [3, 8], "noise": [0.1], "R": [10.0], "dtype": ["float32"]}}


def _answer(self, b):
    return b.ols_prediction.to(b.dtype)


def _sloppy(self, b):  # allocates with torch's defaults: right only while they are float32 on the CPU
    return torch.empty(b.B).copy_(b.y.mean(dim=1))


def _changer(where: str, change):
    """A solver answering OLS that calls `change()` in its `where` method."""
    def init(self, **values):
        Solver.__init__(self, **values)
        change()

    def hook(result):
        return lambda self, *a: (change(), result(self, *a))[1]

    methods = {"__init__": init, "predict": hook(_answer), "input_files": hook(lambda self: []),
               "check_batch": hook(lambda self, b: None), "weights": hook(lambda self: None)}
    return type("Changer", (Solver,), {"params": {}, "predict": _answer, where: methods[where]})


def _run(solvers: dict, raw=RAW) -> pd.DataFrame:
    for name, cls in solvers.items():
        register_solver(name)(cls)
    try:
        return run_matrix(parse_config({**raw, "solvers": {n: {} for n in solvers}}), progress=False)
    finally:
        for name in solvers:
            registry.REGISTRY.unregister(name)


def _device_context():
    return getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)


def _float64():
    torch.set_default_dtype(torch.float64)


def _meta():
    torch.set_default_device("meta")


@pytest.mark.parametrize("where", ["__init__", "input_files", "check_batch", "predict", "weights"])
@pytest.mark.parametrize("change, note", [
    (_float64, "the solver changed torch's default dtype to torch.float64 (put back to torch.float32 after its call)"),
    (_meta, "the solver changed torch's default device to meta (put back to cpu after its call)"),
])
def test_a_solver_that_changes_torchs_defaults_changes_no_other_cell(where, change, note, capsys):
    """One plugin's torch.set_default_dtype(torch.float64) made a later plugin's cells errors, in
    that matrix only, and a default device of meta broke the runner's own metrics (a review); one
    set in __init__ or input_files() also leaked through the cell keys, built before any cell (a
    second review). The runner puts the defaults back after each stretch of solver code and says so."""
    table = _run({"a-changer": _changer(where, change), "sloppy": type("Sloppy", (Solver,), {"params": {}, "predict": _sloppy})})
    alone = _run({"sloppy": type("Sloppy", (Solver,), {"params": {}, "predict": _sloppy})})
    assert torch.get_default_dtype() == torch.float32 and torch.empty(1).device.type == "cpu"
    assert (table.status == "ok").all(), table.message.tolist()
    sloppy = table[table.solver == "sloppy"].drop(columns=list(TIMING_COLUMNS)).reset_index(drop=True)
    pd.testing.assert_frame_equal(sloppy, alone.drop(columns=list(TIMING_COLUMNS)).reset_index(drop=True))
    changed = table[table.solver == "a-changer"].message
    assert (changed == note).all(), changed.tolist()
    cell_warnings(table)
    err = capsys.readouterr().err
    assert "WARNING: a-changer: changed torch's default dtype or device in 2 cells" in err and "sloppy" not in err


def test_a_default_device_this_machine_cannot_use_or_set_to_the_same_device_is_put_back():
    """set_default_device("cuda") without CUDA made torch.get_default_device raise in every later
    cell, built-ins included; set_default_device("cpu") left a device context that slowed every
    later torch call, unseen (the resolved device is the same): a review."""
    table = _run({"a-cuda": _changer("predict", lambda: torch.set_default_device("cuda")),
                  "b-cpu": _changer("predict", lambda: torch.set_default_device("cpu")),
                  "c-sloppy": type("Sloppy", (Solver,), {"params": {}, "predict": _sloppy})})
    assert (table.status == "ok").all(), table.message.tolist()
    assert _device_context() is None and torch.empty(1).device.type == "cpu"
    assert table[table.solver == "a-cuda"].message.str.startswith("the solver changed torch's default device to ").all()
    assert (table[table.solver == "b-cpu"].message
            == "the solver changed torch's default device to cpu (put back to cpu after its call)").all()
    assert (table[table.solver == "c-sloppy"].message == "").all()


@pytest.mark.parametrize("files, expected", [
    ({"model": "coef.json"}, "InputFilesError: input_files() returned dict; expected a list of paths"),
    ([b"coef.json"], "InputFilesError: input_files() gave a bytes (b'coef.json'); expected paths"),
    (".", "InputFilesError: input_files() returned str; expected a list of paths"),
    (["."], "InputFilesError: input_files() gave a folder ('.'); name the files in it that the solver reads"),
])
def test_input_files_that_are_no_list_of_files_make_the_cell_an_error(files, expected):
    """A dict's keys were hashed as the paths and a folder as "unreadable": the cells were ok, and
    --resume served them after the files changed (a review)."""
    table = _run({"odd-files": type("OddFiles", (Solver,), {"params": {}, "predict": _answer,
                                                             "input_files": lambda self: files})})
    assert (table.status == "error").all() and table.message.str.startswith(expected).all(), table.message.tolist()


def test_an_exception_without_text_from_input_files_reads_cleanly():
    def body(self):
        raise GeneratorExit

    table = _run({"odd-files": type("OddFiles", (Solver,), {"params": {}, "predict": _answer, "input_files": body})})
    assert table.message.str.fullmatch(r"InputFilesError: input_files\(\) raised GeneratorExit \(test_contract\.py:\d+\)").all()


def test_input_files_that_differ_between_the_key_and_the_run_make_the_cell_an_error(tmp_path):
    """An input_files() that failed while the keys were made (its key names no file) and then
    worked gave an "ok" row under a key without its files: --resume served it after the file
    changed (a review)."""
    coef = tmp_path / "coef.json"
    coef.write_text(json.dumps({"a": 1.0}))
    calls = []

    def files(self):
        calls.append(1)
        if len(calls) == 1:  # the first call: while the cell keys are made
            raise OSError("not mounted yet")
        return [coef]

    table = _run({"flaky-files": type("Flaky", (Solver,), {"params": {}, "predict": _answer, "input_files": files})})
    assert (table.status == "error").all()
    assert table.message.str.startswith("InputFilesError: input_files() named other files or bytes when the cell ran "
                                        "than when it was keyed (sha256 (none) then, ").all(), table.message.tolist()


@pytest.mark.parametrize("weights, expected", [
    ({"w": torch.tensor([[0.0, 1.0], [2.0, 0.0]]).to_sparse()}, "weights(): "),
    ({"w": torch.zeros(3, device="meta")}, "weights(): "),
])
def test_weights_the_columns_cannot_use_cost_the_columns_not_the_cell(weights, expected):
    """Sparse or meta weights turned the whole cell into an error, its MSE lost, once the NaN check
    ran outside weight_columns' guard (a review)."""
    table = _run({"odd-weights": type("OddWeights", (Solver,), {"params": {}, "predict": _answer,
                                                                 "weights": lambda self: weights})})
    assert (table.status == "ok").all() and table.mse_vs_ols.notna().all(), table.message.tolist()
    assert table.weight_sparsity.isna().all() and table.message.str.startswith(expected).all()


def test_a_solver_that_writes_a_file_it_lists_gets_an_error_that_says_so(tmp_path):
    """A cache the solver updates in predict, listed in input_files(), changes between a cell's key
    and its run: the second cell fails in every run; the message names the files and says not to
    list a file the solver writes (it said only "run again": a review)."""
    cache = tmp_path / "cache.json"
    cache.write_text("0")

    def predict(self, b):
        cache.write_text(str(int(cache.read_text()) + 1))
        return _answer(self, b)

    table = _run({"writes": type("Writes", (Solver,), {"params": {}, "predict": predict,
                                                       "input_files": lambda self: [cache]})})
    assert table.status.tolist() == ["ok", "error"], table.message.tolist()
    assert table.message.iloc[1].endswith("files: cache.json): one changed during the run. List only files the "
                                          "solver reads, never one it writes (a cache), and run again")


def test_a_parameter_called_name_reaches_the_solver():
    """get_solver(name, **params) took a Param called name for its own argument: every cell errored
    with "got multiple values for argument 'name'" (a review)."""
    from icl_bench import Param

    table = _run({"named": type("Named", (Solver,), {"params": {"name": Param("x", "a label")}, "predict": _answer})})
    assert (table.status == "ok").all(), table.message.tolist()


def test_a_key_made_without_the_solver_is_not_checked_against_its_files(tmp_path):
    """A solver registered on the Dask workers only is keyed by a driver that cannot load it: the
    key names no code of its module and no files, so its files are not compared at run time (they
    would always differ)."""
    import dataclasses

    from icl_bench.bench.cells import Cell, _no_solver_digest
    from icl_bench.bench.runner import run_cell

    data = tmp_path / "coef.json"
    data.write_text("1")
    register_solver("worker-only")(type("WorkerOnly", (Solver,), {"params": {}, "predict": _answer,
                                                                  "input_files": lambda self: [data]}))
    try:
        cell = Cell("worker-only", "{}", 10, 0.1, 10.0, "float32", "cpu", 0, 16, 16, "{}", 1, 1.0)
        unloaded = run_cell(dataclasses.replace(cell, code_sha256=_no_solver_digest()))
        loaded = run_cell(cell)  # a key that names no file where the solver reads one: an error
    finally:
        registry.REGISTRY.unregister("worker-only")
    assert (unloaded["status"], unloaded["message"]) == ("ok", "")
    assert loaded["status"] == "error" and "named other files or bytes" in loaded["message"]


def test_no_answer_on_any_well_posed_prompt_is_named_though_an_ill_posed_one_got_a_number():
    """A solver that answers NaN on every well-posed prompt is a "no finite prediction" cell even
    when it made up a finite answer on an ill-posed one; both are named. The check had only been
    tried with a solver that answers NaN everywhere (a mutation review)."""
    from types import SimpleNamespace

    from icl_bench.bench.contract import ILL_ANSWERED, NO_ANSWER, no_answer_message

    nan = float("nan")
    batch = SimpleNamespace(ols_prediction=torch.tensor([1.0, 2.0, nan], dtype=torch.float64))  # 2 well-posed
    message = no_answer_message(torch.tensor([nan, nan, 5.0]), batch)
    assert message.startswith(f"{NO_ANSWER}: NaN/inf on all 2 well-posed prompts") and ILL_ANSWERED in message
    assert no_answer_message(torch.tensor([nan, 3.0, nan]), batch) == ""  # one well-posed answer: it answers
