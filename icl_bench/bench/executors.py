"""Executors: where the cells of a run are computed (docs/scale-out.md).

    local  in this process, one cell after the other, in the matrix order (the default; needs
           nothing beyond the core packages)
    dask   one task per cell on a Dask cluster: the cluster at `scheduler` (tcp://host:8786), or a
           distributed.LocalCluster started for the run (`n_workers` processes, one thread each,
           on the loopback interface). Needs the optional extra: `pip install -e ".[dask]"` in the checkout.

Either way the executor only *computes*: `results(cells, work)` yields (cell, row, failure) as
each cell finishes, and the caller (the runner, in the driver process) stores every row as it
arrives, so crash safety and --resume do not depend on the executor. A task carries the Cell
(a few hundred bytes); the worker draws the prompts from the cell's seed and loads the solver
(and its checkpoint) itself, so prompts and models are never shipped.

Faults: a worker that dies mid-cell has its cell re-run by Dask on another worker, at most
`retries` times (Dask's `distributed.scheduler.allowed-failures`); after that the cell comes back
as a failure ("error", "KilledWorker: ...") and the run goes on. cuda cells are sent only to
workers that declare a `GPU` resource; with none in the cluster they come back "skipped".
"""
from __future__ import annotations

import logging
import pkgutil
import re
import sys
import threading
import time
import uuid
import warnings
from typing import Callable, Iterable, Iterator

from icl_bench.bench.cluster import drain, in_flight, sigint_held, torch_cuda, worker_threads
from icl_bench.bench.config import Executor
from icl_bench.errors import ConfigError, RunAborted

Failure = tuple[str, str]  # (status, message) of a cell the executor could not get a row for
DASK_MISSING = ('executor.kind: "dask" needs the optional packages dask and distributed '
                '(pip install -e ".[dask]" in the icl-bench checkout)')
CONNECT_TIMEOUT = "10s"  # to reach a running scheduler
HANDSHAKE_S = 30.0  # for the whole connection, handshake included (CONNECT_TIMEOUT does not bound that)
PACKAGE = "icl_bench"  # what every worker must import (_check_workers)
WORKER_WAIT_S = 60.0  # for the first worker of a running scheduler (batch jobs start late)
WORKER_NOTE_S = 10.0  # of those, waited before the run says that it waits
POLL_S = 1.0  # how often a run waiting for its cells checks that its client still has a scheduler
NO_GPU = ("no Dask worker of this cluster declares a GPU resource (start GPU workers with "
          "`dask worker SCHEDULER --nthreads 1 --resources GPU=1`)")


class LocalExecutor:
    """Runs each cell in this process, in order."""

    kind = "local"

    def __init__(self, exclusive_timing: bool = False):
        self.exclusive_timing = exclusive_timing

    def describe(self, threads: int = 0, table=None) -> dict:
        """metadata.json's executor block (exclusive_timing too: a local run beside others can take
        the machine's timing lock, and its metadata said nothing of it; a review)."""
        return {"kind": "local", "exclusive_timing": self.exclusive_timing}

    def results(self, cells: Iterable, work: Callable[[object], dict]) -> Iterator[tuple[object, dict | None, Failure | None]]:
        for cell in cells:
            yield cell, work(cell), None

    def close(self) -> None:
        pass


class DaskExecutor:
    """One task per cell on a Dask cluster (see the module docstring).

    Raises:
        ConfigError: dask / distributed are not installed, or the scheduler cannot be reached.
    """

    kind = "dask"

    def __init__(self, cfg: Executor):
        try:
            from distributed import Client  # (which needs dask)
        except ImportError:
            raise ConfigError(DASK_MISSING) from None
        self.cfg, self.cluster, self.client, self.seen = cfg, None, None, {}
        # a lost scheduler is reported by the run in one line (RunAborted); distributed's client also
        # logs its end of reconnecting as an ERROR, at a moment that races with our report
        logging.getLogger("distributed.client").addFilter(_quiet_reconnect)
        if cfg.scheduler:
            self.client = _connect(Client, cfg.scheduler)
            try:
                try:
                    self.client.wait_for_workers(1, timeout=WORKER_NOTE_S)
                except TimeoutError:  # (silent for a minute, a run looked hung)
                    print(f"icl-bench: waiting up to {WORKER_WAIT_S:g} s for a first worker of the cluster at "
                          f"{cfg.scheduler}", file=sys.stderr, flush=True)
                    self.client.wait_for_workers(1, timeout=max(WORKER_WAIT_S - WORKER_NOTE_S, 0.1))
            except Exception as exc:  # TimeoutError: no worker came; else (OSError) the scheduler went away
                lost = not isinstance(exc, TimeoutError) or self.client.status not in ("running", "connecting")
                self.close()
                if lost:
                    raise RunAborted(f"executor.scheduler: the run lost its Dask scheduler at {cfg.scheduler} while "
                                     f"waiting for its first worker ({type(exc).__name__})") from None
                raise ConfigError(f"executor.scheduler: the cluster at {cfg.scheduler!r} has no worker after "
                                  f"{WORKER_WAIT_S:g} s; start some (dask worker {cfg.scheduler} --nthreads 1)") from None
            self._check_workers()

    def _check_workers(self) -> None:
        """Ask every worker of a running cluster to import icl-bench (pkgutil.resolve_name of its
        __version__: a stdlib function, so the question reaches a worker without icl-bench too).
        A worker that cannot closes on its first cell (the task does not unpickle), and a run whose
        every worker was such waited forever with "the cluster has no worker" (a review).

        Raises:
            ConfigError: no worker can import it (the run has not written anything yet).
        Warns: some workers cannot (their cells are retried on the others).
        """
        try:
            got = self.client.run(pkgutil.resolve_name, f"{PACKAGE}.__version__", on_error="return")
        except Exception:  # (the scheduler went away: the run reports that where it waits)
            return
        bad = {a: v for a, v in got.items() if isinstance(v, BaseException)}
        if not bad:
            return
        why = "; ".join(f"{a}: {type(v).__name__}: {' '.join(str(v).split())[:120]}" for a, v in list(bad.items())[:3])
        if len(bad) == len(got):
            self.close()
            raise ConfigError(f"executor.scheduler: no worker of the cluster at {self.cfg.scheduler!r} can import "
                              f"{PACKAGE} ({why}); install icl-bench in the workers' Python environment "
                              "(docs/scale-out.md)")
        warnings.warn(f"{len(bad)} of {len(got)} workers of the cluster at {self.cfg.scheduler} cannot import {PACKAGE} "
                      f"({why}): each closes on its first cell, which is then retried on another worker; install "
                      "icl-bench in their Python environment (docs/scale-out.md)", stacklevel=3)

    def _start(self) -> None:
        """Start the LocalCluster (no --scheduler) on first use, not in __init__: the run checks its
        --out folder (a lock held by another run) first and starts no cluster for a matrix whose every
        cell is stored already (it took 20 s before the refusal; a review)."""
        if self.client is None:
            import dask
            from distributed import Client, LocalCluster

            cfg = self.cfg
            resources = {"GPU": 1} if torch_cuda() else None
            # the scheduler runs in this process and reads allowed-failures when it is created; the
            # workers' stack sampler (10 ms) only feeds the dashboard profiles. distributed serves its
            # HTTP endpoints even with dashboard_address=None (on :8787, with a warning when a
            # concurrent run holds that port): ":0" puts them on a free port of 127.0.0.1
            # worker-saturation 1.0: a worker holds only the cell it runs (no queue behind it), so a cell
            # that kills its worker on every attempt no longer takes the cells queued there down with it
            # (each death counted against them too: healthy cells became KilledWorker rows; a review)
            with dask.config.set({"distributed.scheduler.allowed-failures": cfg.retries,
                                  "distributed.scheduler.worker-saturation": 1.0,
                                  "distributed.worker.profile.enabled": False}), sigint_held():
                self.cluster = LocalCluster(n_workers=cfg.n_workers, threads_per_worker=1, processes=True,
                                            host="127.0.0.1", dashboard_address=":0", resources=resources,
                                            silence_logs=logging.CRITICAL)  # (ERROR: a worker's heartbeat to
            # a scheduler closing under Ctrl-C logged a traceback; the run reports every cell's failure itself)
            self.client = Client(self.cluster)

    def workers(self) -> dict:
        """address -> {host, nthreads, resources} of the cluster's workers now (and remembered in
        `seen`, so that describe() names every worker of the run, those that died or left too)."""
        self._start()
        info = self.client.scheduler_info(n_workers=-1)["workers"]
        now = {a: {"host": w.get("host"), "nthreads": w.get("nthreads"), "resources": w.get("resources", {})}
               for a, w in info.items()}
        self.seen.update(now)
        return now

    def describe(self, threads: int = 0, table=None) -> dict:
        """The run's executor for metadata.json: `workers` = every worker seen during the run, with
        `torch_threads`, the threads its cells ran with (not the driver's, which metadata's device
        block gives): `threads` (the config's timing.threads) when it is set, else the worker's own
        default, asked of those alive now, and `cells`, the rows of the run's `table` it computed (a
        worker that joined but computed nothing read like the others: a review); `retries` only for
        a LocalCluster (a running cluster's allowed-failures are its own). A LocalCluster never
        started (every cell was stored) has no scheduler and no worker."""
        local = not self.cfg.scheduler  # ("" names a LocalCluster too)
        if self.client is None:
            return {"kind": "dask", "scheduler": None, "local_cluster": True, "retries": self.cfg.retries,
                    "exclusive_timing": self.cfg.exclusive_timing, "workers": {}}
        try:
            self.workers()
            own = self.client.run(worker_threads) if threads <= 0 else {a: threads for a in self.seen}
            for address, n in own.items():
                self.seen.setdefault(address, {})["torch_threads"] = n
        except Exception:  # the scheduler is gone: what was seen stays
            pass
        if table is not None and "worker" in table:
            counts = table["worker"].value_counts()
            for address, info in self.seen.items():
                info["cells"] = int(counts.get(address, 0))
        return {"kind": "dask", "scheduler": self.client.scheduler.address,
                "local_cluster": local,
                "retries": self.cfg.retries if local else "the cluster's own allowed-failures",
                "exclusive_timing": self.cfg.exclusive_timing, "workers": dict(self.seen)}

    def results(self, cells: Iterable, work: Callable[[object], dict]) -> Iterator[tuple[object, dict | None, Failure | None]]:
        from distributed import wait

        cells = list(cells)
        if self.client is None and not torch_cuda():
            # a LocalCluster not started yet, on a machine without a GPU: its cuda cells are skipped without
            # starting it (a resume with only cuda cells left started one to write skipped rows; a review)
            yield from ((c, None, ("skipped", NO_GPU)) for c in cells if c.device.startswith("cuda"))
            cells = [c for c in cells if not c.device.startswith("cuda")]
        if not cells:  # (a LocalCluster is not started for nothing)
            return
        workers = self.workers()
        gpu = any(w["resources"].get("GPU") for w in workers.values())  # GPU workers at the start of the run
        pending = {}
        todo = iter(cells)
        window, refreshed = in_flight(workers), time.monotonic()  # tasks in flight: 2 per worker thread

        def submit() -> bool:
            for cell in todo:
                if cell.device.startswith("cuda") and not gpu:
                    skipped.append(cell)
                    continue
                fut = self.client.submit(work, cell, key=f"icl-cell-{cell.key}-{uuid.uuid4().hex[:8]}", pure=False,
                                         resources={"GPU": 1} if cell.device.startswith("cuda") else None)
                pending[fut] = cell
                return True
            return False

        skipped: list = []
        try:
            while len(pending) < window and submit():
                pass
            yield from ((c, None, ("skipped", NO_GPU)) for c in drain(skipped))
            for fut in self._finished(pending, wait):
                cell = pending[fut]  # (counted in flight by the messages until its row is here)
                if fut.status == "finished":
                    row, failure = self._gather(fut.result, pending), None
                else:  # a worker died `retries` + 1 times under it, or the task could not run at all
                    exc = self._gather(fut.exception, pending)
                    row, failure = None, ("error", " ".join(f"{type(exc).__name__}: {exc}".split()))
                del pending[fut]
                fut.release()
                if time.monotonic() - refreshed > 1.0:  # workers come and go (batch jobs, restarts)
                    try:
                        window, refreshed = in_flight(self.workers()), time.monotonic()
                    except Exception as exc:  # (OSError) the scheduler went away between two polls
                        raise self._lost(exc, pending) from None
                while len(pending) < window and submit():
                    pass
                yield cell, row, failure
                yield from ((c, None, ("skipped", NO_GPU)) for c in drain(skipped))
        finally:
            if pending and self.client.status == "running":  # interrupted: nothing more is computed for this run
                self.client.cancel(list(pending))

    def _finished(self, pending: dict, wait) -> Iterator:
        """The futures of `pending` as they finish (it may grow meanwhile), until it is empty.

        Raises:
            RunAborted: the client lost its scheduler (its futures are then cancelled, or it closes
                after failing to reconnect), where waiting on would never end.
        """
        idle, told = 0, False  # polls in a row with nothing finished; the no-worker line printed
        while pending:
            try:
                yield from wait(list(pending), timeout=POLL_S, return_when="FIRST_COMPLETED").done
                idle = 0
            except Exception as exc:  # TimeoutError: nothing finished within POLL_S
                if isinstance(exc, TimeoutError) and self.client.status in ("running", "connecting"):
                    idle += 1
                    told = self._say_waiting(idle, told, pending)
                    continue
                raise self._lost(exc, pending) from None

    def _gather(self, fetch: Callable, pending: dict):
        """fetch() (a finished future's result or exception, held by a worker) in polls of POLL_S, as
        _finished waits: a scheduler lost at that moment is a RunAborted (it was a CommClosedError,
        an OSError, reported as a bad --out path), and a result whose worker died is waited for
        with the same "no worker" line (it blocked without one; both found by a review)."""
        idle, told = 0, False
        while True:
            try:
                return fetch(timeout=POLL_S)
            except Exception as exc:
                if not (isinstance(exc, TimeoutError) and self.client.status in ("running", "connecting")):
                    raise self._lost(exc, pending) from None
                idle += 1
                told = self._say_waiting(idle, told, pending)

    def _say_waiting(self, idle: int, told: bool, pending: dict) -> bool:
        """After `idle` empty polls of POLL_S, say once (`told`: already said) that the cluster has no
        worker; returns whether it has been said."""
        if told or idle * POLL_S < WORKER_WAIT_S or self._alive():
            return told
        if self.cluster is not None:  # no one can start workers for the cluster this run started: waiting
            raise RunAborted(  # never ended (its nannies gave up restarting a worker killed at once; a review)
                f"executor: the local cluster has had no worker for {idle * POLL_S:g} s and none came back "
                f"({len(pending)} cells in flight; a cell that kills its worker on every attempt, e.g. out of memory, "
                "does this)")
        print(f"icl-bench: waiting: the cluster at {self.cfg.scheduler or 'the local cluster'} has no "
              f"worker ({len(pending)} cells in flight); start workers, or Ctrl-C and --resume later (a worker "
              "that closed on its first cell may lack icl-bench: see its log)", file=sys.stderr, flush=True)
        return True

    def _lost(self, exc: BaseException, pending: dict) -> RunAborted:
        """The one-line RunAborted of a run whose client lost its scheduler (`exc` says how)."""
        said = re.search(r"Message: ([^\n]*)", str(exc))  # distributed's FuturesCancelledError: "Client lost ..."
        why = said.group(1).strip() if said else (str(exc).splitlines() or [""])[0]
        return RunAborted(f"executor.scheduler: the run lost its Dask scheduler at "
                          f"{self.cfg.scheduler or 'the local cluster'} ({type(exc).__name__}: {why[:200]}) "
                          f"with {len(pending)} cells in flight")

    def _alive(self) -> bool:
        """Whether the cluster has a worker now (True when the scheduler cannot be asked)."""
        try:
            return bool(self.workers())
        except Exception:
            return True

    def close(self) -> None:
        if self.client is None:  # a LocalCluster never started, or interrupted while it started
            if self.cluster is not None:
                self.cluster.close()
            return
        log = logging.getLogger("distributed.client")
        level = log.level
        if self.client.status != "running":  # closing cancels its reconnection, which distributed logs
            log.setLevel(logging.CRITICAL)   # as an ERROR with a traceback: the run says what happened
        try:
            self.client.close()
        finally:
            log.setLevel(level)
            log.removeFilter(_quiet_reconnect)
        if self.cluster is not None:
            self.cluster.close()


def _connect(Client, address: str):
    """A Client of the scheduler at `address`, within HANDSHAKE_S.

    Raises:
        ConfigError: it cannot be reached (OSError / TimeoutError; TypeError from tls:// or ucx://
            without their setup), or what answers there is no Dask scheduler: an HTTP server (the
            dashboard's port) either never finishes distributed's handshake, which CONNECT_TIMEOUT does
            not bound (the run hung silently), or sends "HTTP/1.1" read as a message length (a
            MemoryError of exabytes); both found by a review.
    """
    done: dict = {}

    def connect():
        try:
            done["client"] = Client(address, timeout=CONNECT_TIMEOUT)
        except BaseException as exc:  # (reported by the caller's thread)
            done["error"] = exc

    thread = threading.Thread(target=connect, name="icl-bench-connect", daemon=True)
    thread.start()
    thread.join(HANDSHAKE_S)
    not_dask = "is it a Dask scheduler? (not its dashboard's http port, 8787 by default)"
    if thread.is_alive():
        raise ConfigError(f"executor.scheduler: {address!r} accepted the connection but no Dask scheduler answered within "
                          f"{HANDSHAKE_S:g} s; {not_dask}")
    exc = done.get("error")
    if exc is not None:
        hint = f"; {not_dask}" if isinstance(exc, MemoryError) else ""
        raise ConfigError(f"executor.scheduler: cannot connect to {address!r} "
                          f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]}){hint}")
    return done["client"]


def _quiet_reconnect(record: logging.LogRecord) -> bool:
    """A logging filter: drop distributed's "Failed to reconnect to scheduler ..." (the run says it)."""
    return not str(record.msg).startswith("Failed to reconnect to scheduler")


def make_executor(cfg: Executor):
    """The executor `cfg` names: a LocalExecutor, or a DaskExecutor connected to its scheduler (a
    LocalCluster starts when the first cell is submitted)."""
    return DaskExecutor(cfg) if cfg.kind == "dask" else LocalExecutor(cfg.exclusive_timing)
