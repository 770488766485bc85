"""pytest options, JSON destination and machine description of the throughput suite.

Options (besides pytest-benchmark's own, e.g. --benchmark-max-time, --benchmark-min-rounds):
    --bench-values V     context values (B x N) per call: a case at context length N gets
                         B = V // N prompts (default 2**20: B = 1048 at N = 1000), so every N
                         moves the same amount of data and the scaling t(4000) / t(1000) is not
                         confounded by the batch outgrowing the cache
    --bench-batch B      a fixed number of prompts per call instead (0 = use --bench-values)
    --bench-budget S     seconds one call may take; slower cases get fewer prompts (default 0.3)
    --torch-threads K    torch.set_num_threads(K) for the run (default 1; 0 = torch's own choice).
                         One thread matches the single-threaded numpy / scipy references, and on
                         a shared machine torch's thread pool stalls at every op's barrier while
                         the other cores are busy (docs/throughput.md has the measurement).
Without --benchmark-json the JSON goes to results/runs/throughput/<UTC time>.json (not committed);
`python -m benchmarks.experiments.summarize` reads the newest one there by default. The JSON gains, beside
pytest-benchmark's machine_info, an "icl_bench" block: CPU model, cores, torch / numpy / scipy
versions, torch threads, CUDA device (or why none), git commit, the load average when the run
started and ended, the options above, and every skipped case with its reason.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch

from icl_bench.provenance import cpu_model, git_commit
from icl_bench.solvers import fused, fused_cpu

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON_DIR = ROOT / "results" / "runs" / "throughput"
_RUN: dict = {"skipped": []}


@dataclass(frozen=True)
class BenchOptions:
    values: int  # context values per call (B = values // N) unless `fixed_batch`
    fixed_batch: int  # prompts per call at every N (0: derive from `values`)
    budget: float  # seconds one call may take before its batch is reduced

    def batch(self, N: int) -> int:
        """Prompts per call for cases at context length N (before any budget reduction)."""
        return self.fixed_batch or max(1, self.values // N)


def pytest_addoption(parser):
    group = parser.getgroup("icl-bench throughput")
    group.addoption("--bench-values", type=int, default=2**20, help="context values per call: B = this // N (default 2**20)")
    group.addoption("--bench-batch", type=int, default=0, help="fixed prompts per call at every N (default 0: use --bench-values)")
    group.addoption("--bench-budget", type=float, default=0.3, help="seconds one call may take; slower cases get fewer prompts")
    group.addoption("--torch-threads", type=int, default=1, help="torch.set_num_threads for the run (default 1; 0: torch's default)")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    threads = config.getoption("--torch-threads")
    if threads:
        torch.set_num_threads(threads)
    _RUN["loadavg_start"] = os.getloadavg()
    _RUN["started_at"] = datetime.now(timezone.utc).isoformat()
    wanted = not (config.getoption("collectonly") or config.getoption("benchmark_disable", False))
    if wanted and config.getoption("benchmark_json", None) is None:
        DEFAULT_JSON_DIR.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        config.option.benchmark_json = open(DEFAULT_JSON_DIR / f"{stamp}.json", "wb")  # noqa: SIM115 (pytest-benchmark closes it)


@pytest.fixture(scope="session")
def bench_opts(pytestconfig) -> BenchOptions:
    return BenchOptions(pytestconfig.getoption("--bench-values"), pytestconfig.getoption("--bench-batch"),
                        pytestconfig.getoption("--bench-budget"))


def pytest_runtest_logreport(report):
    if report.skipped and report.when in ("setup", "call"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if "--benchmark-only" not in reason:
            _RUN["skipped"].append({"test": report.nodeid, "reason": reason.removeprefix("Skipped: ")})


def _cpu_arch() -> str:
    """The CPU as the kernels' compiler sees it (LLVM's host name, e.g. znver3), its widest
    vector instructions and the vector width numba's code generator was allowed
    (icl_bench/solvers/fused_cpu.py): the fused kernels' speed depends on all three
    (docs/throughput.md)."""
    try:
        import llvmlite.binding as llvm

        name = llvm.get_host_cpu_name()
    except Exception:  # noqa: BLE001 - llvmlite missing or unusable: say so, do not fail the run
        name = "?"
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), [])
    except OSError:
        flags = []
    widest = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "?"
    vectors = f"; numba vectors: {fused_cpu.describe()}" if fused.available() else ""
    return f"{name}, {widest}{vectors}"


def _own_output(config) -> tuple:
    """The --benchmark-json file (pytest-benchmark empties it as the run starts: a committed
    results/raw/throughput.json being rewritten made every documented run read "-dirty")."""
    out = config.getoption("--benchmark-json", None)
    name = getattr(out, "name", out)
    return (name,) if isinstance(name, (str, bytes, os.PathLike)) else ()


def machine_description(config) -> dict:
    import numpy
    import scipy

    cuda = torch.cuda.is_available()
    return {
        "cpu_model": cpu_model(),
        "cpu_arch": _cpu_arch(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "numpy": numpy.__version__, "scipy": scipy.__version__,
        "cuda_device": torch.cuda.get_device_name(0) if cuda else None,
        "cuda_note": "" if cuda else "no CUDA device on this machine (no GPU was lent to this run): cuda cases skipped",
        "git_commit": git_commit(ROOT, ignore=_own_output(config)),
        "options": {"bench_values": config.getoption("--bench-values"), "bench_batch": config.getoption("--bench-batch"),
                    "bench_budget": config.getoption("--bench-budget"),
                    "torch_threads_option": config.getoption("--torch-threads")},
    }


def pytest_benchmark_update_json(config, benchmarks, output_json):
    output_json["icl_bench"] = {**machine_description(config), **_RUN, "loadavg_end": os.getloadavg(),
                                "finished_at": datetime.now(timezone.utc).isoformat()}
