"""Ctrl-C where Python's usual KeyboardInterrupt would do harm: while libraries load, and inside
C callbacks.

A Ctrl-C that lands while numpy, scipy or torch is half-imported does not stop the command
cleanly: the half-made modules then fail in unrelated ways (RecursionError, AttributeError from
numpy.linalg, or an abort in torch's C++ code), each with a long traceback. `load_libraries`
(the first thing `icl-bench` does) imports them with SIGINT recorded instead of raised, so a
Ctrl-C there becomes the CLI's usual "icl-bench: interrupted" (exit 130) once they are loaded
(about 1.3 s). A KeyboardInterrupt raised inside a C callback (llvmlite's, during a numba
compile) is printed and dropped by ctypes; the runner's cell loop records SIGINT too
(`sigint_recorded(reraise=True)`) and stops after the cell. SIGTERM stops a command the same way
once the libraries are loaded (`sigterm_as_interrupt`, recorded too: `sigterm_seen`), with exit
code 143.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from importlib import import_module

LIBRARIES = ("numpy", "torch", "pandas", "pyarrow", "scipy.linalg", "numba")


@contextmanager
def sigint_recorded(reraise: bool):
    """A list that records every SIGINT while the block runs; with `reraise` the handler also
    raises KeyboardInterrupt as usual, without it the signal is only recorded.

    Installed only from the main thread over Python's default handler: a process started with
    SIGINT ignored (a background job), or a program with its own handler, keeps it (the list
    then stays empty).
    """
    seen: list[int] = []

    def handler(signum, frame):
        seen.append(signum)
        if reraise:
            raise KeyboardInterrupt

    mine = threading.current_thread() is threading.main_thread()
    if not mine or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield seen
        return
    signal.signal(signal.SIGINT, handler)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, a batch scheduler's time limit): the command stops as on Ctrl-C (finished
    cells kept, the resume line printed) and exits with 143 (128 + 15)."""


_sigterms: list[int] = []  # SIGTERMs seen inside sigterm_as_interrupt (one raised in a C callback is dropped)


def sigterm_seen() -> bool:
    """Whether a SIGTERM came since the current sigterm_as_interrupt block began: the runner's
    cell loop checks it after each cell, as it checks SIGINT, because a Terminated raised inside a
    C callback (llvmlite's, during a numba compile) is printed and dropped by ctypes."""
    return bool(_sigterms)


@contextmanager
def sigterm_as_interrupt():
    """While the block runs, SIGTERM raises Terminated in the main thread instead of killing the
    process silently, and is recorded (sigterm_seen). Installed only from the main thread over
    the default action; the earlier handler comes back after the block."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def handler(signum, frame):
        _sigterms.append(signum)
        raise Terminated

    _sigterms.clear()
    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _sigterms.clear()  # a later run_matrix outside the block (the API, a notebook) starts clean


def load_libraries() -> bool:
    """Import LIBRARIES; True when a Ctrl-C (SIGINT) came meanwhile (the caller stops then).

    A library that fails to import (numba is optional, or a version clash) is left to the code
    that needs it, which reports it as it always did.
    """
    with sigint_recorded(reraise=False) as seen:
        for name in LIBRARIES:
            try:
                import_module(name)
            except Exception:  # noqa: BLE001 (not ours to report here)
                pass
    return bool(seen)


@contextmanager
def torch_threads(n: int):
    """torch.set_num_threads(n) inside the block (n = 0: unchanged); the old count is restored.
    Code of many small torch operations (the fingerprint's GD trajectories, a cell's solver) runs
    several times faster on one thread than on torch's default of one per core."""
    import torch

    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
