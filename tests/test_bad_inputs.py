"""The bad-input catalogue: TOML configs, CLI flags, CSV data, run folders and checkpoint files.

Every command-line case must give exactly one line `icl-bench: error: <field>: <problem>` on
stderr, exit code 2, no traceback, nothing on stdout, and leave --out as it was: a fresh --out is
not created, and a finished run already in --out (resumed with --resume) stays byte-identical.
Checkpoint cases go through `load_checkpoint` (what every command uses to read one: a one-line
ConfigError) and `icl-bench analyze CHECKPOINT --out FILE.json` (exit 2, FILE.json neither created
nor changed); the checkpoint files stay as they were and no pickle is ever executed.
"""
from __future__ import annotations

import copy
import gzip
import io
import json
import math
import os
import pickle
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd
import pytest
import tomli_w
import torch
from safetensors.torch import save_file

from icl_bench.bench import store
from icl_bench.solvers.checkpoint import load_checkpoint, save_checkpoint
from icl_bench.cli import main
from icl_bench.bench.config import parse_config
from icl_bench.errors import ConfigError
from icl_bench.bench.runner import run_matrix
from icl_bench.solvers.transformer import Transformer, TransformerConfig

BASE = {"seed": 0, "n_prompts": 16, "batch_size": 16, "timing": {"repeats": 1},
        "grid": {"N": [4], "noise": [0.1], "R": [10.0], "dtype": ["float64"]}, "solvers": {"ols": {}}}


@dataclass
class Case:
    id: str
    argv: Callable[[Path], list[str]] | None  # tmp folder -> arguments (the harness adds --out);
    # tmp/"input-run" is a copy of a finished run the case may use (or damage) as an input
    expected: str  # the line after "icl-bench: error: " starts with this (field first)
    resume: bool = True  # add the command's "go ahead" flag when --out already holds files
    fresh: bool = True  # also try it with a fresh --out (not for "--out holds a run" cases)
    out: bool = True  # the harness adds --out (not when argparse must see nothing else)
    damage: Callable[[Path], None] | None = None  # checkpoint cases: breaks the pair <stem>.*
    flags: tuple[str, ...] | None = None  # checkpoint cases: `icl-bench analyze <stem> *flags`
    api: bool = True  # checkpoint cases: load_checkpoint itself must refuse the damaged pair


def _set(raw, value, *path):
    d = raw
    for k in path[:-1]:
        d = d.setdefault(k, {})
    d[path[-1]] = value
    return raw


def toml(edit: Callable[[dict], object] | None = None, text: str | bytes | None = None):
    """A case's argv: `run --config FILE`, FILE = BASE after `edit`, or the literal text / bytes."""
    def argv(tmp: Path) -> list[str]:
        path = tmp / "bad.toml"
        if text is not None:
            path.write_bytes(text if isinstance(text, bytes) else text.encode())
        else:
            raw = copy.deepcopy(BASE)
            edit(raw)
            path.write_text(tomli_w.dumps(raw))
        return ["run", "--config", str(path), "--no-progress"]
    return argv


def toml_csv(edit: Callable[[dict], object]):
    """toml(edit) for a config with CSV prompts: BASE without its noise grid (refused beside [data])."""
    return toml(lambda r: (r["grid"].pop("noise"), edit(r)))


def csv(content: str | bytes | None, x: str = "x", y: str = "y", name: str = "data.csv"):
    """A case's argv: `run --config BASE --data FILE --x X --y Y` with FILE holding `content`."""
    def argv(tmp: Path) -> list[str]:
        path = tmp / name
        if content is not None:
            path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return [*toml_csv(lambda r: None)(tmp), "--data", str(path), "--x", x, "--y", y]
    return argv


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def data_table(edit: Callable[[dict], object]):
    """A case's argv: `run --config FILE`, FILE = BASE without its noise grid, with a [data] table
    of a good CSV file, after `edit`."""
    def argv(tmp: Path) -> list[str]:
        (tmp / "data.csv").write_text(ROWS)
        return toml_csv(lambda r: (_set(r, {"path": str(tmp / "data.csv"), "x": "x", "y": "y"}, "data"), edit(r)))(tmp)
    return argv


def flags(*args: str):
    """A case's argv: `run --config BASE` plus `args`."""
    return lambda tmp: [*toml(lambda r: None)(tmp), *args]


RUN_AT = "{tmp}/"  # replaced by the case's tmp folder
PARQUET = f"RUN_DIR: {RUN_AT}input-run/results.parquet"


def damaged(name: str, content: bytes | None):
    """A case's argv: `publish RUN` where RUN is a finished run whose file `name` is replaced by
    `content` (None: deleted)."""
    def argv(tmp: Path) -> list[str]:
        target = tmp / "input-run" / name
        target.unlink()
        if content is not None:
            target.write_bytes(content)
        return ["publish", str(tmp / "input-run")]
    return argv


def _zip(*files: tuple[str, str]) -> bytes:
    """A .zip archive's bytes holding `files` (name, text)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, text in files:
            z.writestr(name, text)
    return buf.getvalue()


def edited(**columns):
    """A case's argv: `publish RUN` where RUN's results.parquet has `columns` replaced (a hand-edited
    or foreign table: every value of each named column set to the given one)."""
    def argv(tmp: Path) -> list[str]:
        path = tmp / "input-run" / "results.parquet"
        table = pd.read_parquet(path)
        for name, value in columns.items():
            table[name] = pd.Series([value] * len(table), dtype=object if value is None or isinstance(value, str) else None)
        table.to_parquet(path)
        return ["publish", str(tmp / "input-run")]
    return argv


def readme(content: bytes):
    """A case's argv: `publish RUN --readme FILE` with FILE holding `content`."""
    def argv(tmp: Path) -> list[str]:
        (tmp / "README.md").write_bytes(content)
        return ["publish", str(tmp / "input-run"), "--readme", str(tmp / "README.md")]
    return argv


ROWS = "x,y\n" + "".join(f"{i},{2 * i + 1}\n" for i in range(12))
MSFT = {"path": "matplotlib:msft.csv", "x": "Open", "y": "Close"}

CASES = [
    # ---- TOML config: keys, types, ranges, names ----
    Case("toml-unknown-top-key", toml(lambda r: _set(r, 1, "sed")), "sed: unknown key; accepted: seed, n_prompts"),
    Case("toml-unknown-grid-key", toml(lambda r: _set(r, [1], "grid", "M")), "grid.M: unknown key; accepted: N, noise, R, dtype, device"),
    Case("toml-top-key-below-grid", toml(text="[grid]\nN = [10]\nn_prompts = 256\n"),  # TOML put it in [grid]
         "grid.n_prompts: unknown key; accepted: N, noise, R, dtype, device, d, ood; `n_prompts` is a top-level key: "
         "write it above the first [table] header"),
    Case("toml-top-key-below-solver", toml(text="[solvers.gd]\nsteps = [1]\nseed = 3\n"),
         "solvers.gd.seed: unknown parameter; accepted: steps, lr, variant; `seed` is a top-level key"),
    Case("toml-table-name-below-grid", toml(text="[grid]\nN = [10]\ngrid = 3\n"),  # (a table's name: no hint)
         "grid.grid: unknown key; accepted: N, noise, R, dtype, device, d, ood\n"),
    Case("toml-grid-key-typo", toml(text="[grid]\ndevices = [\"cpu\"]\n"),
         "grid.devices: unknown key; accepted: N, noise, R, dtype, device, d, ood; did you mean 'device'?"),
    Case("toml-solver-param-typo", toml(text="[solvers.gd]\nstep = [1]\n"),
         "solvers.gd.step: unknown parameter; accepted: steps, lr, variant; did you mean 'steps'?"),
    Case("toml-grid-not-table", toml(lambda r: _set(r, [1, 2], "grid")), "grid: must be a table (got list)"),
    Case("toml-seed-text", toml(lambda r: _set(r, "zero", "seed")), "seed: expected an integer >= 0"),
    Case("toml-seed-huge", toml(lambda r: _set(r, 2**70, "seed")), "seed: must be <= 9223372036854775807"),
    Case("toml-n_prompts-zero", toml(lambda r: _set(r, 0, "n_prompts")), "n_prompts: must be >= 1"),
    Case("toml-n_prompts-huge", toml(lambda r: _set(r, 10**12, "n_prompts")), "n_prompts: must be <= 16777216"),
    Case("toml-prompt-values-huge", toml(lambda r: (_set(r, 2**24, "n_prompts"), _set(r, [300], "grid", "N"))),
         "n_prompts: n_prompts * (N + 1) = 5049942016 prompt values exceed 134217728"),
    Case("toml-batch-float", toml(lambda r: _set(r, 2.5, "batch_size")), "batch_size: expected an integer >= 1"),
    Case("toml-N-small", toml(lambda r: _set(r, [1, 10], "grid", "N")), "grid.N: must be >= 2"),
    Case("toml-N-float", toml(lambda r: _set(r, [10.5], "grid", "N")), "grid.N: expected an integer >= 2"),
    Case("toml-noise-negative", toml(lambda r: _set(r, [-0.1], "grid", "noise")), "grid.noise: must be finite and >= 0"),
    Case("toml-R-zero", toml(lambda r: _set(r, [0.0], "grid", "R")), "grid.R: must be finite and > 0"),
    Case("toml-R-inf", toml(lambda r: _set(r, [float("inf")], "grid", "R")), "grid.R: must be finite and > 0"),
    Case("toml-R-nan", toml(lambda r: _set(r, float("nan"), "grid", "R")), "grid.R: must be finite and > 0"),
    Case("toml-R-text", toml(lambda r: _set(r, ["big"], "grid", "R")), "grid.R: expected a number"),
    Case("toml-R-overflows-float32", toml(lambda r: (_set(r, [1e39], "grid", "R"), _set(r, ["float32"], "grid", "dtype"))),
         "grid.R: R=1e+39 overflows float32 (max 3.4e+38)"),
    # R rounding to 0 (or a subnormal) in float32: gd-lsa's cells were RuntimeError rows, exit 1
    Case("toml-R-underflows-float32", toml(lambda r: (_set(r, [1e-300, 10.0], "grid", "R"), _set(r, ["float32"], "grid", "dtype"))),
         "grid.R: R=1e-300 underflows float32 (min 1.18e-38)"),
    # 10^8 cells were a MemoryError in expand_cells (or the machine's memory) before anything was checked
    Case("toml-too-many-cells", toml(lambda r: (_set(r, list(range(2, 1002)), "grid", "N"),
                                              _set(r, [0.001 * i for i in range(1001)], "grid", "noise"))),
         "grid: 1001000 grid points x 1 solver settings = 1001000 cells, more than 1000000"),
    # every other registered solver counts with all_solvers (1 080 000 cells were built and run)
    Case("toml-too-many-cells-all-solvers", toml(lambda r: (_set(r, True, "all_solvers"), _set(r, list(range(2, 152)), "grid", "N"),
                                                          _set(r, [float(i) for i in range(1, 801)], "grid", "R"))),
         "grid: 120000 grid points x "),
    # a parameter list is counted before its repeats are checked (pairwise, that took hours for 10^6 values)
    Case("toml-too-many-cells-param-list", toml(lambda r: (_set(r, list(range(2, 12)), "grid", "N"),
                                                         _set(r, {"lr": [1e-6 * i for i in range(1, 100_002)]}, "solvers", "gd"))),
         "grid: 10 grid points x 100002 solver settings = 1000020 cells, more than 1000000"),
    Case("toml-dtype-unknown", toml(lambda r: _set(r, ["float16"], "grid", "dtype")), "grid.dtype: unknown value 'float16'; accepted: float32, float64"),
    Case("toml-device-unknown", toml(lambda r: _set(r, ["tpu"], "grid", "device")), "grid.device: unknown value 'tpu'; accepted: cpu, cuda"),
    Case("toml-grid-empty", toml(lambda r: _set(r, [], "grid", "N")), "grid.N: empty list"),
    Case("toml-grid-repeat", toml(lambda r: _set(r, [10, 10], "grid", "N")), "grid.N: repeated values"),
    Case("toml-ood-same-map", toml(lambda r: _set(r, ["none", "x-shift:5", "x-shift:5.0"], "grid", "ood")),  # two cells,
         "grid.ood: 'x-shift:5' and 'x-shift:5.0' are the same value in ['none', 'x-shift:5', 'x-shift:5.0']"),  # one map
    Case("toml-R-print-alike", toml(lambda r: _set(r, [10.0, 10.000000000000002], "grid", "R")),  # two cells, one label
         "grid.R: 10.0 and 10.000000000000002 print alike (10) in [10.0, 10.000000000000002]; keep one"),
    Case("toml-noise-print-alike", toml(lambda r: _set(r, [0.1, 0.1000000001], "grid", "noise")),
         "grid.noise: 0.1 and 0.1000000001 print alike (0.1) in"),
    Case("toml-solver-unknown", toml(lambda r: _set(r, {}, "solvers", "olss")), "solvers.olss: unknown name 'olss'; known: "),
    Case("toml-solver-not-table", toml(lambda r: _set(r, 3, "solvers", "ols")), "solvers.ols: must be a table of parameters"),
    Case("toml-solver-param-unknown", toml(lambda r: _set(r, 3, "solvers", "ols", "steps")), "solvers.ols.steps: unknown parameter"),
    Case("toml-solver-param-type", toml(lambda r: _set(r, "many", "solvers", "gd", "steps")), "solvers.gd.steps: expected int, got 'many'"),
    Case("toml-solver-param-choice", toml(lambda r: _set(r, "causal", "solvers", "gd-lsa", "variant")),
         "solvers.gd-lsa.variant: 'causal' is not accepted; accepted: masked, query-in-context"),
    Case("toml-solver-param-empty", toml(lambda r: _set(r, [], "solvers", "gd", "steps")), "solvers.gd.steps: empty list"),
    Case("toml-solver-param-repeat", toml(lambda r: _set(r, [4, 4], "solvers", "gd", "steps")),  # two rows, one key
         "solvers.gd.steps: repeated values in [4, 4]"),
    Case("toml-solver-param-repeat-coerced", toml(lambda r: _set(r, [0.5, 1, 1.0], "solvers", "gd", "lr")),
         "solvers.gd.lr: repeated values in [0.5, 1, 1.0]"),
    # one folder spelled twice ran the same checkpoints twice, as two series (found by a review)
    Case("toml-models-dir-repeat", toml(lambda r: _set(r, [str(Path(__file__).parent), str(Path(__file__).parent) + "/"],
                                                     "solvers", "trained-l1", "models_dir")),
         "solvers.trained-l1.models_dir: repeated values in "),
    Case("toml-models-dir-missing", toml(lambda r: _set(r, "no/such/models", "solvers", "trained-l1", "models_dir")),
         "solvers.trained-l1.models_dir: no such folder 'no/such/models' (relative to the current folder, "),
    Case("toml-solvers-empty", toml(lambda r: _set(r, {}, "solvers")), "solvers: empty table"),
    Case("toml-no-solver", toml(lambda r: (r.pop("solvers"), _set(r, False, "all_solvers"))),  # ran 0 cells, exit 0
         "solvers: no solver to run; add a [solvers.NAME] table, pass --solver NAME or set all_solvers = true"),
    Case("toml-all-solvers-type", toml(lambda r: _set(r, "yes", "all_solvers")), "all_solvers: expected true or false"),
    Case("toml-prompt-dist", toml(lambda r: _set(r, {"dist": "cauchy"}, "prompts", "x")),
         "prompts.x.dist: unknown distribution 'cauchy'; accepted: normal, uniform"),
    Case("toml-prompt-scale", toml(lambda r: _set(r, {"scale": -1.0}, "prompts", "slope")), "prompts.slope.scale: must be finite and >= 0"),
    Case("toml-prompt-key", toml(lambda r: _set(r, {"mean": 1.0}, "prompts", "x")), "prompts.x.mean: unknown key; accepted: dist, loc, scale"),
    Case("toml-timing-repeats", toml(lambda r: _set(r, 0, "timing", "repeats")), "timing.repeats: must be >= 1"),
    Case("toml-timing-seconds", toml(lambda r: _set(r, 0.0, "timing", "max_seconds")), "timing.max_seconds: must be finite and > 0"),
    Case("toml-executor-kind", toml(lambda r: _set(r, "ray", "executor", "kind")),
         "executor.kind: unknown value 'ray'; accepted: local, dask"),
    # 1024 LocalCluster processes on a 2-core machine ran no cell in 5 minutes
    Case("toml-executor-too-many-workers", toml(lambda r: (_set(r, "dask", "executor", "kind"),
                                                          _set(r, 64 * (os.cpu_count() or 1), "executor", "n_workers"))),
         f"executor.n_workers: {64 * (os.cpu_count() or 1)} LocalCluster processes on this machine's {os.cpu_count()} CPUs; "
         f"at most {4 * (os.cpu_count() or 1)}"),
    Case("toml-executor-key", toml(lambda r: _set(r, 2, "executor", "workers")),
         "executor.workers: unknown key; accepted: kind, scheduler, n_workers, exclusive_timing, retries"),
    Case("toml-executor-scheduler-local", toml(lambda r: _set(r, "tcp://h:8786", "executor", "scheduler")),
         'executor.scheduler: only with kind = "dask"'),
    Case("toml-executor-retries-local", toml(lambda r: _set(r, 3, "executor", "retries")),  # accepted, ignored (a review)
         'executor.retries: only with kind = "dask" (re-runs after a worker died)'),
    Case("toml-executor-workers-local", toml(lambda r: _set(r, 3, "executor", "n_workers")),
         'executor.n_workers: only with kind = "dask" (the processes of its LocalCluster)'),
    Case("toml-executor-retries-with-scheduler", toml(lambda r: (_set(r, "dask", "executor", "kind"), _set(
        r, "tcp://127.0.0.1:1", "executor", "scheduler"), _set(r, 7, "executor", "retries"))),
         "executor.retries: only for the LocalCluster a run starts, not with a scheduler"),  # recorded as if applied
    Case("cli-workers-huge", flags("--workers", "1000000"),  # said "must be <= 1024" though 4 per CPU is the limit
         f"--workers: 1000000 LocalCluster processes on this machine's {os.cpu_count()} CPUs; at most "
         f"{4 * (os.cpu_count() or 1)}"),
    Case("cli-scheduler-bad-port", flags("--scheduler", "tcp://127.0.0.1:99999"),  # waited 10 s to time out (a review)
         "--scheduler: 'tcp://127.0.0.1:99999' has no valid port; accepted: tcp://HOST:PORT, PORT 1-65535"),
    Case("cli-scheduler-no-port", flags("--scheduler", "tcp://localhost"),
         "--scheduler: 'tcp://localhost' has no valid port; accepted: tcp://HOST:PORT"),
    Case("cli-workers-with-scheduler", flags("--workers", "3", "--scheduler", "tcp://127.0.0.1:1"),
         "--workers: only for the LocalCluster a run starts, not with a scheduler"),  # accepted and ignored
    Case("toml-executor-exclusive", toml(lambda r: _set(r, "yes", "executor", "exclusive_timing")),
         "executor.exclusive_timing: expected true or false"),
    Case("cli-executor", lambda tmp: ["run", "--executor", "slurm"], "--executor: unknown value 'slurm'; accepted: local, dask"),
    Case("toml-data-not-table", toml(lambda r: _set(r, "data.csv", "data")), "data: must be a table (got str)"),
    Case("toml-data-missing-file", toml_csv(lambda r: _set(r, {"path": "no/such.csv", "x": "x", "y": "y"}, "data")), "data.path: no such file"),
    Case("toml-data-missing-key", toml_csv(lambda r: _set(r, {"path": "matplotlib:msft.csv", "x": "Open"}, "data")), "data.y: not given; the column of targets, one of: 'Date', 'Open'"),
    Case("toml-data-missing-column", toml_csv(lambda r: _set(r, {**MSFT, "y": "Shut"}, "data")), "data.y: no column 'Shut' in msft.csv; columns: 'Date', 'Open'"),
    Case("toml-data-text-column", toml_csv(lambda r: _set(r, {**MSFT, "x": "Date"}, "data")), "data.x: column 'Date' is not numeric (data row 1: "),
    Case("toml-data-too-few-rows", toml_csv(lambda r: (_set(r, MSFT, "data"), _set(r, [100], "grid", "N"))),
         "grid.N: N=100 needs at least 101 rows with finite x and y; msft.csv has 65"),
    # ---- TOML files that are not TOML ----
    Case("toml-invalid", toml(text="seed = ["), "--config: bad.toml is not valid TOML"),
    Case("toml-not-utf8", toml(text=b"seed = '\xff\xfe'"), "--config: bad.toml is not UTF-8 text"),
    Case("toml-binary", toml(text=bytes(range(256))), "--config: bad.toml is not UTF-8 text"),
    Case("toml-nested-too-deep", toml(text="seed = " + "[" * 50_000 + "]" * 50_000),  # was a RecursionError
         "--config: bad.toml nests arrays or inline tables too deeply to read"),
    Case("toml-inline-tables-too-deep", toml(text="seed = " + "{a = " * 50_000 + "1" + "}" * 50_000),
         "--config: bad.toml nests arrays or inline tables too deeply to read"),
    Case("toml-missing", lambda tmp: ["run", "--config", str(tmp / "none.toml")], "--config: no such file"),
    Case("packaged-config-typo", lambda tmp: ["run", "--config", "defualt"],  # no suggestion, unlike a solver's name
         "--config: no such file 'defualt' (did you mean 'default'?); packaged configs: default, l1_sweep, ood, train, trained"),
    Case("toml-is-folder", lambda tmp: ["run", "--config", str(tmp)], "--config: "),
    # an empty --config ran the packaged default matrix (1872 cells); /dev/null was "no such file"
    Case("toml-empty-path", lambda tmp: ["run", "--config", ""], "--config: empty path; give a TOML file or a packaged config ("),
    Case("toml-blank-path-train", lambda tmp: ["train", "--config", " "], "--config: empty path", resume=False),
    Case("toml-empty-path-sweep", lambda tmp: ["sweep", "--config", ""], "--config: empty path", out=False),
    Case("toml-device-file", lambda tmp: ["run", "--config", "/dev/null"],
         "--config: '/dev/null' is not a regular file (a device, pipe or socket); give a .toml file"),
    # ---- a config made for another command names the command that runs it ----
    Case("toml-training-config-to-run", lambda tmp: ["run", "--config", "train"],
         "--config: 'train' is a training config; run it with `icl-bench train --config train`"),
    Case("toml-sweep-config-to-run", lambda tmp: ["run", "--config", "l1_sweep"],
         "--config: 'l1_sweep' is a sweep config; run it with `icl-bench sweep --config l1_sweep`"),
    Case("toml-matrix-config-to-train", lambda tmp: ["train", "--config", "ood"],
         "--config: 'ood' is a matrix config; run it with `icl-bench run --config ood`", resume=False),
    Case("toml-matrix-config-to-sweep", lambda tmp: ["sweep", "--config", "default"],
         "--config: 'default' is a matrix config; run it with `icl-bench run --config default`", out=False),
    # ---- CLI flags ----
    Case("cli-no-command", lambda tmp: [], "command: give one of list, run, publish, report, analyze, train, sweep, docs "
         "(icl-bench --help; icl-bench COMMAND --help)", out=False),
    Case("cli-unknown-command", lambda tmp: ["frobnicate"], "command: 'frobnicate' is not one of list, run, publish, "
         "report, analyze, train, sweep, docs (icl-bench --help)"),
    Case("cli-unknown-flag", flags("--frobnicate"), "--frobnicate: not an argument of icl-bench run (icl-bench run --help)"),
    Case("cli-flag-without-value", lambda tmp: ["run", "--config"], "--config: needs a value (icl-bench run --help)"),
    Case("cli-solver-unknown", flags("--solver", "nope"), "--solver: unknown name 'nope'"),  # the flag, not solvers.nope
    Case("cli-second-solver-unknown", flags("--solver", "gd", "--solver", "nope"), "--solver: unknown name 'nope'"),
    Case("cli-solver-with-a-bad-config-table", lambda tmp: [*toml(lambda r: _set(r, 3, "solvers", "gd"))(tmp), "--solver",
         "gd"], "solvers.gd: must be a table of parameters"),  # the config's own error, not --solver's
    Case("cli-solver-parameter-as-flag", flags("--solver", "gd-lsa", "--steps", "4"),
         "--steps 4: not an argument of icl-bench run (icl-bench run --help); steps is a solver parameter: a key of "
         "the config's [solvers.NAME] table"),
    Case("cli-data-without-columns", flags("--data", "matplotlib:msft.csv"), "--data: needs --x COLUMN and --y COLUMN"),
    Case("cli-x-without-data", flags("--x", "Open"), "--x/--y: only with --data FILE"),
    Case("cli-out-not-empty", flags(), "--out: ", resume=False, fresh=False),
    # ---- CSV data ----
    Case("csv-missing", csv(None), "--data: no such file"),
    Case("csv-empty-file", csv(""), "--data: cannot read"),
    Case("csv-header-only", csv("x,y\n"), "grid.N: N=4 needs at least 5 rows with finite x and y; data.csv has 0"),
    Case("csv-not-utf8", csv(b"x,y\n1,\xff\xfe\n2,3\n"), "--data: cannot read '{tmp}/data.csv' as CSV (not UTF-8 text: "
         "invalid start byte at byte 6); accepted: UTF-8 CSV text"),  # it said "(UnicodeDecodeError)" (a review)
    Case("csv-latin1-text-column", csv("x,y,city\n".encode() + b"".join(b"%d,%d,Z\xfcrich\n" % (i, i) for i in range(9))),
         "--data: cannot read '{tmp}/data.csv' as CSV (not UTF-8 text: invalid start byte at byte 14)"),
    Case("csv-semicolons-decimal-commas", csv("x;y\n" + "".join(f"0,{i};1,{i + 2}\n" for i in range(9))),
         "--data: cannot read '{tmp}/data.csv' as CSV (data rows with more fields than the header; is it separated "
         "by ';'?)"),
    Case("csv-comment-line", csv("# exported by a logger\nx,y\n" + "".join(f"{i},{i + 1}\n" for i in range(9))),
         "--data: cannot read '{tmp}/data.csv' as CSV (data rows with more fields than the header; its first line starts "
         "with '#': remove comment lines above the header)"),
    Case("csv-binary", csv(bytes(range(256)) * 4), "--data: cannot read"),
    Case("csv-ragged", csv("x,y\n1,2\n3,4,5,6\n"), "--data: cannot read"),
    # every row one field more than the header: pandas took the first field as the index and ran with x = y's values
    Case("csv-every-row-one-more-field", csv("x,y\n1,10,100\n2,20,205\n3,30,290\n4,40,410\n5,50,500\n6,60,590\n"),
         "--data: cannot read '{tmp}/data.csv' as CSV (data rows with more fields than the header); accepted: "
         "UTF-8 CSV text with as many fields in every row as in the header"),
    Case("csv-first-row-one-more-field", csv("x,y\n1,2,3\n" + "4,5\n" * 6), "--data: cannot read '{tmp}/data.csv' "
         "as CSV (data rows with more fields than the header)"),  # pandas dropped the 3
    Case("csv-one-text-cell", csv("x,y\n" + "1,1\n" * 4 + "abc,2\n" + "3,3\n" * 4),
         "--x: column 'x' is not numeric (data row 5: 'abc'); accepted: numbers"),  # it named no row
    Case("csv-text-column", csv("x,y\n" + "a,1\n" * 8), "--x: column 'x' is not numeric (data row 1: 'a'); accepted: numbers (inf too), and cells pandas reads as missing"),
    # pandas reads True / False as bool, which it counts as numeric: the run had used 1 / 0
    Case("csv-bool-column", csv("x,y\n" + "".join(f"{i},{i % 2 == 0}\n" for i in range(12))),
         "--y: column 'y' is not numeric (data row 1: 'True'); accepted: numbers"),
    Case("csv-missing-column", csv(ROWS, y="z"), "--y: no column 'z' in data.csv; columns: 'x', 'y'"),
    Case("csv-repeated-column", csv("x,x,y\n" + "".join(f"{i},{9 * i},{i + 1}\n" for i in range(12))),
         "--x: column 'x' appears 2 times in the header of data.csv; accepted: a column whose name appears once"),
    Case("csv-renamed-repeat", csv("x,x,y\n" + "".join(f"{i},{9 * i},{i + 1}\n" for i in range(12)), x="x.1"),
         "--x: no column 'x.1' in data.csv; columns: 'x', 'x', 'y'"),  # pandas' name for the second x: not in the file
    Case("csv-renamed-repeat-beside-its-name", csv("x,x,x.1,y\n" + "".join(f"{i},{9 * i},{5 * i},{i + 1}\n" for i in range(12)),
                                                   x="x.2"),  # pandas names the second x x.2 here
         "--x: no column 'x.2' in data.csv; columns: 'x', 'x', 'x.1', 'y'"),
    Case("csv-semicolons", csv(ROWS.replace(",", ";")), "--x: no column 'x' in data.csv; columns: 'x;y' (one column: is "
         "the file separated by ';'? accepted: comma-separated values)"),
    Case("csv-empty-data-flag", lambda tmp: [*toml_csv(lambda r: None)(tmp), "--data", "", "--x", "x", "--y", "y"],
         "--data: empty path; give a CSV file"),  # said "is a folder": Path("") is "."
    Case("csv-flag-beside-data-table-with-solver", lambda tmp: [*data_table(lambda r: None)(tmp), "--data",
                                                                str(tmp / "data.csv"), "--x", "x", "--y", "y", "--solver", "ols"],
         "--data: {tmp}/bad.toml has a [data] table already"),  # it named the solvers' table: "{} has a [data] ..."
    Case("csv-flag-beside-data-table", lambda tmp: [*data_table(lambda r: None)(tmp), "--data", str(tmp / "data.csv"),
                                                    "--x", "x", "--y", "y"],
         "--data: {tmp}/bad.toml has a [data] table already; give the CSV file in one place"),  # it replaced it, silently
    Case("csv-no-finite-rows", csv("x,y\n" + "nan,1\n1,inf\n" * 6), "grid.N: N=4 needs at least 5 rows with finite x and y; data.csv has 0 (of 12 rows)"),
    # compressed CSV is read by its name's ending (.gz, .zip, ...); a damaged one is refused in one line
    Case("csv-gz-plain-text", csv(ROWS, name="data.csv.gz"), "--data: cannot read"),
    Case("csv-gz-binary", csv(gzip.compress(bytes(range(256)) * 4), name="data.csv.gz"), "--data: cannot read"),
    Case("csv-gz-truncated", csv(gzip.compress(ROWS.encode())[:40], name="data.csv.gz"), "--data: cannot read"),
    Case("csv-xz-damaged", csv(b"junk" * 10, name="data.csv.xz"), "--data: cannot read"),
    Case("csv-bz2-damaged", csv(b"junk" * 10, name="data.csv.bz2"), "--data: cannot read"),
    Case("csv-zip-damaged", csv(b"junk" * 10, name="data.zip"), "--data: cannot read"),
    Case("csv-zip-two-files", csv(_zip(("a.csv", ROWS), ("b.csv", ROWS)), name="data.zip"),
         "--data: cannot read '{tmp}/data.zip' as CSV (the archive holds several files)"),  # it said "(ValueError)"
    Case("csv-tar-damaged", csv(b"junk" * 10, name="data.tar"), "--data: cannot read"),
    # settings CSV prompts cannot use were ignored (a noise grid of 2 values gave 1 cell per point)
    Case("csv-table-with-noise-grid", data_table(lambda r: _set(r, [0.0, 0.1], "grid", "noise")),
         "grid.noise: [0.0, 0.1] would be ignored: CSV prompts ([data] / --data) take y from the file"),
    Case("csv-flag-with-noise-grid", lambda tmp: [*toml(lambda r: None)(tmp), "--data", str(_write(tmp / "data.csv", ROWS)),
         "--x", "x", "--y", "y"], "grid.noise: [0.1] would be ignored"),  # a config of the user's own (not packaged)
    Case("csv-table-with-prompts", data_table(lambda r: _set(r, {"dist": "uniform"}, "prompts", "x")),
         "prompts.x: would be ignored: CSV prompts ([data] / --data) take x and y from the file"),
    # ---- run folders given to `icl-bench publish` ----
    Case("publish-run-missing", lambda tmp: ["publish", str(tmp / "no-such-run")], f"RUN_DIR: {RUN_AT}no-such-run is not a folder"),
    Case("publish-run-unfinished", damaged("results.parquet", None), f"RUN_DIR: {RUN_AT}input-run has no results.parquet"),
    Case("publish-parquet-corrupt", damaged("results.parquet", b"PAR1 not really"), f"RUN_DIR: {RUN_AT}input-run/results.parquet cannot be read"),
    Case("publish-parquet-empty", damaged("results.parquet", b""), f"RUN_DIR: {RUN_AT}input-run/results.parquet cannot be read"),
    Case("publish-metadata-not-utf8", damaged("metadata.json", b"{\xff"), f"RUN_DIR: {RUN_AT}input-run/metadata.json cannot be read"),
    Case("publish-parquet-N-nan", edited(N=math.nan), f"{PARQUET} column 'N' is NaN or null in 1 of 1 rows; expected integers"),
    Case("publish-parquet-N-fraction", edited(N=4.5), f"{PARQUET} column 'N' holds 4.5; expected integers"),
    Case("publish-parquet-N-below-2", edited(N=1), f"{PARQUET} column 'N': must be >= 2 (got 1)"),
    Case("publish-parquet-status-unknown", edited(status="weird"), f"{PARQUET} column 'status' holds 'weird'; accepted: ok, error, skipped"),
    Case("publish-parquet-status-null", edited(status=None), f"{PARQUET} column 'status' is null in 1 of 1 rows; expected text"),
    Case("publish-parquet-solver-empty", edited(solver=" "), f"{PARQUET} column 'solver' holds an empty name (' '); expected a "
         "solver's name"),
    Case("publish-parquet-solver-invisible", edited(solver="\u200b"), f"{PARQUET} column 'solver' holds an empty name "
         "('\\u200b'); expected a solver's name"),
    Case("publish-parquet-mse-text", edited(mse_vs_ols="0.5"), f"{PARQUET} column 'mse_vs_ols' holds '0.5' (str); expected numbers"),
    Case("publish-parquet-se-negative", edited(mse_vs_ols_se=-1.0), f"{PARQUET} column 'mse_vs_ols_se' holds -1.0; expected numbers >= 0"),
    Case("publish-parquet-nonfinite-over-n", edited(n_nonfinite=999, n_prompts=16),  # headline: "(999 of 16 NaN)"
         f"{PARQUET} column 'n_nonfinite' holds 999 in a row of n_prompts 16; expected at most n_prompts"),
    Case("publish-parquet-sparsity-over-1", edited(weight_sparsity=5.0),
         f"{PARQUET} column 'weight_sparsity' holds 5.0; expected a fraction in [0, 1] (or NaN)"),
    Case("publish-parquet-params-not-json", edited(solver_params="steps=4"),
         f"{PARQUET} column 'solver_params' holds 'steps=4', not a JSON object"),
    Case("publish-parquet-params-array", edited(solver_params="[4]"), f"{PARQUET} column 'solver_params' holds '[4]', not a JSON object"),
    Case("publish-parquet-prompts-not-json", edited(prompts="normal"), f"{PARQUET} column 'prompts' holds 'normal', not a JSON object"),
    Case("publish-parquet-dtype-unknown", edited(dtype="float16"), f"{PARQUET} column 'dtype': unknown value 'float16'; accepted: float32"),
    Case("publish-parquet-R-nan", edited(R=math.nan), f"{PARQUET} column 'R' is NaN or null in 1 of 1 rows; expected numbers"),
    Case("publish-parquet-seed-negative", edited(seed=-1), f"{PARQUET} column 'seed': must be >= 0 (got -1)"),
    Case("publish-parquet-solver-number", edited(solver=3.0), f"{PARQUET} column 'solver' holds 3.0 (float); expected text"),
    Case("publish-metadata-nested-too-deep", damaged("metadata.json", b"[" * 1000 + b"]" * 1000),  # was a RecursionError
         f"RUN_DIR: {RUN_AT}input-run/metadata.json cannot be read (JSON nested too deeply)"),
    Case("publish-parquet-params-nested-too-deep", edited(solver_params="[" * 100_000 + "]" * 100_000),
         f"{PARQUET} column 'solver_params' holds '{'[' * 56}..., JSON nested too deeply to read; expected the canonical JSON"),
    Case("publish-metadata-array", damaged("metadata.json", b"[]"),
         f"RUN_DIR: {RUN_AT}input-run/metadata.json holds a JSON array; expected a JSON object"),
    Case("publish-metadata-null", damaged("metadata.json", b"null"),
         f"RUN_DIR: {RUN_AT}input-run/metadata.json holds a JSON null; expected a JSON object"),
    Case("publish-at-malformed", lambda tmp: ["publish", str(tmp / "input-run"), "--at", "R"], "--at: expected AXIS=VALUE"),
    Case("publish-at-unknown-axis", lambda tmp: ["publish", str(tmp / "input-run"), "--at", "K=3"], "--at: unknown axis 'K'"),
    Case("publish-at-not-a-number", lambda tmp: ["publish", str(tmp / "input-run"), "--at", "N=abc"],
         "--at: N=abc is not a number (N takes integers); accepted: 4"),
    Case("publish-at-not-an-integer", lambda tmp: ["publish", str(tmp / "input-run"), "--at", "N=4.5"],
         "--at: N=4.5 is not an integer (N takes integers); accepted: 4"),
    Case("publish-checkpoint-folder", lambda tmp: ["publish", str(tmp / "input-run"), "--checkpoint", str(tmp / "input-run")],
         f"--checkpoint: {RUN_AT}input-run is a folder; a checkpoint is the file pair <stem>.safetensors + <stem>.json"),
    Case("publish-checkpoint-dot", lambda tmp: ["publish", str(tmp / "input-run"), "--checkpoint", "."],
         "--checkpoint: . is a folder; a checkpoint is the file pair <stem>.safetensors + <stem>.json: give its stem"),
    Case("publish-readme-not-utf8", readme(b"<!-- headline:begin -->\xff\xfe<!-- headline:end -->\n"),
         f"--readme: {RUN_AT}README.md is not UTF-8 text (invalid start byte at byte 23)"),
    Case("publish-at-no-cells", lambda tmp: ["publish", str(tmp / "input-run"), "--at", "R=7"], "--at: R=7 has no ok cells"),
    Case("publish-readme-empty", lambda tmp: ["publish", str(tmp / "input-run"), "--readme", ""],  # (skipped silently)
         "--readme: empty path; give the README file"),
]


def test_a_readme_that_cannot_be_written_is_refused_before_the_report(tmp_path, capsys, finished_run, monkeypatch):
    """A --readme in a read-only folder was refused only after the whole report had been written,
    and the message named a temp file instead of --readme (found by a review)."""
    import os

    (tmp_path / "ro").mkdir()
    target = tmp_path / "ro" / "README.md"
    target.write_text("<!-- headline:begin -->\nold\n<!-- headline:end -->\n")
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == tmp_path / "ro" else real(p, mode, **kw))
    assert main(["publish", str(finished_run), "--out", str(tmp_path / "pub"), "--readme", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"icl-bench: error: --readme: cannot write {target} (its folder") and err.count("\n") == 1
    assert not (tmp_path / "pub").exists() and "old" in target.read_text()


class _Evil:
    """Unpickling this would create the file PWNED beside the checkpoint."""

    def __init__(self, where: Path):
        self.where = where

    def __reduce__(self):
        return (os.system, (f"touch {self.where / 'PWNED'}",))


def _weights(stem: Path, tensors: dict) -> None:
    Path(f"{stem}.safetensors").unlink()
    save_file(tensors, f"{stem}.safetensors")


def _meta(edit: Callable[[dict], object]):
    def damage(stem: Path) -> None:
        path = Path(f"{stem}.json")
        meta = json.loads(path.read_text())
        edit(meta)
        path.write_text(json.dumps(meta))
    return damage


def _bytes(suffix: str, content: Callable[[bytes, Path], bytes] | bytes | None):
    def damage(stem: Path) -> None:
        path = Path(f"{stem}{suffix}")
        old = path.read_bytes()
        path.unlink()
        if content is not None:
            path.write_bytes(content(old, stem) if callable(content) else content)
    return damage


def ckpt(id: str, damage: Callable[[Path], None] | None, expected: str, flags: tuple[str, ...] = (),
         api: bool = True) -> Case:
    """A checkpoint case: a sound pair, `damage`d, read by load_checkpoint and `icl-bench analyze`."""
    return Case(f"checkpoint-{id}", None, expected, damage=damage, flags=flags, api=api and damage is not None)


GOOD = TransformerConfig()  # d_model 4, 2 layers, 2 heads, LayerNorm
NOT_SAFETENSORS = "checkpoint: {stem}.safetensors is not a readable safetensors file"
CASES += [
    ckpt("missing-json", _bytes(".json", None), "checkpoint: metadata file {stem}.json is missing"),
    ckpt("missing-weights", _bytes(".safetensors", None), "checkpoint: weights file {stem}.safetensors is missing"),
    ckpt("empty-weights", _bytes(".safetensors", b""), NOT_SAFETENSORS),
    ckpt("truncated", _bytes(".safetensors", lambda b, s: b[: len(b) // 2]), NOT_SAFETENSORS),
    ckpt("pickle-disguised", _bytes(".safetensors", lambda b, s: pickle.dumps(_Evil(s.parent))), NOT_SAFETENSORS),
    ckpt("torch-save-disguised", lambda s: torch.save({"w": _Evil(s.parent)}, f"{s}.safetensors"), NOT_SAFETENSORS),
    ckpt("wrong-shape", _meta(lambda m: m["model_config"].update(d_model=8)),
         "checkpoint: {stem}.safetensors tensor 'embed.weight' has shape (4, 3), the config needs (8, 3)"),
    ckpt("wrong-layers", _meta(lambda m: m["model_config"].update(n_layers=3)), "checkpoint: {stem}.safetensors tensor names do not match"),
    ckpt("huge-model-config", _meta(lambda m: m["model_config"].update(d_model=10**9)),
         "checkpoint: {stem}.json has a bad model_config: d_model: must be >= 1 and <= 4096 (got 1000000000)"),
    ckpt("model-config-type", _meta(lambda m: m["model_config"].update(d_model="four")), "checkpoint: {stem}.json has a bad model_config"),
    ckpt("model-config-key", _meta(lambda m: m["model_config"].update(width=4)), "checkpoint: {stem}.json has a bad model_config"),
    # a float or bool size was a TypeError deep in torch (a traceback); "yes" was taken as a LayerNorm
    ckpt("model-config-float-size", _meta(lambda m: m["model_config"].update(d_model=4.0)),
         "checkpoint: {stem}.json has a bad model_config: d_model: must be an integer (got 4.0)"),
    ckpt("model-config-bool-size", _meta(lambda m: m["model_config"].update(n_heads=True)),
         "checkpoint: {stem}.json has a bad model_config: n_heads: must be an integer (got True)"),
    # n_layers = 10**9 built a billion meta-device blocks (a hang), d_model = 10**12 a torch traceback
    ckpt("model-config-huge-size", _meta(lambda m: m["model_config"].update(n_layers=10**9)),
         "checkpoint: {stem}.json has a bad model_config: n_layers: must be >= 1 and <= 4096 (got 1000000000)"),
    ckpt("model-config-huge-model", _meta(lambda m: m["model_config"].update(d_model=4096, n_layers=64)),
         "checkpoint: {stem}.json has a bad model_config: d_model: 4 * n_layers * n_heads * d_model^2 ="),
    ckpt("model-config-text-flag", _meta(lambda m: m["model_config"].update(layernorm="yes")),
         "checkpoint: {stem}.json has a bad model_config: layernorm: must be true or false (got 'yes')"),
    ckpt("not-a-checkpoint", _meta(lambda m: m.update(format="something-else")), "checkpoint: {stem}.json is not an icl-bench checkpoint"),
    ckpt("json-not-utf8", _bytes(".json", b"{\xff\xfe}"), "checkpoint: {stem}.json is not valid JSON"),
    ckpt("json-empty", _bytes(".json", b""), "checkpoint: {stem}.json is not valid JSON"),
    ckpt("json-invalid", _bytes(".json", b"{not json"), "checkpoint: {stem}.json is not valid JSON"),
    ckpt("json-list", _bytes(".json", b"[]"), "checkpoint: {stem}.json is not an icl-bench checkpoint"),
    ckpt("newer-version", _meta(lambda m: m.update(version=99)),  # was analysed without a word
         "checkpoint: {stem}.json has version 99; this icl-bench reads version 1"),
    ckpt("version-not-a-number", _meta(lambda m: m.update(version="1")), "checkpoint: {stem}.json has version '1'"),
    ckpt("json-nested-too-deep", _bytes(".json", b"[" * 100_000 + b"]" * 100_000),  # was a RecursionError
         "checkpoint: {stem}.json is not valid JSON (nested too deeply to read)"),
    ckpt("integer-weights", lambda s: _weights(s, {k: v.to(torch.int32) for k, v in Transformer(GOOD).state_dict().items()}),
         "checkpoint: {stem}.safetensors tensors must share one floating dtype"),
    ckpt("R-not-a-number", _meta(lambda m: m.update(R="big")), "checkpoint: {stem} metadata has no valid R", api=False),
    ckpt("missing", lambda s: [Path(f"{s}{x}").unlink() for x in (".json", ".safetensors")], "checkpoint: metadata file {stem}.json is missing"),
    # ---- `icl-bench analyze` flags, on a sound checkpoint ----
    ckpt("analyze-n-prompts-zero", None, "--n-prompts: must be an integer >= 8", ("--n-prompts", "0")),
    ckpt("analyze-n-prompts-text", None, "--n-prompts: 'many' is not an integer", ("--n-prompts", "many")),
    ckpt("analyze-n-prompts-huge", None, "--n-prompts: n_prompts * (N + 1) = ", ("--n-prompts", str(10**12))),
    ckpt("analyze-N-one", None, "--N: must be an integer >= 2", ("--N", "1")),
    ckpt("analyze-N-huge", None, "--n-prompts: n_prompts * (N + 1) = ", ("--N", str(10**8))),
]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    run_matrix(parse_config(copy.deepcopy(BASE)), out, progress=False)
    return out


PARAMS = [pytest.param(c, where, id=f"{where}-{c.id}") for c in CASES if c.flags is None
          for where in ("fresh-out", "finished-run-in-out") if c.fresh or where != "fresh-out"]
PARAMS += [pytest.param(c, "analyze", id=c.id) for c in CASES if c.flags is not None]  # own --out handling


@pytest.mark.parametrize("case, where", PARAMS)
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, capsys, finished_run, case, where):
    if case.flags is not None:
        return _checkpoint_case(tmp_path, case, capsys)
    shutil.copytree(finished_run, tmp_path / "input-run")
    argv = case.argv(tmp_path)
    if where == "fresh-out":
        out, before = tmp_path / "new-out", None
    else:
        out = tmp_path / "old-out"
        shutil.copytree(finished_run, out)
        before = _snapshot(out)
    if case.out:
        go_ahead = "--force" if argv[:1] == ["publish"] else "--resume"  # publish replaces, run resumes
        argv = [*argv, "--out", str(out)] + ([go_ahead] if before is not None and case.resume else [])
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2, captured
    assert captured.out == "" and captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.err.startswith("icl-bench: error: " + case.expected.replace(RUN_AT, f"{tmp_path}/")), captured.err
    if before is None:
        assert not out.exists()
    else:
        assert _snapshot(out) == before


def _checkpoint_case(tmp: Path, case: Case, capsys) -> None:
    stem = save_checkpoint(Transformer(GOOD), tmp / "ckpt" / "model", {"R": 10.0, "N": 20})
    load_checkpoint(stem)  # sound before the damage
    if case.damage is not None:
        case.damage(stem)
    expected = case.expected.replace("{stem}", str(stem))
    before = _snapshot(stem.parent)
    for path in (stem, f"{stem}.safetensors", f"{stem}.json") if case.api else ():  # every way to name it
        with pytest.raises(ConfigError) as err:
            load_checkpoint(path)
        assert "\n" not in str(err.value) and str(err.value).startswith(expected), str(err.value)
    old = tmp / "old.json"
    old.write_bytes(b'{"an earlier analysis": 1}\n')
    for out in (tmp / "new.json", old):
        code = main(["analyze", str(stem), *case.flags, "--out", str(out)])
        captured = capsys.readouterr()
        assert code == 2 and captured.out == "" and captured.err.count("\n") == 1, captured
        assert captured.err.startswith("icl-bench: error: " + expected), captured.err
    assert not (tmp / "new.json").exists() and old.read_bytes() == b'{"an earlier analysis": 1}\n'
    assert _snapshot(stem.parent) == before and not (stem.parent / "PWNED").exists()


def test_out_that_is_a_file_or_under_a_file_or_locked(tmp_path, capsys, finished_run):
    config = toml(lambda r: None)(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"precious")
    for out, expected in ((blocker, "is a file, not a folder"), (blocker / "sub", "cannot write to")):
        assert main([*config, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("icl-bench: error: --out: ") and expected in err and err.count("\n") == 1
    assert blocker.read_bytes() == b"precious"
    busy = tmp_path / "busy"
    shutil.copytree(finished_run, busy)
    before = _snapshot(busy)
    lock = store.prepare(busy, resume=True, config_json=None)  # another run holds it
    try:
        assert main([*config, "--out", str(busy), "--resume"]) == 2
    finally:
        lock.close()
    assert "--out: " in capsys.readouterr().err and _snapshot(busy) == before


@pytest.mark.parametrize("kwargs", [{"n_prompts": 10**12}, {"N": 10**8}])
def test_analyze_refuses_sizes_it_cannot_hold_before_allocating(kwargs):
    from icl_bench.analysis.analyze import analyze
    from icl_bench.errors import ConfigError
    from icl_bench.solvers.transformer import Transformer, TransformerConfig

    with pytest.raises(ConfigError, match=r"^n_prompts: n_prompts \* \(N \+ 1\) = \d+ prompt values exceed"):
        analyze(Transformer(TransformerConfig()), 10.0, **kwargs)


def test_unreadable_inputs_say_permission_denied_and_name_their_field(tmp_path, capsys, finished_run, monkeypatch):
    """Permission errors read as other faults (found by a review): a --resume config.json "cannot
    be read as JSON", a checkpoint's JSON "is not valid JSON", its weights "No such file or
    directory", and a RUN_DIR's table lacked the RUN_DIR: prefix. (Root reads any file, so the
    denial is simulated.)"""
    real_read_text, real_access = Path.read_text, os.access
    denied = {finished_run / "config.json"}

    def read_text(self, *a, **kw):
        if self in denied or self.suffix == ".json" and self.parent.name == "ckpt":
            raise PermissionError(13, "Permission denied", str(self))
        return real_read_text(self, *a, **kw)
    monkeypatch.setattr(Path, "read_text", read_text)
    with pytest.raises(ConfigError, match=r"^--resume: cannot read .*config.json \(Permission denied\)$"):
        store.prepare(finished_run, resume=True, config_json="{}")
    stem = save_checkpoint(Transformer(GOOD), tmp_path / "ckpt" / "model", {"R": 10.0, "N": 20})
    with pytest.raises(ConfigError, match=r"^checkpoint: cannot read .*model.json \(Permission denied\)$"):
        load_checkpoint(stem)
    monkeypatch.setattr(Path, "read_text", real_read_text)
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p).endswith(".safetensors") else real_access(p, mode, **kw))
    with pytest.raises(ConfigError, match=r"^checkpoint: cannot read .*model.safetensors \(Permission denied\)$"):
        load_checkpoint(stem)
    monkeypatch.setattr(os, "access", real_access)

    def no_parquet(path, *a, **kw):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(Path, "is_file", lambda self: no_parquet(self) if self.name == "results.parquet" else os.path.isfile(self))
    assert main(["publish", str(finished_run), "--out", str(tmp_path / "pub")]) == 2
    assert capsys.readouterr().err == f"icl-bench: error: RUN_DIR: {finished_run}/results.parquet: Permission denied\n"
