"""What else runs on this machine while a cell is timed, and an optional machine-wide timing slot.

Throughput measured while other cells run on the same cores is not comparable with throughput
measured alone (docs/scale-out.md, "Honest timing"). Every thread that runs icl-bench cells keeps
one marker file in a per-user folder of the machine's temp dir, whose name says how many cells the
thread has started and whether it is inside one:

    {pid}-{tid}-{k}_{n}.idle           n busy stretches run, none running now
    {pid}-{tid}-{k}_{n}_{start}.busy   inside its n-th busy stretch since `start`

A busy stretch is a cell, or with the timing lock (excl below) a cell's part before its wait for
the lock and its part after: waiting, a thread does not compete for the cores (_waiting).
    {pid}-{tid}-{k}_{n}_{when}.dead    a tombstone: the thread or its process ended at `when`

    busy()            marks one cell running in this thread for the duration of the block
    count_busy()      the number of cells of this machine running now (this one included)
    timing_slot(excl) context for the warm-up and timed section of a cell: yields a dict that holds,
                      on exit, `concurrency` = the number of distinct cells that ran on this machine
                      at some moment of the timed section (this one included): those running when it
                      started (dict[START]() marks that, after the warm-up), and every one started
                      before it ended, short ones that came and went inside it too; with excl=True
                      the block first takes the machine's timing lock, so at most one cell per
                      machine is inside its warm-up and timed section; a cell waiting for that
                      lock reads as idle meanwhile (it blocks, it does not compete for the cores)

A cell is counted per thread, so the two threads of a Dask worker with --nthreads 2 are two cells.
timing_slot lists the folder when the timed section starts and when it ends: each thread adds the
cell it was running at the start plus the cells it started since (its n went up). A rename is
atomic, so one listing is a consistent picture of every thread, and nothing is written per cell
but two renames. `start` and `when` are time.monotonic(), one clock for the whole machine
(CLOCK_MONOTONIC on Linux): a cell started after the section ended, before its last listing, is
left out, and tombstones expire.

Each marker is flock'ed for its thread's life; the kernel releases a flock when a process dies,
however it dies, so an unheld marker belongs to a dead process: a scan turns it into a tombstone,
whose cell (if it was inside one) stops counting as running, and whose count still serves the
timed sections that saw it alive. Tombstones are removed after KEEP_S. A killed worker never holds
the timing lock either. A forked child closes its copies of the parent's locks and never ends the
parent's cell. Processes see each other only through a shared temp dir (one machine, one user,
same container). Without fcntl (not POSIX) nothing is tracked: NaN.
"""
from __future__ import annotations

import itertools
import os
import tempfile
import threading
import time
from contextlib import contextmanager, suppress

try:
    import fcntl
except ImportError:  # not POSIX: no activity tracking (concurrency is reported as NaN)
    fcntl = None

START = "start_timing"  # key of timing_slot's dict: call it where the timed passes begin
KEEP_S = 600.0  # tombstones are kept this long (a longer timed section may miss a dead thread's cells)

_state: dict = {}  # "tmp", "folder": the activity folder of the current temp dir; "parsed": _scan's names
_local = threading.local()  # .marker: this thread's _Marker
_ids = itertools.count()  # k in marker names: a thread id can be reused, a marker name never is
_held: set = set()  # descriptors of this process's markers and timing lock: a forked child closes its copies
_mine: set = set()  # ids of this process's live markers (held by us: scans need not test them)


def _forget_after_fork():
    """In a forked child: drop the inherited copies of the parent's locks (the parent keeps them)."""
    for fd in _held:
        with suppress(OSError):
            os.close(fd)
    _held.clear()
    _mine.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def _folder() -> str:
    """The activity folder of the current temp dir, made again if removed (a /tmp cleaner under a
    long-lived worker: its markers are then lost, and made anew at the next cell)."""
    tmp = tempfile.gettempdir()
    if _state.get("tmp") != tmp or not os.path.isdir(_state["folder"]):
        uid = os.getuid() if hasattr(os, "getuid") else 0
        _state["folder"] = folder = os.path.join(tmp, f"icl-bench-activity-{uid}")
        os.makedirs(folder, mode=0o700, exist_ok=True)
        _state["tmp"], _state["parsed"] = tmp, {}  # parsed: a listed name -> _parse(name)
    return _state["folder"]


class _Marker:
    """This thread's marker file, exclusively flock'ed from creation to the thread's end."""

    def __init__(self, folder: str):
        self.pid, self.n, self.depth, self.lost = os.getpid(), 0, 0, False
        self.folder, self.id = folder, f"{self.pid}-{threading.get_native_id()}-{next(_ids)}"
        self.path = os.path.join(folder, f"{self.id}.new")  # not locked yet: scans skip it
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        _held.add(self.fd)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        _mine.add(self.id)
        self.rename(f"{self.id}_0.idle")

    def rename(self, name: str):
        path = os.path.join(self.folder, name)
        try:  # rename(2) is atomic: a listing sees the old name or the new one
            os.rename(self.path, path)  # (not os.replace: tests watch that for the run folder's writes)
            self.path = path
        except OSError:  # the folder was removed under us: untracked until the next marker
            self.lost = True

    def release(self):
        """Let go of the marker's lock (closing its file): it is no longer this process's."""
        _held.discard(self.fd)
        _mine.discard(self.id)
        os.close(self.fd)

    def __del__(self):  # the thread ended: its count stays readable for KEEP_S
        try:
            if self.pid == os.getpid() and self.fd in _held:
                self.rename(f"{self.id}_{self.n}_{time.monotonic():.6f}.dead")
                self.release()
        except Exception:  # interpreter shutdown: the kernel drops the lock, a scan makes the tombstone
            pass


def _marker() -> _Marker:
    m, folder = getattr(_local, "marker", None), _folder()
    gone = m is not None and m.pid == os.getpid() and (m.lost or not os.path.exists(m.path))  # folder removed
    if gone and m.fd in _held:  # our lock on a file no longer there: let it go
        m.release()
    if m is None or gone or m.pid != os.getpid() or m.folder != folder:  # first, forked, moved, removed
        m = _local.marker = _Marker(folder)
    return m


@contextmanager
def busy():
    """Mark one cell running in this thread for the duration of the block (nested blocks: one cell)."""
    if fcntl is None:
        yield
        return
    m = _marker()
    m.depth += 1
    if m.depth == 1:
        m.n += 1
        m.rename(f"{m.id}_{m.n}_{time.monotonic():.6f}.busy")
    try:
        yield
    finally:
        m.depth -= 1
        if m.depth == 0 and m.pid == os.getpid():  # not a forked child leaving the parent's block
            m.rename(f"{m.id}_{m.n}.idle")


def count_busy() -> float:
    """Cells of this machine (this user, this temp dir) running now; NaN without flock."""
    if fcntl is None:
        return float("nan")
    return sum(running for _, running, _ in _scan().values())


def _parse(name: str) -> tuple | None:
    """A listing's name -> (marker id, cells started, start or death time or None, kind), or None
    for anything that is not a finished marker name (the timing lock, a marker being created)."""
    base, _, kind = name.rpartition(".")
    mid, *fields = base.split("_")
    try:
        n, t = int(fields[0]), (float(fields[1]) if len(fields) == 2 else None)
    except (IndexError, ValueError):
        return None
    if (kind, t is None) not in (("idle", True), ("busy", False), ("dead", False)):
        return None
    return mid, n, t, kind


def _scan() -> dict:
    """{marker id: (cells started, running now, start of the running one)} from one listing.

    Also the clean-up: a dead process's markers become tombstones, old tombstones are removed.
    A name is parsed once (a marker's name is never reused): with tombstones kept for KEEP_S, a
    folder after a test suite or a cluster's restarts holds dozens, and parsing each of them at
    every one of a cell's three scans cost 0.3 ms of a trivial cell's ~1 ms (docs/scale-out.md)."""
    folder, now, seen = _folder(), time.monotonic(), {}
    names = os.listdir(folder)
    parsed = _state["parsed"]
    if len(parsed) > 2 * len(names) + 256:  # forget the names no longer listed
        parsed = _state["parsed"] = {k: parsed[k] for k in names if k in parsed}
    for name in names:
        p = parsed.get(name, False)
        if p is False:
            p = parsed[name] = _parse(name)
        if p is None:
            continue
        mid, n, t, kind = p
        if kind == "dead":
            if now - t > KEEP_S:
                with suppress(OSError):
                    os.unlink(os.path.join(folder, name))
            seen[mid] = (n, False, None)
        elif mid in _mine or _locked(os.path.join(folder, name)):
            seen[mid] = (n, kind == "busy", t)
        else:  # its process died (the kernel dropped the lock): stops counting as running
            with suppress(OSError):
                os.rename(os.path.join(folder, name), os.path.join(folder, f"{mid}_{n}_{now:.6f}.dead"))
            seen[mid] = (n, False, None)
    return seen


def _locked(path: str) -> bool:
    """Whether a live thread holds the marker (or renamed it since the listing: it is alive)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _overlapping(before: dict, after: dict, t1: float) -> int:
    """Cells that ran at some moment between two scans: per thread, the one running at the first
    and those it started since (less one started after t1, between t1 and the second scan)."""
    total = 0
    for mid in before.keys() | after.keys():
        n0, r0, _ = before.get(mid, (0, False, None))
        n1, r1, s1 = after.get(mid, (n0, False, None))
        total += r0 + max(0, n1 - n0) - (r1 and n1 > n0 and s1 > t1)
    return total


@contextmanager
def _waiting():
    """This thread's cell waits (blocked on the timing lock, not competing for the cores): its
    marker reads idle meanwhile, and leaving the wait starts a new busy stretch (n + 1), as a new
    cell would. So a timed section counts a cell that only waited through it not at all, and one
    whose untimed work (its prompts before the wait) ran inside it once. Counted as running, the
    waiting cells had put `concurrency` at 2-3 on nearly every row of an --exclusive-timing run,
    which then looked like a run without it (found by a review)."""
    m = getattr(_local, "marker", None)
    if m is None or m.depth == 0 or m.pid != os.getpid():  # not inside a busy() block of this process
        yield
        return
    m.rename(f"{m.id}_{m.n}.idle")
    try:
        yield
    finally:
        m.n += 1
        m.rename(f"{m.id}_{m.n}_{time.monotonic():.6f}.busy")


@contextmanager
def timing_slot(exclusive: bool = False):
    """Context of a cell's timed section; the yielded dict gets `concurrency` on exit (see above).

    The lock (exclusive) is taken on entry, so a cell's warm-up (a kernel compile: seconds) does
    not run beside another cell's timed passes; the count starts on entry too, or when the block
    calls the dict's START entry (the runner does after its warm-up: a 12 s compile counted every
    cell that ran during it, 225 in a tryout, against passes that ran alone). START is removed on exit."""
    info: dict = {}
    if fcntl is None:
        yield info
        info["concurrency"] = float("nan")
        return
    pid, lock = os.getpid(), None
    try:
        if exclusive:
            lock = os.open(os.path.join(_folder(), "timing.lock"), os.O_RDWR | os.O_CREAT, 0o600)
            _held.add(lock)
            with _waiting():
                fcntl.flock(lock, fcntl.LOCK_EX)  # waits for the machine's other timed cell
        before = [_scan()]
        info[START] = lambda: before.__setitem__(0, _scan())  # the warm-up done: count from here
        yield info
        t1 = time.monotonic()
        info.pop(START, None)
        info["concurrency"] = _overlapping(before[0], _scan(), t1)
    finally:
        if lock is not None and os.getpid() == pid:  # not a forked child leaving the parent's block
            _held.discard(lock)
            os.close(lock)  # releases the flock
