"""The throughput suite's own tools (benchmarks/): batch sizing, the summary's goals, provenance.

No timing is measured here: the clocks are replaced, and the summaries read made-up runs."""
from __future__ import annotations

import json
import subprocess

import pytest

from benchmarks import throughput_cases
from benchmarks.experiments import summarize
from icl_bench.provenance import git_commit


@pytest.mark.parametrize("fixed_s, per_prompt_s, expected", [
    (2e-3, 10e-9, 167772),  # a GPU forward: launches and a sync dominate the probe; the whole batch fits
    (10e-3, 20e-9, 167772),
    (1e-3, 5e-6, 59800),  # a slow case: cut to the budget (0.3 s)
    (0.0, 1e-5, 30000),
])
def test_fit_batch_is_not_cut_by_a_calls_fixed_cost(monkeypatch, fixed_s, per_prompt_s, expected):
    """The estimate from 128 prompts counted a call's fixed cost as per-prompt cost: on a GPU the
    2^24-value batches were cut to a few thousand prompts, whose figures were mostly that cost."""
    monkeypatch.setattr(throughput_cases, "_seconds", lambda call, b, device: fixed_s + per_prompt_s * b)
    monkeypatch.setattr(throughput_cases, "sync", lambda device: None)
    B = throughput_cases.fit_batch(lambda b: None, 2**24 // 100, 0.3, "cpu")
    assert B == pytest.approx(expected, rel=0.01)
    assert fixed_s + per_prompt_s * B <= 0.3 + fixed_s


def _case(kind, name, N, dtype, device, seconds, batch=1000, **extra):
    return {"extra_info": {"kind": kind, "name": name, "N": N, "dtype": dtype, "device": device, "batch_size": batch,
                           **extra},
            "stats": {"median": seconds, "min": seconds * 0.9, "rounds": 5}}


def _summary(tmp_path, cases, commit="0123456789abcdef0123"):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"benchmarks": cases, "icl_bench": {"git_commit": commit}}))
    t, run = summarize.load(path)
    return summarize.report(summarize.with_ratios(t), run, "run.json")[0]


def test_a_cuda_run_is_judged_by_the_gpu_targets_not_the_cpu_goals(tmp_path):
    """A gpu_run.sh summary marked every goal but scaling "not measured", and no GPU target was
    checked anywhere (a review)."""
    cases = [_case("solver", "ols", 100, "float32", "cuda", 1000 / 2e8),  # 2e8 prompts/s
             _case("solver", "ln-closed-form", 100, "float32", "cuda", 1000 / 5e6, transformer=True),
             _case("solver", "gd", 100, "float32", "cuda", 1000 / 1e6, transformer=False),
             _case("reference", "torch-lstsq", 100, "float32", "cuda", 1000 / 1e7)]
    full = _summary(tmp_path, cases)
    assert "| gpu | ols prompts/s, N=100 float32 cuda | 2.00e+08 |" in full and ">= 1e+08 | met |" in full
    assert "| gpu | ln-closed-form prompts/s, N=100 float32 cuda | 5.00e+06 | 5.56e+06 | >= 1e+07 | **short** |" in full
    assert "gd prompts/s" not in full  # not a transformer solver
    assert "| ols/lstsq | ols / torch-lstsq, N=100 float32 cuda | 20 |" in full
    for cpu_goal in ("ln/numpy", "fused/eager", "threads", "ols/numpy"):
        assert f"| {cpu_goal} |" not in full


def test_a_two_thread_case_that_did_not_split_is_not_graded(tmp_path):
    """With a small batch the kernels take one thread; its ratio (~1) was graded "short"."""
    cases = [_case("solver", "ln-closed-form", 1000, "float32", "cpu", 1e-3),
             _case("threads", "ln-closed-form", 1000, "float32", "cpu", 1e-3, threads=2, threads_used=1),
             _case("solver", "ols", 1000, "float32", "cpu", 1e-4),
             _case("threads", "ols", 1000, "float32", "cpu", 0.6e-4, threads=2, threads_used=2)]
    full = _summary(tmp_path, cases)
    assert "| threads | ln-closed-form [2 threads] / 1 thread, N=1000 float32 | 1 | 1 | >= 1.8 | not split (1 thread used) |" in full
    assert "| threads | ols [2 threads] / 1 thread, N=1000 float32 | 1.67 | 1.67 | >= 1.8 | **short** |" in full
    _, recs = summarize.goals(summarize.with_ratios(summarize.load(tmp_path / "run.json")[0]))
    assert "0 of 1 met; **short**: ols [2 threads] / 1 thread, N=1000 float32 1.67 (1 case(s) not split" in summarize.compact(recs)


def test_the_summary_keeps_the_dirty_mark_and_refuses_an_empty_run(tmp_path):
    assert "git 0123456789ab (uncommitted changes)" in _summary(tmp_path, [_case("solver", "ols", 100, "float32", "cpu", 1e-3)],
                                                                 commit="0123456789abcdef-dirty")
    (tmp_path / "empty.json").write_text(json.dumps({"benchmarks": []}))
    with pytest.raises(SystemExit, match="no benchmark in this run"):
        summarize.load(tmp_path / "empty.json")


def test_git_commit_ignores_the_runs_own_output(tmp_path):
    """pytest-benchmark empties the committed --benchmark-json file as it starts: every documented
    run of the suite read "-dirty"."""
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "out.json").write_text("{}")
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("y = 1\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    (tmp_path / "out.json").write_text("")
    assert git_commit(tmp_path).endswith("-dirty")
    assert not git_commit(tmp_path, ignore=(tmp_path / "out.json",)).endswith("-dirty")
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_commit(tmp_path, ignore=(tmp_path / "out.json",)).endswith("-dirty")
    assert git_commit(tmp_path / "pkg", ignore=(tmp_path / "out.json",)).endswith("-dirty")  # the whole checkout
    assert git_commit(tmp_path, ignore=(tmp_path.parent / "elsewhere",)).endswith("-dirty")  # (git refuses a path
    (tmp_path / "code.py").write_text("x = 1\n")  # outside the checkout: it must not read as clean)
    assert not git_commit(tmp_path / "pkg", ignore=(tmp_path / "out.json", tmp_path.parent / "elsewhere")).endswith("-dirty")
    (tmp_path / ".venv" / "site").mkdir(parents=True)  # an installed package inside the user's own repository
    (tmp_path / ".venv" / "site" / "provenance.py").write_text("")
    assert git_commit(tmp_path / ".venv" / "site") == "unknown"  # was that repository's commit (a review)


def test_the_suites_own_json_is_left_out_of_its_dirty_check(tmp_path):
    """benchmarks/conftest.py passes the --benchmark-json file (an open file, as pytest-benchmark's
    option holds it, or a path) to git_commit's ignore; nothing when the option is unset."""
    from benchmarks.conftest import _own_output

    class Config:
        def __init__(self, value):
            self.value = value

        def getoption(self, name, default=None):
            assert name == "--benchmark-json"
            return self.value

    with open(tmp_path / "t.json", "wb") as handle:
        assert _own_output(Config(handle)) == (str(tmp_path / "t.json"),)
    assert _own_output(Config("results/raw/throughput.json")) == ("results/raw/throughput.json",)
    assert _own_output(Config(None)) == ()
