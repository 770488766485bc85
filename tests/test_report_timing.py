"""Throughput timed while other cells ran on the same machine (concurrency > 1: a Dask run, or a
run beside another one) is labelled in the published report: a note with the count and where, and
the throughput plot's caption (docs/design.md §10, docs/scale-out.md "Honest timing")."""
import numpy as np
import pandas as pd
import pytest

from icl_bench.bench.config import parse_config
from icl_bench.bench.runner import run_matrix
from icl_bench.report import aggregate as report
from icl_bench.report import plots
from icl_bench.report.load import shared_timing, shared_timing_notes

RAW = {"seed": 0, "n_prompts": 32, "batch_size": 32, "timing": {"repeats": 1},
       "grid": {"N": [4, 8], "noise": [0.1], "R": [10.0], "dtype": ["float64"]},
       "solvers": {"ols": {}, "gd": {}}}


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "r"
    run_matrix(parse_config(RAW), out, progress=False)
    return report.load_runs([out])[0].assign(concurrency=1.0)  # (other tests' cells may run beside these)


def _caption(fig) -> str:
    return " ".join(" ".join(t.get_text().split()) for t in fig.texts)  # (wrapped lines joined)


def test_throughput_timed_beside_other_cells_is_labelled(table):
    shared = table.assign(concurrency=np.where(table.solver == "ols", 2.0, 1.0))
    (note,) = shared_timing_notes(shared)
    assert note.startswith("throughput: 2 of 4 ok rows were timed while other icl-bench cells ran on the same machine")
    assert "concurrency == 1" in note and str(table.run.iloc[0]) in note
    assert shared_timing_notes(table) == [] and shared_timing_notes(table.drop(columns="concurrency")) == []
    assert "2 of 4 cells timed while other cells ran" in _caption(plots.throughput(shared))
    assert "timed while" not in _caption(plots.throughput(table))
    pd_mixed, pd_alone = report.aggregate(shared), report.aggregate(table)  # the numbers stay: only labelled
    assert (pd_mixed.prompts_per_s == pd_alone.prompts_per_s).all()


def test_only_ok_rows_count_as_timed_beside_other_cells():
    # guards shared_timing's status test: an error or a skip has no throughput to understate
    rows = pd.DataFrame({"status": ["ok", "error", "skipped", "ok"], "concurrency": [2.0, 2.0, 3.0, 1.0]})
    assert shared_timing(rows).tolist() == [True, False, False, False]
