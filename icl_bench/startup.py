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


def load_libraries() -> bool:
    """Import LIBRARIES; True when a Ctrl-C (SIGINT) came meanwhile (the caller stops then).

    From a thread other than the main one (no signal handlers there) they are just imported.
    """
    if threading.current_thread() is not threading.main_thread():
        for name in LIBRARIES:
            import_module(name)
        return False
    seen: list[int] = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        for name in LIBRARIES:
            import_module(name)
    finally:
        signal.signal(signal.SIGINT, old)
    return bool(seen)
