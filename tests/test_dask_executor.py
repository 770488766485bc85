"""The dask executor on a LocalCluster (loopback, 2 worker processes): the same table as the local
executor in every non-timing column; a worker killed mid-run still gives every cell; a killed
driver leaves a folder that --resume completes; a cell that kills every worker becomes an error row."""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import dask
import pandas as pd
import pytest
import tomli_w
from distributed import Client, LocalCluster, WorkerPlugin

from icl_bench.bench.cells import expand_cells
from icl_bench.bench.config import Executor, parse_config
from icl_bench.bench.runner import run_matrix
from icl_bench.bench.schema import TIMING_COLUMNS
from icl_bench.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
RETRIES = 1  # worker deaths a cell survives before it becomes an error row (allowed-failures)

MIXED = {"seed": 5, "n_prompts": 40, "batch_size": 16, "timing": {"repeats": 1},
         "grid": {"N": [3, 9], "noise": [0.0, 0.3], "R": [10.0], "dtype": ["float32", "float64"],
                  "device": ["cpu", "cuda"]},
         "solvers": {"ols": {}, "scipy-lstsq": {}, "gd": {"steps": [1, 8]}, "ln-closed-form": {}, "trained-lsa": {}}}
# slow enough to kill something mid-cell (scipy-lstsq loops over prompts in Python), ~0.15 s a cell
SLOW = {"seed": 3, "n_prompts": 1000, "batch_size": 250, "timing": {"repeats": 1},
        "grid": {"N": list(range(4, 16)), "noise": [0.1], "R": [100.0], "dtype": ["float64"]},
        "solvers": {"scipy-lstsq": {}}}


class RegisterSuicide(WorkerPlugin):
    """Registers the solver `test-suicide` on every worker, restarted ones included."""

    def setup(self, worker):
        from icl_bench import Solver, register_solver

        class Suicide(Solver):
            """Kills its own process inside predict (stands in for a segfault / the OOM killer)."""

            params = {}

            def predict(self, batch):
                os.kill(os.getpid(), signal.SIGKILL)

        class GenExit(Solver):
            """Raises GeneratorExit, a BaseException that is neither SystemExit nor KeyboardInterrupt."""

            params = {}

            def predict(self, batch):
                raise GeneratorExit("from a plugin")

        class Huge(Solver):
            """Raises an exception with a 10^6-character message."""

            params = {}

            def predict(self, batch):
                raise ValueError("h" * 10**6)

        for name, cls in (("test-suicide", Suicide), ("test-genexit", GenExit), ("test-huge", Huge)):
            try:
                register_solver(name)(cls)
            except ValueError:  # this worker has it already
                pass


@pytest.fixture(scope="module")
def cluster():
    """(client, scheduler address) of a 2-process LocalCluster on 127.0.0.1, icl_bench imported."""
    with dask.config.set({"distributed.scheduler.allowed-failures": RETRIES}):
        lc = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                          dashboard_address=None, silence_logs=logging.CRITICAL)
    client = Client(lc)
    client.run(lambda: __import__("icl_bench.bench.runner"))  # torch & co. imported once, before any timing
    client.register_plugin(RegisterSuicide())
    assert set(client.run(lambda: __import__("icl_bench").__file__).values()) == {
        str(ROOT / "icl_bench" / "__init__.py")}  # the workers run the code under test
    yield client, lc.scheduler_address
    client.close()
    lc.close()


@pytest.fixture(scope="module")
def slow_reference() -> pd.DataFrame:
    """SLOW run uninterrupted, in this process."""
    return run_matrix(parse_config(SLOW), progress=False)


def _on(address: str, **kw) -> Executor:
    return Executor(kind="dask", scheduler=address, **kw)


def _stable(table: pd.DataFrame) -> pd.DataFrame:
    return table.drop(columns=list(TIMING_COLUMNS)).reset_index(drop=True)


def _n_stored(out: Path) -> int:
    try:
        db = sqlite3.connect(f"file:{out / 'cells.sqlite'}?mode=ro", uri=True)
        try:
            return db.execute("SELECT count(*) FROM cells").fetchone()[0]
        finally:
            db.close()
    except sqlite3.Error:
        return 0


def test_dask_table_equals_local_table_bit_for_bit(cluster, tmp_path):
    client, address = cluster
    cfg = parse_config(MIXED)
    local = run_matrix(cfg, tmp_path / "local", progress=False)
    table = run_matrix(cfg, tmp_path / "dask", progress=False, executor=_on(address, exclusive_timing=True))
    assert (local.status == "ok").sum() > 0 and set(local.status) == set(table.status)
    cuda = table.device == "cuda"  # skipped on both, for another reason: no GPU worker / no CUDA here
    assert table[cuda].message.str.contains("no Dask worker of this cluster declares a GPU resource").all()
    table.loc[cuda, "message"] = local.loc[cuda, "message"]
    pd.testing.assert_frame_equal(_stable(table), _stable(local), check_exact=True)
    a, b = (pd.read_csv(tmp_path / d / "results.csv", dtype=str, keep_default_na=False) for d in ("local", "dask"))
    a, b = (t[t.device == "cpu"].drop(columns=list(TIMING_COLUMNS)) for t in (a, b))
    assert len(a) == len(b) > 0 and a.equals(b)  # the CSV text too
    ran = table[table.status == "ok"]
    assert set(ran.executor) == {"dask"} and set(ran.worker) <= set(client.scheduler_info()["workers"])
    assert (ran.concurrency >= 1).all() and (local[local.status == "ok"].worker == "local").all()
    assert (table[cuda].status == "skipped").all()
    ex = json.loads((tmp_path / "dask" / "metadata.json").read_text())["executor"]  # the workers' torch threads, not
    threads = client.run(lambda: __import__("torch").get_num_threads())  # the driver's (a review); a running
    assert {a: w["torch_threads"] for a, w in ex["workers"].items()} == threads  # cluster's retries are its own
    assert ex["retries"] == "the cluster's own allowed-failures" and not ex["local_cluster"]
    # each worker's rows of the table: one that joined but computed nothing read like the others (a review)
    assert {a: w["cells"] for a, w in ex["workers"].items()} == {
        a: int((table.worker == a).sum()) for a in ex["workers"]} and sum(w["cells"] for w in ex["workers"].values()) == len(
        table[table.worker != ""])


def test_killing_a_worker_mid_run_still_gives_every_cell(cluster, slow_reference, tmp_path):
    client, address = cluster
    client.wait_for_workers(2)
    out, killed = tmp_path / "run", []

    def kill_a_busy_worker():
        deadline = time.monotonic() + 120
        while _n_stored(out) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        while time.monotonic() < deadline:  # a worker that is inside a cell right now
            busy = client.run(lambda dask_worker: (os.getpid(), len(dask_worker.state.executing)))
            pids = [pid for pid, n in busy.values() if n]
            if pids:
                os.kill(pids[0], signal.SIGKILL)
                killed.append(pids[0])
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_a_busy_worker)
    killer.start()
    table = run_matrix(parse_config(SLOW), out, progress=False, executor=_on(address))
    killer.join()
    assert killed, "no worker was caught inside a cell"
    assert len(table) == len(expand_cells(parse_config(SLOW))) and (table.status == "ok").all()
    pd.testing.assert_frame_equal(_stable(table), _stable(slow_reference))
    seen = json.loads((out / "metadata.json").read_text())["executor"]["workers"]
    assert set(table.worker) <= set(seen)  # metadata names every worker of the run, the killed one too


def _driver(cfg_path: Path, out: Path, address: str) -> subprocess.Popen:
    """`icl-bench run --config cfg_path --out out --scheduler address` as a subprocess (pipes, text)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "icl_bench", "run", "--config", str(cfg_path), "--out", str(out),
                             "--no-progress", "--scheduler", address], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_killing_the_driver_then_resume_gives_the_uninterrupted_table(cluster, slow_reference, tmp_path):
    client, address = cluster
    client.wait_for_workers(2)
    cfg_path, out = tmp_path / "slow.toml", tmp_path / "run"
    cfg_path.write_text(tomli_w.dumps(SLOW))
    total = len(expand_cells(parse_config(SLOW)))
    proc = _driver(cfg_path, out, address)
    deadline = time.monotonic() + 180
    while _n_stored(out) < 2:
        assert proc.poll() is None, f"run ended before it could be killed: {proc.communicate()}"
        assert time.monotonic() < deadline, "no cell finished in 180 s"
        time.sleep(0.005)
    proc.kill()  # SIGKILL: the driver dies, the cluster lives on
    proc.communicate()
    done = _n_stored(out)
    assert 2 <= done < total and not (out / "metadata.json").exists()
    table = run_matrix(parse_config(SLOW), out, resume=True, progress=False, executor=_on(address))
    assert json.loads((out / "metadata.json").read_text())["n_cells_reused"] == done
    pd.testing.assert_frame_equal(_stable(pd.read_parquet(out / "results.parquet")), _stable(table))
    pd.testing.assert_frame_equal(_stable(table), _stable(slow_reference))


def test_losing_the_scheduler_mid_run_ends_the_run_with_its_resume_line(tmp_path):
    """The scheduler goes away while cells are in flight: the run used to wait forever (found by a
    review); now it stops within seconds with one error line and the resume command, exit 1, and
    the finished cells stay stored."""
    with dask.config.set({"distributed.scheduler.allowed-failures": RETRIES}):
        lc = LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                          dashboard_address=":0", silence_logs=logging.CRITICAL)  # beside the module's cluster
    cfg_path, out = tmp_path / "slow.toml", tmp_path / "run"
    cfg_path.write_text(tomli_w.dumps(SLOW))
    proc = _driver(cfg_path, out, lc.scheduler_address)
    try:
        deadline = time.monotonic() + 180
        while _n_stored(out) < 2:
            assert proc.poll() is None, f"run ended before the scheduler went away: {proc.communicate()}"
            assert time.monotonic() < deadline, "no cell finished in 180 s"
            time.sleep(0.005)
    finally:
        lc.close()  # the scheduler (and its worker) go away; the driver lives on
    try:
        _, err = proc.communicate(timeout=120)  # was: no end
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    first, resume = err.splitlines()[-2:]
    assert first.startswith(f"icl-bench: error: --scheduler: the run lost its Dask scheduler at {lc.scheduler_address}"), err
    assert re.search(rf"; \d+ of \d+ cells finished, kept in {re.escape(str(out))}\. Resume with:$", first), err
    assert resume.strip().endswith("--resume"), err
    assert "Traceback" not in err and _n_stored(out) >= 2


def test_losing_the_scheduler_before_any_worker_came_is_one_line(tmp_path):
    """The scheduler goes away while the run waits for its first worker: that was "--out: OSError"
    (exit 2, a bad-input code, and distributed's log line); now one line, exit 1, no folder made."""
    lc = LocalCluster(n_workers=0, processes=True, host="127.0.0.1", dashboard_address=":0",
                      silence_logs=logging.CRITICAL)
    cfg_path, out = tmp_path / "tiny.toml", tmp_path / "run"
    cfg_path.write_text(tomli_w.dumps({**SLOW, "grid": {**SLOW["grid"], "N": [4]}}))
    proc = _driver(cfg_path, out, lc.scheduler_address)
    try:
        deadline = time.monotonic() + 120
        while len(lc.scheduler.clients) < 2:  # this process's client and the run's
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        time.sleep(0.5)  # the run is in wait_for_workers
    finally:
        lc.close()
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1 and err.count("\n") == 1, err  # (OSError or CommClosedError, as the loss goes)
    assert err.startswith(f"icl-bench: error: --scheduler: the run lost its Dask scheduler at "
                          f"{lc.scheduler_address} while waiting for its first worker (") and err.endswith(
                          f") before {out} was made\n"), err
    assert not out.exists()


def test_a_scheduler_with_no_worker_says_it_waits_then_gives_up_in_one_line(monkeypatch, capsys):
    """A --scheduler whose cluster has no worker: the run waited WORKER_WAIT_S (60 s) in silence
    before its error; it now says that it waits after WORKER_NOTE_S, then refuses (ConfigError, the
    command's exit 2) naming how to start a worker."""
    from icl_bench.bench import executors

    monkeypatch.setattr(executors, "WORKER_WAIT_S", 2.0)
    monkeypatch.setattr(executors, "WORKER_NOTE_S", 0.5)
    with LocalCluster(n_workers=0, processes=True, host="127.0.0.1", dashboard_address=":0",
                      silence_logs=logging.CRITICAL) as lc:
        started = time.monotonic()
        with pytest.raises(ConfigError, match=rf"^executor.scheduler: the cluster at '{lc.scheduler_address}' has no "
                                              rf"worker after 2 s; start some \(dask worker {lc.scheduler_address} "):
            executors.DaskExecutor(Executor(kind="dask", scheduler=lc.scheduler_address))
        assert 1.9 < time.monotonic() - started < 30
    assert capsys.readouterr().err == (f"icl-bench: waiting up to 2 s for a first worker of the cluster at "
                                       f"{lc.scheduler_address}\n")


def test_distributeds_reconnect_error_line_is_dropped_while_the_run_reports_the_loss():
    """The test above failed once in a fresh-clone CI run: distributed's client logged "Failed to
    reconnect to scheduler after 10.00 seconds, closing client" (an ERROR line) before the run's own
    one line. That message, as distributed.client writes it, is dropped; other records pass."""
    import inspect

    import distributed.client
    from icl_bench.bench.executors import _quiet_reconnect

    assert '"Failed to reconnect to scheduler after %.2f seconds, closing client"' in inspect.getsource(distributed.client)
    rec = lambda msg: logging.LogRecord("distributed.client", logging.ERROR, "", 0, msg, (10.0,), None)  # noqa: E731
    assert not _quiet_reconnect(rec("Failed to reconnect to scheduler after %.2f seconds, closing client"))
    assert _quiet_reconnect(rec("Some other client error %s"))


def test_a_cell_that_kills_every_worker_becomes_an_error_row(cluster, tmp_path):
    client, address = cluster
    client.wait_for_workers(2)
    raw = {"n_prompts": 8, "batch_size": 8, "timing": {"repeats": 1}, "grid": {"N": [4]},
           "solvers": {"ols": {}}}
    cfg = parse_config(raw)
    cfg.solvers["test-suicide"] = [{}]  # registered on the workers only (RegisterSuicide)
    table = run_matrix(cfg, tmp_path / "run", progress=False, executor=_on(address))
    bad = table[table.solver == "test-suicide"].iloc[0]
    assert bad.status == "error" and bad.message.startswith("KilledWorker")
    assert (table[table.solver == "ols"].status == "ok").all()
    stored = pd.read_parquet(tmp_path / "run" / "results.parquet")
    assert list(stored.status) == list(table.status)


def test_a_generatorexit_or_a_huge_message_on_a_worker_is_a_short_error_row(cluster, tmp_path):
    client, address = cluster
    raw = {"n_prompts": 8, "batch_size": 8, "timing": {"repeats": 1}, "grid": {"N": [4, 6]},
           "solvers": {"ols": {}}}
    cfg = parse_config(raw)
    cfg.solvers["test-genexit"] = [{}]  # registered on the workers only (RegisterSuicide)
    cfg.solvers["test-huge"] = [{}]
    table = run_matrix(cfg, tmp_path / "run", progress=False, executor=_on(address))
    gen, huge = (table[table.solver == n] for n in ("test-genexit", "test-huge"))
    assert (gen.status == "error").all() and gen.message.str.startswith("GeneratorExit: from a plugin").all()
    assert (huge.status == "error").all() and huge.message.str.contains("h… (1000000 characters)", regex=False).all()
    assert (huge.message.str.len() < 600).all()
    assert len(table) == 6 and (table[table.solver == "ols"].status == "ok").all()


def test_bad_executor_flags_exit_2_and_write_nothing(tmp_path, monkeypatch, capsys):
    from icl_bench.bench import executors
    from icl_bench.cli import main

    monkeypatch.setattr(executors, "CONNECT_TIMEOUT", "1s")
    cfg = tmp_path / "c.toml"
    cfg.write_text('n_prompts = 8\nbatch_size = 8\n[grid]\nN = [4]\n[solvers.ols]\n')
    cases = [(["--executor", "banana"], "--executor: unknown value 'banana'; accepted: local, dask"),
             (["--workers", "0", "--executor", "dask"], "--workers: must be >= 1"),
             (["--scheduler", "tcp://127.0.0.1:1"], "icl-bench: error: --scheduler: cannot connect to 'tcp://127.0.0.1:1'"),
             (["--scheduler", "tls://127.0.0.1:1"], "icl-bench: error: --scheduler: cannot connect to 'tls://127.0.0.1:1' (TypeError"),
             (["--scheduler", " "], "icl-bench: error: --scheduler: empty address"),  # was: a local run
             # --workers alone means a LocalCluster (it was ignored: a local run); too many for this machine
             ([f"--workers={4 * (os.cpu_count() or 1) + 1}"], f"--workers: {4 * (os.cpu_count() or 1) + 1} LocalCluster processes"),
             (["--workers", "2", "--executor", "local"], "--workers: only with --executor dask, not --executor local"),
             (["--scheduler", "tcp://127.0.0.1:1", "--executor", "local"], "--scheduler: only with --executor dask")]
    for flags, expected in cases:  # the flag the user typed is named, not the config key it set
        out = tmp_path / "o"
        assert main(["run", "--config", str(cfg), "--out", str(out), "--no-progress", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("icl-bench: error: ") and expected in err and err.count("\n") == 1, err
        assert not out.exists()
    monkeypatch.setitem(sys.modules, "distributed", None)  # dask not installed: the flag typed is named, not
    for flags in (["--workers", "2"], ["--scheduler", "tcp://127.0.0.1:1"], ["--executor", "dask"]):  # executor.kind
        assert main(["run", "--config", str(cfg), "--out", str(tmp_path / "o"), "--no-progress", *flags]) == 2
        assert capsys.readouterr().err == (f'icl-bench: error: {flags[0]}: "dask" needs the optional packages dask and '
                                           'distributed (pip install -e ".[dask]" in the icl-bench checkout)\n')


def _stub_executor(monkeypatch, cfg, cluster=None):
    """A DaskExecutor with no cluster behind it: a running client, no worker alive, WORKER_WAIT_S 3 s
    (`cluster`: None for --scheduler, anything else for the LocalCluster the run started)."""
    from icl_bench.bench import executors

    monkeypatch.setattr(executors, "WORKER_WAIT_S", 3.0)
    ex = executors.DaskExecutor.__new__(executors.DaskExecutor)
    ex.cfg, ex.client = cfg, SimpleNamespace(status="running")
    ex._alive, ex.cluster = (lambda: False), cluster
    return ex


def _done_after(polls: int | None):
    """A distributed.wait stand-in: nothing finishes for polls - 1 calls, then every future (None:
    never; after 100 calls an AssertionError, so a run that waits forever fails the test, not hangs)."""
    calls = []

    def wait(futures, timeout, return_when):
        calls.append(1)
        assert len(calls) <= 100, "still waiting after 100 polls: the run would never end"
        if polls is None or len(calls) < polls:
            raise TimeoutError
        return SimpleNamespace(done=set(futures))
    return wait


def test_a_run_whose_cluster_has_no_worker_left_says_so_once(monkeypatch, capsys):
    # every worker died and none came back: the scheduler keeps the cells queued and the driver
    # would wait in silence; after WORKER_WAIT_S it prints one line (and keeps waiting)
    ex = _stub_executor(monkeypatch, Executor(kind="dask", scheduler="tcp://h:1"))
    pending = {"f": None}
    assert [pending.pop(f) or f for f in ex._finished(pending, _done_after(8))] == ["f"]  # the caller pops what finished
    err = capsys.readouterr().err
    assert err == ("icl-bench: waiting: the cluster at tcp://h:1 has no worker (1 cells in flight); start workers, "
                   "or Ctrl-C and --resume later (a worker that closed on its first cell may lack icl-bench: see its log)\n")


def test_a_local_cluster_left_without_workers_ends_the_run(monkeypatch):
    """A LocalCluster whose workers a cell killed on every attempt sometimes got none back (its nanny
    gave up restarting): the run printed "start workers" and waited forever, though no one can start
    workers for a cluster the run started itself (found by a review). After WORKER_WAIT_S without a
    worker it ends as a RunAborted (exit 1, the finished cells kept, the resume line)."""
    from icl_bench.errors import RunAborted

    ex = _stub_executor(monkeypatch, Executor(kind="dask", n_workers=2), cluster=object())
    with pytest.raises(RunAborted, match=r"^executor: the local cluster has had no worker for 3 s and none came back "
                                         r"\(2 cells in flight; a cell that kills its worker"):
        list(ex._finished({"a": 0, "b": 1}, _done_after(None)))
    ex._alive = lambda: True  # a cell that runs long on a live worker is waited for
    pending = {"a": None}
    assert [pending.pop(f) or f for f in ex._finished(pending, _done_after(8))] == ["a"]  # the caller pops what finished


def test_the_local_cluster_queues_no_cell_behind_a_running_one(monkeypatch):
    """A cell that kills its worker on every attempt took the cells queued behind it on that worker
    down too (KilledWorker rows for healthy cells; a review): the LocalCluster's scheduler is made
    with worker-saturation 1.0, one cell per one-thread worker, and the run's retries."""
    import dask
    import distributed

    from icl_bench.bench import executors

    seen = {}

    class Stop(Exception):
        pass

    def cluster(**kwargs):
        seen.update(saturation=dask.config.get("distributed.scheduler.worker-saturation"),
                    failures=dask.config.get("distributed.scheduler.allowed-failures"), **kwargs)
        raise Stop
    monkeypatch.setattr(distributed, "LocalCluster", cluster)
    with pytest.raises(Stop):
        executors.DaskExecutor(Executor(kind="dask", n_workers=2, retries=1)).workers()  # (started on first use)
    assert seen["saturation"] == 1.0 and seen["failures"] == 1 and seen["threads_per_worker"] == 1


def test_a_result_lost_with_the_scheduler_is_a_run_aborted_and_a_dead_workers_result_is_waited_for(monkeypatch, capsys):
    """wait() can report a future done just before the scheduler dies; fetching its result then raised
    CommClosedError (an OSError), reported as "--out: CommClosedError", exit 2, no resume line; and a
    result held by a worker that died blocked without the "no worker" line (found by a review)."""
    from distributed.comm.core import CommClosedError

    from icl_bench.bench import executors
    from icl_bench.errors import RunAborted

    monkeypatch.setattr(executors, "WORKER_WAIT_S", 3.0)
    ex = executors.DaskExecutor.__new__(executors.DaskExecutor)
    ex.cfg, ex.client = Executor(kind="dask", scheduler="tcp://h:1"), SimpleNamespace(status="running")
    ex._alive, ex.cluster = (lambda: False), None

    def closed(timeout):
        raise CommClosedError("in <TCP (closed) ConnectionPool.gather>: Stream is closed")

    with pytest.raises(RunAborted, match=r"^executor.scheduler: the run lost its Dask scheduler at tcp://h:1 "
                                         r"\(CommClosedError: in <TCP \(closed\) ConnectionPool.gather>: Stream is closed\) "
                                         r"with 2 cells in flight$"):
        ex._gather(closed, {"a": 0, "b": 1})
    polls = []

    def late(timeout):  # the row comes once a worker is back, after 5 polls
        polls.append(timeout)
        if len(polls) < 5:
            raise TimeoutError
        return {"row": 1}

    assert ex._gather(late, {"a": 0}) == {"row": 1} and polls == [executors.POLL_S] * 5
    assert capsys.readouterr().err == ("icl-bench: waiting: the cluster at tcp://h:1 has no worker (1 cells in flight); "
                                       "start workers, or Ctrl-C and --resume later (a worker that closed on its first "
                                       "cell may lack icl-bench: see its log)\n")


def test_a_scheduler_address_where_no_dask_scheduler_answers_is_one_line(monkeypatch):
    """--scheduler at a port that accepts but never speaks Dask (an HTTP server, the dashboard's port)
    hung forever: CONNECT_TIMEOUT does not bound the handshake (found by a review)."""
    import socket

    from icl_bench.bench import executors
    from icl_bench.errors import ConfigError

    monkeypatch.setattr(executors, "HANDSHAKE_S", 2.0)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)  # the kernel completes the TCP connection; nothing is ever sent back
    address = f"tcp://127.0.0.1:{server.getsockname()[1]}"
    try:
        start = time.monotonic()
        with pytest.raises(ConfigError, match=rf"^executor.scheduler: '{address}' accepted the connection but no Dask "
                                              r"scheduler answered within 2 s; is it a Dask scheduler\? \(not its dashboard"):
            executors.DaskExecutor(Executor(kind="dask", scheduler=address))
        assert time.monotonic() - start < 10
    finally:
        server.close()


def test_ctrl_c_of_a_local_cluster_run_is_the_resume_line_alone(tmp_path):
    """A terminal's Ctrl-C reaches the whole process group: each LocalCluster worker printed its own
    KeyboardInterrupt tracebacks, 68-89 lines before the resume line (found by a review). The workers
    start with SIGINT ignored: the run alone stops, closes its cluster and says how to resume."""
    cfg_path, out = tmp_path / "slow.toml", tmp_path / "run"
    cfg_path.write_text(tomli_w.dumps(SLOW))
    proc = subprocess.Popen([sys.executable, "-m", "icl_bench", "run", "--config", str(cfg_path), "--out", str(out),
                             "--no-progress", "--workers", "2"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while _n_stored(out) < 2:  # the cluster is up and cells are coming back
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal does
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    resume = err[err.find("icl-bench: interrupted"):]  # distributed itself may log a line or two first on a loaded
    assert proc.returncode == 130 and re.match(rf"icl-bench: interrupted; \d+ of \d+ cells finished, kept in "
                                               rf"{re.escape(str(out))}\. Resume with:\n", resume), err  # machine
    assert resume.count("\n") == 2, err
    assert "nanny.py" not in err, err  # no worker's traceback (its Nanny's frames); a review saw distributed's own
    # lines in 3 of 10 runs at load 4-5 (a heartbeat error, now silenced; a cancelled sync() call)


def test_metadata_names_the_torch_threads_the_cells_ran_with():
    """A cell runs under timing.threads and restores the worker's count after it, so asking an idle
    worker after the run gave its default (1) for a run at threads = 2 (found by a review): the
    config's count is recorded when set, the worker's own default only for threads = 0."""
    from icl_bench.bench import executors

    ex = executors.DaskExecutor.__new__(executors.DaskExecutor)
    ex.cfg, ex.cluster, ex.seen = Executor(kind="dask", scheduler="tcp://h:1"), None, {}
    info = {"workers": {"tcp://w:1": {"host": "w", "nthreads": 1}, "tcp://w:2": {"host": "w", "nthreads": 1}}}
    ex.client = SimpleNamespace(scheduler_info=lambda n_workers: info, run=lambda f: {"tcp://w:1": 1, "tcp://w:2": 1},
                                scheduler=SimpleNamespace(address="tcp://h:1"))
    assert {a: w["torch_threads"] for a, w in ex.describe(threads=2)["workers"].items()} == {"tcp://w:1": 2, "tcp://w:2": 2}
    assert {a: w["torch_threads"] for a, w in ex.describe(threads=0)["workers"].items()} == {"tcp://w:1": 1, "tcp://w:2": 1}


def test_a_local_cluster_starts_only_for_cells_to_compute_and_after_the_out_check(tmp_path, monkeypatch, capsys):
    """--workers started its LocalCluster (about 20 s) before --out was checked, so a busy --out was
    refused only after it, and a resume with every cell stored started one for nothing (a review).
    Both now finish without starting one, as does a resume with only cuda cells left on a machine
    without a GPU; the resumed table is the stored one."""
    import distributed

    from icl_bench.bench import store

    from icl_bench.errors import ConfigError

    tiny = {**SLOW, "n_prompts": 50, "grid": {**SLOW["grid"], "N": [4, 5]}}
    out = tmp_path / "run"
    first = run_matrix(parse_config(tiny), out, progress=False)

    def no_cluster(**kwargs):
        raise AssertionError("a LocalCluster was started")
    monkeypatch.setattr(distributed, "LocalCluster", no_cluster)
    local = Executor(kind="dask", n_workers=2)
    again = run_matrix(parse_config(tiny), out, resume=True, progress=False, executor=local)
    pd.testing.assert_frame_equal(again, first)
    executor = json.loads((out / "metadata.json").read_text())["executor"]
    assert executor["local_cluster"] is True and executor["workers"] == {} and executor["scheduler"] is None
    import torch

    cuda = {**tiny, "grid": {**tiny["grid"], "device": ["cpu", "cuda"]}}  # only cuda cells left, no GPU:
    if not torch.cuda.is_available():  # skipped without a cluster (one started just to write skipped rows)
        table = run_matrix(parse_config(cuda), out.parent / "cuda", progress=False)
        table = run_matrix(parse_config(cuda), out.parent / "cuda", resume=True, progress=False, executor=local)
        assert (table[table.device == "cuda"].status == "skipped").all() and (table[table.device == "cpu"].status == "ok").all()
    lock = store.prepare(out, resume=True, config_json=None)  # another run holds the folder
    try:
        with pytest.raises(ConfigError, match="--out"):
            run_matrix(parse_config(tiny), out, resume=True, progress=False, executor=local)
    finally:
        lock.close()


def test_workers_that_cannot_import_icl_bench_are_named_before_the_run(cluster, monkeypatch, tmp_path):
    """A worker whose Python lacks icl-bench closes on its first cell (the task does not unpickle),
    and a cluster of only such workers kept the run waiting forever on "has no worker" (a review).
    The executor asks every worker first: none can -> one ConfigError before anything is written;
    some cannot -> a warning naming them (the cells are retried on the others). Here the package
    asked for is one that no worker has."""
    from icl_bench.bench import executors

    _, address = cluster
    assert executors.DaskExecutor(_on(address)).close() is None  # the real package: no word
    monkeypatch.setattr(executors, "PACKAGE", "no_such_package_icl")
    with pytest.raises(ConfigError, match=r"^executor\.scheduler: no worker of the cluster at '[^']+' can import "
                                          r"no_such_package_icl \(tcp://[^:]+:\d+: ModuleNotFoundError: No module named "
                                          r"'no_such_package_icl'; tcp://.*\); install icl-bench in the workers' Python "
                                          r"environment \(docs/scale-out\.md\)$"):
        executors.DaskExecutor(_on(address))
    ex = executors.DaskExecutor.__new__(executors.DaskExecutor)
    ex.cfg, ex.cluster = _on("tcp://h:1"), None
    ex.client = SimpleNamespace(run=lambda *a, **k: {"tcp://a:1": ModuleNotFoundError("No module named 'x'"),
                                                     "tcp://b:2": "0.1.0"})
    with pytest.warns(UserWarning, match=r"^1 of 2 workers of the cluster at tcp://h:1 cannot import no_such_package_icl "
                                         r"\(tcp://a:1: ModuleNotFoundError: No module named 'x'\): each closes on its "
                                         r"first cell, which is then retried on another worker"):
        ex._check_workers()


def test_executor_flags_replace_the_table_keys_they_contradict(tmp_path, monkeypatch):
    """docs/scale-out.md: the flags override the config's [executor] table; a table's n_workers
    refused --scheduler, and its scheduler refused --executor local (a review). The executor the
    run gets is recorded here instead of started."""
    from icl_bench.bench import runner
    from icl_bench.bench.executors import LocalExecutor
    from icl_bench.cli import main

    got = []
    monkeypatch.setattr(runner, "make_executor", lambda cfg: got.append(cfg) or LocalExecutor())
    base = 'n_prompts = 8\nbatch_size = 8\n[grid]\nN = [4]\ndevice = ["cpu"]\n[solvers.ols]\n'
    cases = [('kind = "dask"\nn_workers = 3\nretries = 1\n', ["--scheduler", "tcp://127.0.0.1:8786"],
              {"kind": "dask", "scheduler": "tcp://127.0.0.1:8786", "n_workers": 2, "retries": 2}),
             ('kind = "dask"\nscheduler = "tcp://127.0.0.1:8786"\n', ["--executor", "local"],
              {"kind": "local", "scheduler": ""}),
             ('kind = "dask"\nscheduler = "tcp://127.0.0.1:8786"\n', ["--workers", "3"],
              {"kind": "dask", "scheduler": "", "n_workers": 3}),
             ('kind = "dask"\nn_workers = 3\n', ["--exclusive-timing"], {"kind": "dask", "n_workers": 3})]  # nothing contradicted
    for n, (table, flags, expected) in enumerate(cases):
        cfg = tmp_path / f"c{n}.toml"
        cfg.write_text(base + "[executor]\n" + table)
        assert main(["run", "--config", str(cfg), "--out", str(tmp_path / f"o{n}"), "--no-progress", *flags]) == 0
        assert {k: getattr(got[-1], k) for k in expected} == expected, (flags, got[-1])
