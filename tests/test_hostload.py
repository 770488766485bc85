"""hostload: counts the processes of this machine running a cell (a dead one never counts), and
exclusive timing keeps timed sections of separate processes from overlapping (with a control)."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import time

import pytest

from icl_bench.bench import hostload

fork = mp.get_context("fork")


@pytest.fixture(autouse=True)
def private_tmp(tmp_path, monkeypatch):
    """A temp dir of our own: other icl-bench processes on this machine stay out of the counts."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    hostload._state.clear()
    yield
    hostload._state.clear()


def _hold_busy(ready, release):
    with hostload.busy():
        ready.set()
        release.wait(30)


def test_count_busy_sees_other_processes_and_forgets_dead_ones():
    with hostload.busy():
        assert hostload.count_busy() == 1  # negative control: only this process
        ready, release = fork.Event(), fork.Event()
        child = fork.Process(target=_hold_busy, args=(ready, release))
        child.start()
        assert ready.wait(30)
        assert hostload.count_busy() == 2  # positive: the child is inside a cell
        os.kill(child.pid, signal.SIGKILL)  # dies without any clean-up
        child.join()
        assert hostload.count_busy() == 1  # the kernel dropped its lock
    assert not (hostload._folder() / f"{child.pid}.busy").exists()  # its marker was removed


def _timed_sections(exclusive, barrier, out):
    barrier.wait(30)
    for _ in range(4):
        with hostload.busy(), hostload.timing_slot(exclusive) as info:
            start = time.monotonic()
            time.sleep(0.03)
            end = time.monotonic()
        out.put((start, end, info["concurrency"]))


def _run_two(exclusive: bool) -> list[tuple[float, float, float]]:
    barrier, out = fork.Barrier(2), fork.Queue()
    procs = [fork.Process(target=_timed_sections, args=(exclusive, barrier, out)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=60) for _ in range(8)]
    for p in procs:
        p.join()
    return sorted(got)


def _overlaps(sections) -> int:
    return sum(1 for (s0, e0, _), (s1, e1, _) in zip(sections, sections[1:]) if s1 < e0)


def test_exclusive_timing_never_overlaps_and_the_control_does():
    shared = _run_two(exclusive=False)
    assert _overlaps(shared) > 0 and max(c for *_, c in shared) == 2  # control: both timed at once, and seen
    alone = _run_two(exclusive=True)
    assert _overlaps(alone) == 0
    assert all(c >= 1 for *_, c in alone)
