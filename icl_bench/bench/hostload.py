"""What else runs on this machine while a cell is timed, and an optional machine-wide timing slot.

Throughput measured while other cells run on the same cores is not comparable with throughput
measured alone (docs/scale-out.md, "Honest timing"). Every process running icl-bench cells keeps
one marker file in a per-user folder of the machine's temp dir and holds an exclusive flock on it
while it runs a cell:

    busy()            marks this process busy for the duration of the block
    count_busy()      the number of processes of this machine running a cell now (this one included)
    timing_slot(excl) context for the timed section of a cell: yields a dict that holds, on exit,
                      `concurrency` = the most cells running on this machine at the start or end of
                      the timing; with excl=True the block first takes the machine's timing lock,
                      so at most one cell per machine is inside its timed section at a time

flock is released by the kernel when a process dies, however it dies, so a killed worker never
counts as busy nor holds the timing lock. Marker files of dead processes are removed by count_busy.
Processes see each other only through a shared temp dir (one machine, one user, same container).
"""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no activity tracking (concurrency is reported as NaN)
    fcntl = None

_state: dict = {}  # pid -> open marker file of this process (re-created after fork); "tmp", "folder"


def _folder() -> Path:
    tmp = tempfile.gettempdir()
    if _state.get("tmp") != tmp:
        uid = os.getuid() if hasattr(os, "getuid") else 0
        _state["folder"] = folder = Path(tmp) / f"icl-bench-activity-{uid}"
        folder.mkdir(mode=0o700, exist_ok=True)
        _state["tmp"] = tmp
    return _state["folder"]


def _marker():
    f = _state.get(os.getpid())
    if f is None:  # first use in this process (or after a fork)
        for k in [k for k in _state if isinstance(k, int)]:
            del _state[k]
        f = _state[os.getpid()] = open(_folder() / f"{os.getpid()}.busy", "a+b")
    return f


@contextmanager
def busy():
    """Mark this process as running a cell for the duration of the block."""
    if fcntl is None:
        yield
        return
    f = _marker()
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def count_busy() -> float:
    """Processes of this machine (this user, this temp dir) running a cell now; NaN without flock."""
    if fcntl is None:
        return float("nan")
    folder, n, mine = _folder(), 0, f"{os.getpid()}.busy"
    for name in os.listdir(folder):
        if not name.endswith(".busy"):
            continue
        if name == mine:
            n += 1  # ours: only called from inside busy()
            continue
        try:
            fd = os.open(folder / name, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            n += 1  # held: that process is running a cell
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            pid = name[:-len(".busy")]
            if pid.isdigit() and not _alive(int(pid)):  # a dead process's marker
                (folder / name).unlink(missing_ok=True)
        finally:
            os.close(fd)
    return n


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


@contextmanager
def timing_slot(exclusive: bool = False):
    """Context of a cell's timed section; the yielded dict gets `concurrency` on exit (see above)."""
    info: dict = {}
    lock = None
    if exclusive and fcntl is not None:
        lock = open(_folder() / "timing.lock", "a+b")
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # waits for the machine's other timed cell
    try:
        before = count_busy()
        yield info
        info["concurrency"] = max(before, count_busy())
    finally:
        if lock is not None:
            lock.close()  # releases the flock
