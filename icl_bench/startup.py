"""Loading the heavy libraries with Ctrl-C held back (the first thing `icl-bench` does).

A Ctrl-C that lands while numpy, scipy or torch is half-imported does not stop the command
cleanly: the half-made modules then fail in unrelated ways (RecursionError, AttributeError from
numpy.linalg, or an abort in torch's C++ code), each with a long traceback. `load_libraries`
imports them with SIGINT recorded instead of raised, so a Ctrl-C there becomes the CLI's usual
"icl-bench: interrupted" (exit 130) once they are loaded (about 1.3 s).
"""
from __future__ import annotations

import signal
import threading
from importlib import import_module

LIBRARIES = ("numpy", "torch", "pandas", "pyarrow", "scipy.linalg", "numba")


def _preload() -> None:
    """Import each of LIBRARIES that imports; one that fails (numba is optional, or a version
    clash) is left to the code that needs it, which reports it as it always did."""
    for name in LIBRARIES:
        try:
            import_module(name)
        except Exception:  # noqa: BLE001 (not ours to report here)
            pass


def load_libraries() -> bool:
    """Import LIBRARIES; True when a Ctrl-C (SIGINT) came meanwhile (the caller stops then).

    SIGINT is held back only where Python's default handler is in place, from the main thread: a
    process started with SIGINT ignored (a background job), or a program with its own handler,
    keeps it.
    """
    mine = threading.current_thread() is threading.main_thread()
    if not mine or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        _preload()
        return False
    seen: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        _preload()
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return bool(seen)
