"""Isolation: a misbehaving solver gives status="error" rows with the reason; every other cell
completes with exactly the numbers it has in a run without the misbehaving solver."""
from __future__ import annotations

import math
import sys

import numpy as np
import pandas as pd
import pytest
import torch

import icl_bench.solvers.registry as registry
from icl_bench import Solver, register_solver
from icl_bench.bench.config import parse_config
from icl_bench.bench.runner import run_matrix
from icl_bench.bench.schema import TIMING_COLUMNS


def _solver(method: str, body):
    """A Solver subclass whose `method` is `body` (predict defaults to the context mean of y)."""
    attrs = {"params": {}, "predict": lambda self, b: b.y.mean(dim=1), method: body}
    return type(f"Bad_{method}", (Solver,), attrs)


def _mutate(self, b):
    b.y.mul_(2.0)  # in place: the shared prompts of this grid point
    return b.y.mean(dim=1)


def _raise_in_init(self, **values):
    raise RuntimeError("cannot build")


def _raise(exc: BaseException):
    """A method body that raises `exc` (a lambda cannot raise)."""
    def body(self, *args, **kwargs):
        raise exc
    return body


# name -> (class, text the error message must contain)
BAD = {
    "bad-raises": (_solver("predict", lambda s, b: 1 / 0), "ZeroDivisionError: division by zero"),
    "bad-shape-2d": (_solver("predict", lambda s, b: b.y[:, :1]), ", 1), expected a tensor of shape ("),
    "bad-shape-scalar": (_solver("predict", lambda s, b: b.y.sum()), "predict returned (), expected"),
    "bad-dtype": (_solver("predict", lambda s, b: b.y.mean(dim=1).to(
        torch.float64 if b.dtype == torch.float32 else torch.float32)), "predict returned dtype torch.float"),
    "bad-int": (_solver("predict", lambda s, b: torch.zeros(b.B, dtype=torch.int64)), "dtype torch.int64"),
    "bad-numpy": (_solver("predict", lambda s, b: np.zeros(b.B)), "predict returned ndarray"),
    "bad-list": (_solver("predict", lambda s, b: [0.0] * b.B), "predict returned list"),
    "bad-exit": (_solver("predict", lambda s, b: sys.exit(3)), "SystemExit: 3"),
    "bad-mutates": (_solver("predict", _mutate), "predict modified the prompt batch in place (y)"),
    "bad-check": (_solver("check_batch", lambda s, b: {}["missing"]), "KeyError: 'missing'"),
    "bad-init": (_solver("__init__", _raise_in_init), "RuntimeError: cannot build"),
    # BaseExceptions that are neither SystemExit nor KeyboardInterrupt crashed the run (a traceback, no table)
    "bad-genexit": (_solver("predict", _raise(GeneratorExit("x"))), "GeneratorExit: x"),
    "bad-init-genexit": (_solver("__init__", _raise(GeneratorExit("no build"))), "GeneratorExit: no build"),
    # input_files() names what the cell key hashes: one that fails had left the key without its files
    # (an "ok" row that --resume and --cache served after the file changed: a review)
    "bad-files-raise": (_solver("input_files", lambda s: {}["file"]),
                        "InputFilesError: input_files() raised KeyError: 'file' (test_isolation.py:"),
    "bad-files-str": (_solver("input_files", lambda s: "coef.json"),
                      "InputFilesError: input_files() returned str; expected a list of paths"),
    "bad-files-int": (_solver("input_files", lambda s: [3]), "InputFilesError: input_files() gave a int (3); expected"),
}
RAW = {"seed": 0, "n_prompts": 24, "batch_size": 10, "timing": {"repeats": 1},
       "grid": {"N": [3, 8], "noise": [0.1], "R": [10.0], "dtype": ["float32", "float64"]}}


@pytest.fixture(scope="module")
def tables():
    """(table with every bad solver around ols, table of ols alone)."""
    for name, (cls, _) in BAD.items():
        register_solver(name)(cls)
    try:
        # the bad ones run before AND after ols at every grid point (all share its prompts)
        half = list(BAD)[: len(BAD) // 2]
        order = {**{n: {} for n in half}, "ols": {}, **{n: {} for n in BAD if n not in half}}
        mixed = run_matrix(parse_config({**RAW, "solvers": order}), progress=False)
        alone = run_matrix(parse_config({**RAW, "solvers": {"ols": {}}}), progress=False)
    finally:
        for name in BAD:
            registry.REGISTRY.unregister(name)
    assert not set(BAD) & set(registry.known_names())  # the registry is clean again
    return mixed, alone


@pytest.mark.parametrize("name", list(BAD))
def test_misbehaving_solver_gives_error_rows_with_the_reason(tables, name):
    mixed, _ = tables
    rows = mixed[mixed.solver == name]
    assert len(rows) == 4 and (rows.status == "error").all()
    for message in rows.message:
        assert BAD[name][1] in message, message
        assert "\n" not in message
    assert rows.mse_vs_ols.isna().all()


def test_every_other_cell_completes_untouched(tables):
    mixed, alone = tables
    ols = mixed[mixed.solver == "ols"].drop(columns=list(TIMING_COLUMNS)).reset_index(drop=True)
    assert (ols.status == "ok").all()
    pd.testing.assert_frame_equal(ols, alone.drop(columns=list(TIMING_COLUMNS)).reset_index(drop=True))
    assert (ols[ols.dtype == "float64"].mse_vs_ols < 1e-25).all()  # saw pristine prompts after the mutator
    assert len(mixed) == 4 * (len(BAD) + 1)


def test_no_error_rows_for_a_solver_that_only_answers_nan(tables):
    """NaN is an answer ("cannot"), not an error: counted, not failed."""
    register_solver("all-nan")(_solver("predict", lambda s, b: torch.full_like(b.x_query, float("nan"))))
    try:
        table = run_matrix(parse_config({**RAW, "solvers": {"all-nan": {}}}), progress=False)
    finally:
        registry.REGISTRY.unregister("all-nan")
    assert (table.status == "ok").all() and (table.n_nonfinite == 24).all() and table.mse_vs_ols.isna().all()


def test_ctrl_c_inside_a_solver_still_stops_the_run():
    """KeyboardInterrupt is not a solver failure: it ends the run (the CLI prints the resume line)."""
    register_solver("ctrl-c")(_solver("predict", _raise(KeyboardInterrupt())))
    try:
        with pytest.raises(KeyboardInterrupt):
            run_matrix(parse_config({**RAW, "solvers": {"ctrl-c": {}, "ols": {}}}), progress=False)
    finally:
        registry.REGISTRY.unregister("ctrl-c")


def test_a_huge_or_multiline_solver_message_is_cut_to_one_short_line():
    """A 10^6-character exception (or skip reason) is stored and printed as its first 500 characters
    and its length; a reason with line breaks or NUL stays one printable line."""
    from icl_bench import SkipCell
    from icl_bench.errors import MAX_MESSAGE, cell_message

    register_solver("huge-error")(_solver("predict", _raise(ValueError("x" * 10**6))))
    register_solver("huge-skip")(_solver("check_batch", _raise(SkipCell("y" * 10**6))))
    register_solver("odd-skip")(_solver("check_batch", _raise(SkipCell("first\nsecond\x00third"))))
    try:
        table = run_matrix(parse_config({**RAW, "solvers": {"huge-error": {}, "huge-skip": {}, "odd-skip": {}}}),
                           progress=False)
    finally:
        for name in ("huge-error", "huge-skip", "odd-skip"):
            registry.REGISTRY.unregister(name)
    err = table[table.solver == "huge-error"].message
    assert (err.str.len() < MAX_MESSAGE + 80).all()
    assert err.str.match(r"ValueError: x{500}… \(1000000 characters\) \(test_isolation\.py:\d+\)$").all(), err.iloc[0][-80:]
    assert (table[table.solver == "huge-skip"].message == "y" * 500 + "… (1000000 characters)").all()
    assert (table[table.solver == "odd-skip"].message == "first second\\x00third").all()
    assert cell_message("short") == "short" and cell_message("z" * MAX_MESSAGE) == "z" * MAX_MESSAGE
    # cut once escaped: 10^6 NULs were cut to 500, then escaped to 2000 characters
    assert cell_message("\x00" * 10**6) == "\\x00" * 125 + "… (1000000 characters)"
    assert cell_message("a" * 499 + "\x00" * 10) == "a" * 499 + "… (509 characters)"  # no escape split in half


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no str")


def test_an_exception_whose_str_raises_is_an_error_row():
    """str(exc) of a plugin's exception raised inside the runner's handler: a traceback, no table,
    every other cell lost (found by an adversarial tester)."""
    register_solver("bad-str")(_solver("predict", _raise(_Unprintable())))
    try:
        table = run_matrix(parse_config({**RAW, "solvers": {"bad-str": {}, "ols": {}}}), progress=False)
    finally:
        registry.REGISTRY.unregister("bad-str")
    bad = table[table.solver == "bad-str"]
    assert (bad.status == "error").all() and bad.message.str.startswith("_Unprintable: <_Unprintable whose str() failed>").all()
    assert (table[table.solver == "ols"].status == "ok").all()


def test_a_finite_answer_on_an_ill_posed_prompt_is_named(tmp_path, capsys):
    """README's contract: NaN on ill-posed prompts, never a made-up number. A plugin answering 0
    there ran "ok" with no word (a review); now its rows say so and `run` warns, while a solver
    that keeps the contract (nan_if_ill_posed) gets no message."""
    from icl_bench.bench.contract import ILL_ANSWERED
    from icl_bench.cli import main
    from icl_bench.solvers.base import nan_if_ill_posed

    rng = np.random.default_rng(0)
    x = rng.integers(0, 2, 400).astype(float)  # x in {0, 1}: at N = 3 about a quarter of the prompts have equal x
    (tmp_path / "bin.csv").write_text("x,y\n" + "".join(f"{a},{2 * a + 1 + 0.1 * e}\n" for a, e in zip(x, rng.normal(size=400))))
    (tmp_path / "c.toml").write_text('n_prompts = 64\n[grid]\nN = [3]\nR = [100.0]\ndtype = ["float64"]\ndevice = ["cpu"]\n'
                                     '[solvers.zero-ill]\n[solvers.zero-kept]\n')
    register_solver("zero-ill")(_solver("predict", lambda s, b: torch.zeros_like(b.x_query)))
    register_solver("zero-kept")(_solver("predict", lambda s, b: nan_if_ill_posed(torch.zeros_like(b.x_query), b)))
    try:
        code = main(["run", "--config", str(tmp_path / "c.toml"), "--data", str(tmp_path / "bin.csv"), "--x", "x", "--y", "y",
                     "--out", str(tmp_path / "o"), "--no-progress"])
    finally:
        registry.REGISTRY.unregister("zero-ill")
        registry.REGISTRY.unregister("zero-kept")
    err = capsys.readouterr().err
    table = pd.read_parquet(tmp_path / "o" / "results.parquet").set_index("solver")
    assert code == 0 and (table.status == "ok").all()
    n_ill = int(table.loc["zero-ill", "n_ill_posed"])
    assert n_ill > 0 and table.loc["zero-kept", "message"] == ""
    assert table.loc["zero-ill", "message"] == (f"{ILL_ANSWERED}: {n_ill} of {n_ill} answered where every solver "
                                                "answers NaN (docs/accuracy.md)")
    assert f"icl-bench: WARNING: zero-ill: {ILL_ANSWERED} in 1 cells" in err and "zero-kept" not in err, err
    assert main(["publish", str(tmp_path / "o"), "--out", str(tmp_path / "pub")]) == 0
    headline = (tmp_path / "pub" / "headline.md").read_text()
    assert (f"Warning: zero-ill: {ILL_ANSWERED} in 1 of 1 cells (every solver answers NaN there; those answers are "
            "not scored).") in headline and "Warning: zero-kept" not in headline, headline


def _weights_run(weights):
    register_solver("odd-weights")(type("OddWeights", (Solver,), {
        "__doc__": "OLS with odd weights.", "params": {},
        "predict": lambda s, b: b.ols_prediction.to(b.dtype), "weights": lambda s: weights}))
    try:
        return run_matrix(parse_config({**RAW, "solvers": {"odd-weights": {}}}), progress=False)
    finally:
        registry.REGISTRY.unregister("odd-weights")


@pytest.mark.parametrize("weights, expected", [
    ([1.0, 0.0], "weights(): TypeError: weights() returned list; expected a dict of name -> torch.Tensor, or None"),
    (torch.ones(3), "weights(): TypeError: weights() returned Tensor; expected a dict of name -> torch.Tensor, or None"),
    ({"w": [1.0]}, "weights(): TypeError: weights()['w'] is a list; expected a real numeric torch.Tensor"),
    ({"w": torch.tensor([True])}, "weights(): TypeError: weights()['w'] is a torch.bool tensor; expected a real"),
    ({"w": "not a tensor"}, "weights(): TypeError: weights()['w'] is a str"),
])
def test_a_bad_weights_return_is_named_and_keeps_the_answers_metrics(weights, expected, capsys):
    """weights() returning a list or a bare tensor failed inside torch ("'list' object has no
    attribute 'detach'", "Boolean value of Tensor ... is ambiguous") and the row was an error,
    its MSE lost; now the weight columns are NaN and the message says what the contract expects."""
    table = _weights_run(weights)
    assert (table.status == "ok").all() and table.mse_vs_ols.notna().all()
    assert table.weight_sparsity.isna().all() and table.weight_l1.isna().all()
    assert table.message.str.startswith(expected).all(), table.message.iloc[0]
    from icl_bench.report.run_summary import cell_warnings

    cell_warnings(table)  # what `run` prints after its summary
    assert f"WARNING: odd-weights: weight_sparsity and weight_l1 are NaN in 4 cells: {expected}" in capsys.readouterr().err
    from icl_bench.report.aggregate import no_answer_notes

    assert [n for n in no_answer_notes(table) if n.startswith("odd-weights: its weights() gave no weight sparsity in 4 of 4 "
                                                                 f"cells, where it is NaN ({expected}")]


@pytest.mark.parametrize("weights, sparsity, l1", [
    (torch.nn.ParameterDict({"a": torch.nn.Parameter(torch.tensor([1.0, 0.0, 2.0]))}), 1 / 3, 3.0),
    ({"q": torch.tensor([1, 0, 3], dtype=torch.int8)}, 1 / 3, 4.0),  # quantised weights
    ({"z": torch.zeros(4)}, 1.0, 0.0),  # every entry zero: all of them count as zero
])
def test_mappings_and_integer_weights_are_weights(weights, sparsity, l1):
    """An nn.ParameterDict or int8 weights gave a sparsity before weights() was checked; a first
    version of the check refused them and lost the cells (a review)."""
    table = _weights_run(weights)
    assert (table.status == "ok").all() and (table.message == "").all(), table.message.iloc[0]
    assert table.weight_sparsity.tolist() == pytest.approx([sparsity] * len(table)) and (table.weight_l1 == l1).all()


def test_nan_weights_are_named_where_their_sparsity_is_nan(capsys):
    """NaN weights gave NaN weight columns with an empty message and no WARNING (a review)."""
    expected = "weights(): 1 of 4 entries are NaN / inf (no sparsity is defined)"
    table = _weights_run({"w": torch.tensor([[float("nan"), 1.0], [0.0, 2.0]])})
    assert (table.status == "ok").all() and table.mse_vs_ols.notna().all()
    assert table.weight_sparsity.isna().all() and table.weight_l1.isna().all()
    assert (table.message == expected).all(), table.message.iloc[0]
    from icl_bench.report.run_summary import cell_warnings

    cell_warnings(table)
    assert f"WARNING: odd-weights: weight_sparsity and weight_l1 are NaN in 4 cells: {expected}" in capsys.readouterr().err


def test_non_finite_weights_have_no_sparsity():
    """A NaN weight made every comparison False: weight_sparsity read 0.0 (a review)."""
    from icl_bench.solvers.sparsity import weight_sparsity

    assert math.isnan(weight_sparsity({"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([float("nan"), 1.0])}))
    assert math.isnan(weight_sparsity({"a": torch.tensor([float("inf"), 0.0])}))
    assert weight_sparsity({"a": torch.tensor([1.0, 0.0])}) == 0.5


def test_run_warning_and_error_lines_name_d_and_ood_when_they_tell_cells_apart(capsys):
    """The lines said "N=80 R=100.0 float64" of a d = 64 cell, leaving out the one axis that told
    it from the d = 1 cells (found by a review)."""
    import pandas as pd

    from icl_bench.bench.contract import NO_ANSWER
    from icl_bench.report.run_summary import cell_warnings

    row = dict(solver="ols", solver_params="", N=30, R=100.0, dtype="float32", device="cpu", d=1, ood="none", prompts="")
    cell_warnings(pd.DataFrame([{**row, "d": 3, "status": "error", "message": "RuntimeError: x"},
                                {**row, "ood": "x-shift", "status": "ok", "message": f"{NO_ANSWER}: NaN"},
                                {**row, "status": "error", "message": "RuntimeError: y"}]))
    err = capsys.readouterr().err
    assert "(e.g. N=30 ood=x-shift R=100.0 float32: " in err and "error: ols  N=30 d=3 R=100.0 float32 cpu: RuntimeError: x" in err
    assert "error: ols  N=30 R=100.0 float32 cpu: RuntimeError: y" in err
