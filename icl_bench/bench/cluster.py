"""Small helpers of the Dask executor (icl_bench/bench/executors.py, docs/scale-out.md): the name
of the worker a cell runs on, what a LocalCluster's workers would have, the sliding window of
cells in flight, and the start of a LocalCluster with SIGINT held.
"""
from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager


def worker_name() -> str:
    """The Dask worker running the caller (its address), or "local" outside a Dask worker."""
    distributed = sys.modules.get("distributed")
    if distributed is not None:
        try:
            return distributed.get_worker().address
        except ValueError:  # not inside a worker task
            pass
    return "local"


@contextmanager
def sigint_held():
    """Ignore SIGINT while the LocalCluster starts its worker processes: they inherit the ignored
    signal (a blocked one they do not), so a terminal's Ctrl-C, sent to the whole process group,
    stops the run alone, which then closes its cluster, instead of each worker printing its own
    KeyboardInterrupt tracebacks (68 lines before the resume line; found by a review). A Ctrl-C in
    those seconds is not seen: press it again. A worker Dask restarts later takes Ctrl-C again."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def torch_cuda() -> bool:
    """Whether this process sees a CUDA device (what a LocalCluster's workers would have)."""
    import torch

    return torch.cuda.is_available()


def worker_threads() -> int:
    """(On a worker) the torch threads its cells run with now."""
    import torch

    return torch.get_num_threads()


def in_flight(workers: dict) -> int:
    """Cells in flight: twice the workers' threads, at least 4."""
    return max(4, 2 * sum(w["nthreads"] or 1 for w in workers.values()))


def drain(items: list) -> list:
    """The items, and `items` emptied."""
    out = items[:]
    items.clear()
    return out
