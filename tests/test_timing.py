"""The timing policy (icl_bench.bench.timing) and the runner's use of it, on a fake clock: deterministic,
no real timing is asserted here (throughput itself is measured in benchmarks/)."""
import gc

import pytest
import torch

import icl_bench.bench.timing as timing
from icl_bench import PromptSpec, Solver, sample_prompts
from icl_bench.bench.cells import Cell
from icl_bench.bench.runner import _timed_predictions


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(timing, "_clock", c)
    return c


def make_pass(clock, seconds):
    calls = []

    def run():
        calls.append(len(calls))
        clock.now += seconds
        return len(calls)

    return run, calls


def test_slow_passes_are_single_samples_and_the_median_is_reported(clock):
    durations = iter([0.30, 0.10, 0.20, 0.50])
    calls = []

    def run():
        calls.append(1)
        clock.now += next(durations)
        return len(calls)

    last, median, n, inner = timing.time_passes(run, "cpu", repeats=3, max_seconds=10.0)
    assert (n, inner, last) == (3, 1, 3) and median == pytest.approx(0.20)  # samples 0.30, 0.10, 0.20


def test_fast_passes_are_grouped(clock):
    run, calls = make_pass(clock, 1e-4)
    last, median, n, inner = timing.time_passes(run, "cpu", repeats=3, max_seconds=10.0, min_sample_s=0.005)
    assert inner == 50 and n == 3 and len(calls) == 1 + 3 * 50 and last == len(calls)
    assert median == pytest.approx(1e-4)


def test_max_seconds_stops_early_but_keeps_one_sample(clock):
    run, calls = make_pass(clock, 0.4)
    _, median, n, _ = timing.time_passes(run, "cpu", repeats=10, max_seconds=1.0)
    assert n == 3 and median == pytest.approx(0.4)  # 0.4, 0.8, 1.2 >= 1.0: stop
    run, calls = make_pass(clock, 5.0)
    _, median, n, _ = timing.time_passes(run, "cpu", repeats=10, max_seconds=1.0)
    assert n == 1 and len(calls) == 1 and median == pytest.approx(5.0)


def test_gc_paused_while_timing_and_restored_after_an_error(clock):
    seen = []

    def run():
        seen.append(gc.isenabled())
        clock.now += 0.1
        raise RuntimeError("boom")

    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        timing.time_passes(run, "cpu")
    assert seen == [False] and gc.isenabled()


class Counting(Solver):
    """Counts predict calls and advances the fake clock by 1 ms per prompt."""

    params = {}
    clock = None
    sizes: list

    def predict(self, batch):
        self.sizes.append(batch.B)
        self.clock.now += 1e-3 * batch.B
        return batch.y.mean(dim=1)


def test_runner_warms_up_outside_the_timer_and_reports_seconds_per_pass(clock):
    batch = sample_prompts(PromptSpec(N=5), 50, seed=0)
    solver = Counting()
    solver.clock, solver.sizes = clock, []
    cell = Cell("counting", "{}", 5, 0.0, 100.0, "float32", "cpu", 0, 50, 20, "{}", repeats=3, max_seconds=10.0)
    with torch.no_grad():
        pred, seconds = _timed_predictions(solver, batch, cell)
    assert pred.shape == (50,)
    assert solver.sizes[:2] == [20, 10]  # warm-up: first chunk, then the odd-sized last chunk
    assert solver.sizes[2:] == [20, 20, 10] * 3  # three timed passes of three chunks each
    assert seconds == pytest.approx(50 * 1e-3)  # warm-up excluded: one pass = 50 prompts x 1 ms
    solver.sizes = []  # the timed section's count (hostload.timing_slot's START) starts after the warm-up
    _timed_predictions(solver, batch, cell, started=lambda: solver.sizes.append("start"))
    assert solver.sizes[:3] == [20, 10, "start"] and solver.sizes.count("start") == 1


def test_run_matrix_uses_timing_threads_and_restores_them(tiny_raw, monkeypatch):
    from icl_bench.bench.config import parse_config
    from icl_bench.bench.runner import run_matrix
    import icl_bench.bench.runner as runner

    seen = []
    real = runner.run_cell
    monkeypatch.setattr(runner, "run_cell", lambda cell, **kw: (seen.append(torch.get_num_threads()), real(cell, **kw))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # not the session's 1 (tests/conftest.py): a run that sets nothing would pass
    try:
        tiny_raw["timing"]["threads"] = 1
        run_matrix(parse_config(tiny_raw), progress=False)
        assert set(seen) == {1} and torch.get_num_threads() == 2
        tiny_raw["timing"]["threads"] = 0  # 0 leaves torch's own setting alone
        seen.clear()
        run_matrix(parse_config(tiny_raw), progress=False)
        assert set(seen) == {2}
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_timing_threads_must_be_a_non_negative_integer(tiny_raw, bad):
    from icl_bench.bench.config import parse_config
    from icl_bench.errors import ConfigError

    tiny_raw["timing"]["threads"] = bad
    with pytest.raises(ConfigError, match="timing.threads"):
        parse_config(tiny_raw)
