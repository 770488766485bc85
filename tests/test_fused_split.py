"""fused.split, the one way the fused kernels (transformer forward, ols) spread prompts over threads:
every prompt exactly once, the calling thread working too, exceptions after all shares finish,
and no deadlock when a share splits again."""
import threading
import time

import pytest

from icl_bench.solvers import fused


@pytest.mark.parametrize("B", [0, 1, 2, 7, 64, 1001])
@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_every_prompt_once_and_the_caller_takes_the_first_share(B, threads):
    shares = []  # (b0, b1, thread name)
    lock = threading.Lock()

    def work(b0, b1):
        with lock:
            shares.append((b0, b1, threading.current_thread().name))

    fused.split(work, B, threads)
    covered = sorted(b for b0, b1, _ in shares for b in range(b0, b1))
    assert covered == list(range(B))
    assert len(shares) == max(1, min(threads, B))
    first = min(shares)
    assert first[0] == 0 and first[2] == threading.current_thread().name
    assert all(name.startswith("icl_bench-fused") for b0, _, name in shares if b0 > 0)


def test_a_failing_share_raises_only_after_the_others_finished():
    finished = []

    def work(b0, b1):
        if b0 == 0:  # the calling thread's share fails at once
            raise ValueError("share 0")
        time.sleep(0.2)
        finished.append(b0)

    with pytest.raises(ValueError, match="share 0"):
        fused.split(work, 10, 2)
    assert finished == [5]  # the worker's share was done before split returned

    def worker_fails(b0, b1):
        if b0 > 0:
            raise KeyError("worker")

    with pytest.raises(KeyError, match="worker"):
        fused.split(worker_fails, 10, 2)


def test_a_share_that_splits_again_runs_on_its_own_thread():
    seen = []

    def inner(b0, b1):
        seen.append((b0, b1, threading.current_thread().name))

    def outer(b0, b1):
        fused.split(inner, b1 - b0, 2)

    done = threading.Thread(target=fused.split, args=(outer, 8, 2), daemon=True)
    done.start()
    done.join(timeout=20)
    assert not done.is_alive(), "a nested split waited for the worker it occupies"
    caller = done.name
    on = {(b0, b1): name == caller for b0, b1, name in seen}  # share -> ran on the calling thread
    assert len(seen) == 3 and on == {(0, 2): True, (2, 4): False, (0, 4): False}
    # the caller's share split in two again; the worker's share (0, 4) ran whole, on the worker


def test_the_shares_run_at_the_same_time():
    """Each share waits at a barrier for all the others: a split that ran its shares one after
    another would break the barrier (timeout) instead of passing it."""
    barrier = threading.Barrier(3, timeout=10)
    fused.split(lambda b0, b1: barrier.wait(), 30, 3)
    assert not barrier.broken


def test_callers_on_several_python_threads_with_different_thread_counts(monkeypatch):
    """Python threads that split at once with 2, 3 and 4 threads (so the shared pool grows while
    others use it) all finish, each prompt computed once; before the pool was taken and used
    under one lock, a call could find it shut down by another ('cannot schedule new futures')."""
    import sys

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: the race shows within a second
    monkeypatch.setattr(fused, "_POOL", None)
    errors, counts = [], {}

    def caller(threads):
        try:
            for _ in range(1000):
                seen = []
                fused.split(lambda b0, b1: seen.extend(range(b0, b1)), 100, threads)
                counts[threads] = counts.get(threads, 0) + (sorted(seen) == list(range(100)))
        except Exception as exc:  # noqa: BLE001 - collected and reported by the assertion
            errors.append(repr(exc))

    try:
        runners = [threading.Thread(target=caller, args=(n,)) for n in (2, 3, 4)]
        for r in runners:
            r.start()
        for r in runners:
            r.join(timeout=60)
    finally:
        sys.setswitchinterval(old)
    assert errors == [] and counts == {2: 1000, 3: 1000, 4: 1000}


def test_the_pool_only_grows(monkeypatch):
    """Alternating thread counts reuse one pool (replacing it per call cost ~0.3 ms of thread starts)."""
    monkeypatch.setattr(fused, "_POOL", None)
    fused.split(lambda b0, b1: None, 100, 4)
    first = fused._POOL
    for threads in (2, 3, 4, 2):
        fused.split(lambda b0, b1: None, 100, threads)
    assert fused._POOL is first and first._max_workers == 3
    fused.split(lambda b0, b1: None, 100, 6)
    assert fused._POOL is not first and fused._POOL._max_workers == 5


def _threads_asked(monkeypatch) -> list:
    """Record the thread count each fused.split call is given (the split itself still runs)."""
    asked, real = [], fused.split
    monkeypatch.setattr(fused, "split", lambda work, B, threads: (asked.append(threads), real(work, B, threads))[1])
    return asked


@pytest.mark.skipif(not fused.available(), reason="numba is not installed: no fused kernels")
def test_small_batches_stay_on_one_thread_large_ones_split(monkeypatch):
    """A share must be worth waking a thread for: the forward splits from MIN_WORK_PER_THREAD
    tokens per thread, ols from MIN_BYTES_PER_THREAD of x and y; both answer alike either way."""
    import torch

    from icl_bench import PromptSpec, get_solver, sample_prompts
    from icl_bench.solvers import fused_ols

    monkeypatch.setattr(fused, "THREADS", 4)
    asked = _threads_asked(monkeypatch)
    batch = sample_prompts(PromptSpec(N=20, noise=0.1, R=100.0), 64, seed=1)  # 64 * 21 tokens
    lcf, ols = get_solver("ln-closed-form"), get_solver("ols")
    small = (lcf.predict(batch), ols.predict(batch))
    assert asked == [1, 1]
    monkeypatch.setattr(fused, "MIN_WORK_PER_THREAD", 64 * (21 + fused.PROMPT_WORK) // 3)  # room for three threads
    monkeypatch.setattr(fused_ols, "MIN_BYTES_PER_THREAD", batch.x.nbytes)  # x and y: two threads
    split = (lcf.predict(batch), ols.predict(batch))
    assert asked == [1, 1, 3, 2]
    for one, many in zip(small, split):
        torch.testing.assert_close(one, many, rtol=0, atol=0, equal_nan=True)


@pytest.mark.skipif(not fused.available(), reason="numba is not installed: no fused kernels")
def test_the_default_thresholds_and_the_thread_cap(monkeypatch):
    """At the shipped constants: ln-closed-form at N = 100 splits 2595 prompts (594 255 units of
    work, 4 shares' worth) but not 648 (148 392); ols splits 2^20 float32 values (8 MiB less 608
    bytes) but not 2^18; and no call gets more threads than THREADS allows."""
    from icl_bench import PromptSpec, get_solver, sample_prompts

    monkeypatch.setattr(fused, "THREADS", 2)
    asked = _threads_asked(monkeypatch)
    lcf, ols = get_solver("ln-closed-form"), get_solver("ols")
    for B in (648, 2595):
        lcf.predict(sample_prompts(PromptSpec(N=100, noise=0.1, R=100.0), B, seed=2, dtype="float32"))
    for B in (2621, 10485):
        ols.predict(sample_prompts(PromptSpec(N=100, noise=0.1, R=100.0), B, seed=2, dtype="float32"))
    assert asked == [1, 2, 1, 2]


def test_a_kernel_compiling_elsewhere_does_not_hold_up_a_split():
    """Compiling a kernel holds fused._LOCK for seconds; the pool has a lock of its own, so a split
    on another Python thread goes ahead meanwhile."""
    done = []
    with fused._LOCK:  # as a compiling thread would
        runner = threading.Thread(target=lambda: (fused.split(lambda b0, b1: None, 10, 2), done.append(True)))
        runner.start()
        runner.join(timeout=10)
        assert done == [True]
