"""hostload: counts the cells of this machine running now and during a timed section (each thread
its own cell, short cells that came and went inside the section too, a killed one only while it
overlapped), and exclusive timing keeps timed sections of separate processes from overlapping (with a
control)."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import threading
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
    left = [f for f in os.listdir(hostload._folder()) if f.startswith(f"{child.pid}-")]
    assert len(left) == 1 and left[0].endswith(".dead")  # its marker became a tombstone


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
    # control: both timed at once, and seen (>= 2: the other process's next cell can start inside too)
    assert _overlaps(shared) > 0 and max(c for *_, c in shared) >= 2
    alone = _run_two(exclusive=True)
    assert _overlaps(alone) == 0
    assert all(c >= 1 for *_, c in alone)


def _count_when_asked(ask, out):
    ask.wait(30)
    out.put(hostload.count_busy())


def test_threads_of_one_process_are_separate_cells():
    """Two threads of one process (a Dask worker with --nthreads 2) are two cells, and one leaving
    its cell does not end the other's."""
    ask, out = fork.Event(), fork.Queue()
    counter = fork.Process(target=_count_when_asked, args=(ask, out))  # forked before the threads start
    counter.start()
    both_in, b_left, infos = threading.Barrier(2), threading.Event(), {}

    def cell(name):
        with hostload.busy():
            with hostload.timing_slot(False) as infos[name]:
                both_in.wait(10)
                if name == "a":  # still inside when b has left: another process still sees a
                    assert b_left.wait(10)
                    ask.set()
                    infos["seen"] = out.get(timeout=30)
        if name == "b":
            b_left.set()

    threads = [threading.Thread(target=cell, args=(name,)) for name in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counter.join()
    assert infos["a"]["concurrency"] == 2 and infos["b"]["concurrency"] == 2
    assert infos["seen"] == 1


def _one_cell(seconds):
    with hostload.busy():
        time.sleep(seconds)


def test_a_cell_inside_the_timed_section_counts_and_one_before_it_does_not():
    before = fork.Process(target=_one_cell, args=(0.01,))
    before.start()
    before.join()  # negative control: over before the timed section starts
    with hostload.busy():
        with hostload.timing_slot(False) as info:
            inside = fork.Process(target=_one_cell, args=(0.05,))
            inside.start()
            inside.join()  # started after the timed section began, ended before it ends
    assert info["concurrency"] == 2


def test_a_killed_cell_counts_while_it_overlapped_and_never_after(monkeypatch):
    with hostload.busy():
        with hostload.timing_slot(False) as during:
            ready, release = fork.Event(), fork.Event()
            child = fork.Process(target=_hold_busy, args=(ready, release))
            child.start()
            assert ready.wait(30)
            os.kill(child.pid, signal.SIGKILL)  # dies inside its cell, without any clean-up
            child.join()
        with hostload.timing_slot(False) as after:
            time.sleep(0.01)
        assert hostload.count_busy() == 1
    assert during["concurrency"] == 2 and after["concurrency"] == 1
    monkeypatch.setattr(hostload, "KEEP_S", 0.0)
    hostload.count_busy()  # tombstones past KEEP_S are removed
    assert not [f for f in os.listdir(hostload._folder()) if f.startswith(f"{child.pid}-")]


def _fork_inside_busy():
    with hostload.busy():
        child = os.fork()
        if child:
            _, status = os.waitpid(child, 0)
            return os.waitstatus_to_exitcode(status), hostload.count_busy()
    code = 1
    try:  # the child, out of the parent's block: the parent's cell must still run
        code = 0 if hostload.count_busy() == 1 else 2
    finally:
        os._exit(code)


def test_a_forked_child_leaving_the_block_leaves_the_parents_cell_alone():
    assert _fork_inside_busy() == (0, 1)


def test_one_file_per_thread_not_per_cell():
    for _ in range(50):
        with hostload.busy(), hostload.timing_slot(False) as info:
            pass
    assert info["concurrency"] == 1
    assert len(os.listdir(hostload._folder())) == 1


def test_a_removed_activity_folder_is_made_again(tmp_path):
    # a /tmp cleaner under a long-lived worker: every later timed cell raised FileNotFoundError
    import shutil

    with hostload.busy(), hostload.timing_slot(False) as info:
        pass
    shutil.rmtree(hostload._folder())
    for _ in range(2):
        with hostload.busy(), hostload.timing_slot(False) as info:
            pass
        assert info["concurrency"] == 1
    assert len(os.listdir(hostload._folder())) == 1


def test_without_flock_counts_are_nan(monkeypatch):
    monkeypatch.setattr(hostload, "fcntl", None)
    with hostload.busy(), hostload.timing_slot(True) as info:
        assert hostload.count_busy() != hostload.count_busy()  # NaN
    assert info["concurrency"] != info["concurrency"]


def test_a_cell_during_the_warm_up_only_does_not_count():
    """The count starts at START (the runner calls it after its warm-up): a cell that came and went
    while this one compiled its kernel did not share its timed passes (a 12 s compile counted 225
    cells in a tryout). Control: the same cell after START counts."""
    for after_start, expected in ((False, 1), (True, 2)):
        with hostload.busy():
            with hostload.timing_slot(False) as info:
                if after_start:
                    info[hostload.START]()
                other = fork.Process(target=_one_cell, args=(0.01,))
                other.start()
                other.join()
                if not after_start:
                    info[hostload.START]()
        assert info["concurrency"] == expected and hostload.START not in info, (after_start, info)


def _exclusive_cells(barrier, out):
    barrier.wait(30)
    for _ in range(4):
        with hostload.busy(), hostload.timing_slot(True) as info:
            time.sleep(0.05)  # the warm-up: by its end the other process waits for the lock
            info[hostload.START]()
            time.sleep(0.03)
        out.put(info["concurrency"])


def test_a_cell_waiting_for_the_timing_lock_is_not_counted():
    """Under --exclusive-timing the other worker's cell, blocked on the lock through the whole timed
    section, counted as running: 2 of 150 rows read 1 (a review). Waiting now reads as idle; with
    nothing else to do between cells, most timed sections here ran alone (before the fix: none)."""
    barrier, out = fork.Barrier(2), fork.Queue()
    procs = [fork.Process(target=_exclusive_cells, args=(barrier, out)) for _ in range(2)]
    for p in procs:
        p.start()
    counts = [out.get(timeout=60) for _ in range(8)]
    for p in procs:
        p.join()
    assert sum(c == 1 for c in counts) >= 4, counts  # (a scheduling delay may let one see the other's next cell)


def test_a_cell_started_after_the_timed_section_ended_is_not_counted(monkeypatch):
    """A cell that another thread starts after the timed section ended, but before timing_slot's
    last listing, shared none of its passes (hostload docstring: it is left out); control: one
    started inside the section counts."""
    import threading

    def other_cell(started, release):
        with hostload.busy():
            started.set()
            release.wait(10)

    for inside, expected in ((False, 1), (True, 2)):
        started, release, calls = threading.Event(), threading.Event(), []
        t = threading.Thread(target=other_cell, args=(started, release))
        scan = hostload._scan

        def late_scan():  # the listing at the section's end: the other cell starts just before it
            calls.append(1)
            if len(calls) == 2 and not inside:
                t.start()
                assert started.wait(10)
            return scan()
        monkeypatch.setattr(hostload, "_scan", late_scan)
        try:
            with hostload.busy(), hostload.timing_slot(False) as info:
                if inside:
                    t.start()
                    assert started.wait(10)
        finally:
            release.set()
            if t.ident is not None:  # (started)
                t.join()
            monkeypatch.setattr(hostload, "_scan", scan)
        assert info["concurrency"] == expected, (inside, info)


def test_names_parsed_once_still_follow_the_folder(monkeypatch):
    """_scan keeps each listed name's parse: tombstones that expire leave the counts and, once the
    folder has moved on, the kept parses too (a long-lived worker's memory stays bounded); a
    tombstone's count still serves a scan after it was first parsed."""
    folder = hostload._folder()
    now = time.monotonic()
    for k in range(600):  # dead threads of other processes, each with 3 cells started
        open(os.path.join(folder, f"1-{k}-{k}_3_{now:.6f}.dead"), "w").close()
    first = hostload._scan()
    assert len(first) == 600 and first["1-7-7"] == (3, False, None)
    assert hostload._scan() == first  # the same from the kept parses
    monkeypatch.setattr(hostload, "KEEP_S", 0.0)
    hostload._scan()  # expired: removed from the folder (this scan still reads them)
    assert os.listdir(folder) == []
    assert hostload._scan() == {} and len(hostload._state["parsed"]) <= 256  # and from the counts
