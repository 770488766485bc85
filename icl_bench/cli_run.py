"""`icl-bench run`: the handler of the command that runs a matrix (icl_bench/cli.py parses the
command line and calls it; exit codes there), and what it shares with the rest of the command line."""
from __future__ import annotations

import itertools
import json
import os
import shlex
import sys
import warnings
from datetime import datetime
from pathlib import Path

from icl_bench import resources
from icl_bench.errors import ConfigError, RunAborted
from icl_bench.files import drop_made_folders, first_existing
from icl_bench.startup import Terminated


def warn_conflicts(file=None, prefix: str = "") -> None:
    """Print a WARNING line for each plugin entry point ignored because its name is taken (a built-in's
    or an earlier distribution's on sys.path: which one runs would otherwise be silent); `list`
    prints them to stdout, `run` to stderr before its matrix, with `prefix` ("icl-bench: ", as every
    warning on stderr)."""
    from icl_bench.solvers.registry import conflicts

    for line in conflicts():
        print(f"{prefix}WARNING: {line}", file=file or sys.stdout)


RUNS_ROOT = Path("results/runs")  # where a run without --out goes


def fresh_run_folder(root: Path = RUNS_ROOT) -> Path:
    """The folder of a run without --out: root/<YYYYmmdd-HHMMSS>, made here and empty; "-2", "-3", ...
    appended when another run took that name (runs started in one second collided: the later ones
    were refused as "not empty"; a new-user tryout).

    Raises:
        ConfigError: root, or a folder above it, is a file or a link to nothing.
        OSError: root cannot be made or written (main names the path)."""
    blocked = next((p for p in reversed((root, *root.parents)) if p.is_symlink() and not p.exists()
                    or p.exists() and not p.is_dir()), None)
    if blocked is not None:  # (mkdir said "File exists" of both)
        what = f"a link to {os.readlink(blocked)}, which does not exist" if blocked.is_symlink() else "not a folder"
        raise ConfigError(f"--out: not given, and {blocked} is {what}, so {root}/<time> cannot be made; give --out DIR")
    base = root / datetime.now().strftime("%Y%m%d-%H%M%S")
    root.mkdir(parents=True, exist_ok=True)
    for i in itertools.count(1):
        folder = base if i == 1 else base.with_name(f"{base.name}-{i}")
        try:
            folder.mkdir()  # atomic: of two runs that try one name, one makes it
            return folder
        except FileExistsError:
            continue


def _interrupted(exc: KeyboardInterrupt) -> str:
    return "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"


def _interrupt_code(exc: KeyboardInterrupt) -> int:
    """128 + the signal's number, as a shell reports a process that signal stopped: 143 / 130."""
    return 143 if isinstance(exc, Terminated) else 130


def _run_matrix(*args, **kwargs):
    from icl_bench.bench.runner import run_matrix

    return run_matrix(*args, **kwargs)


def _resume_command(argv: list[str], out: Path) -> str:
    """The `icl-bench run ...` line that continues an interrupted run in `out`."""
    argv = list(argv)
    if "--out" not in argv and not any(a.startswith("--out=") for a in argv):
        argv += ["--out", str(out)]
    if "--resume" not in argv:
        argv.append("--resume")
    return shlex.join(["icl-bench", *argv])


def _advice(exc: ConfigError) -> str:
    """What to do when a run's recorded config no longer loads (the message's field decides)."""
    msg = str(exc)
    if msg.startswith("solvers.") and ": unknown name" in msg:
        return "install the plugin that provided that solver again, then resume"
    if msg.startswith("data.path:"):
        return "a relative data.path is read from the folder the run was started in: resume from there"
    if msg.startswith("data."):  # the file data.path names now is not the run's (another file of that name here)
        return ("resume where data.path names the run's own file (a relative data.path is read from the folder "
                "the run was started in)")
    if msg.startswith("solvers.") and ".models_dir: no such folder" in msg and "(relative to" in msg:
        return "a relative models_dir is read from the folder the run was started in: resume from there"
    return "resume with --config FILE.toml, the config the run was started with"


def _recorded_config(args) -> dict | None:
    """The config recorded in --out's config.json when `run --resume --out DIR` names no config,
    solver or data (bench/config.py: parse_recorded), so a run resumes without its TOML; None
    otherwise, or when DIR holds no readable config.json (then the default config is resumed, and
    a folder that is not a run of it is refused as before: bench/store.py, prepare)."""
    if not (args.resume and args.out and args.config is None and not args.solver and args.data is None):
        return None
    if not (Path(args.out) / "cells.sqlite").is_file():  # not a run folder (a config.json of something else):
        return None  # the default config's refusal says so (bench/store.py, prepare)
    try:
        doc = json.loads((Path(args.out) / "config.json").read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def cmd_run(args) -> int:
    """Run a matrix into --out and print its summary; 0 if no cell errored, else 1."""
    from icl_bench.bench.config import parse_config, parse_recorded
    from icl_bench.config_base import read_toml
    from icl_bench.report.run_summary import cell_warnings, console_summary

    recorded = _recorded_config(args)
    given = "default" if args.config is None else args.config  # --config "" is refused, not the default
    path = resources.config_path(given) if recorded is None else Path(args.out) / "config.json"
    raw = read_toml(path) if recorded is None else recorded
    if recorded is None:
        resources.check_kind(raw, given, "run")
    if args.solver and not all(n.strip() for n in args.solver):
        raise ConfigError("--solver: empty name; give a solver's name (icl-bench list)")
    if args.solver:  # keep the config's parameters for a named solver, defaults otherwise
        tables = raw.get("solvers", {}) if isinstance(raw.get("solvers"), dict) else {}
        from icl_bench.solvers.registry import known_names

        unknown = sorted(set(tables) - set(known_names()) - set(args.solver))
        if unknown:  # a mistyped table, left out with the rest, went unseen (a new-user tryout)
            warnings.warn(f"--solver: the config's [solvers] {', '.join(unknown)} "
                          f"{'name' if len(unknown) > 1 else 'names'} no known solver (a typo?); left out with the "
                          "tables --solver did not select", stacklevel=2)
        raw["solvers"] = {name: tables.get(name, {}) for name in args.solver}
        raw["all_solvers"] = False
    if args.data is not None:
        if not args.data.strip():
            raise ConfigError("--data: empty path; give a CSV file")
        if not (args.x and args.y):
            raise ConfigError("--data: needs --x COLUMN and --y COLUMN")
        if raw.get("data") is not None and path.resolve().parent != resources.configs_dir().resolve():
            raise ConfigError(f"--data: {given} has a [data] table already; give the CSV file in one place: drop "
                              "--data / --x / --y, or the config's [data]")
        if Path(args.data).is_dir():
            raise ConfigError(f"--data: {args.data} is a folder; give a CSV file")
        raw["data"] = {"path": args.data, "x": args.x, "y": args.y}
        if path.resolve().parent == resources.configs_dir().resolve():  # a packaged matrix's noise grid and
            raw.pop("prompts", None)  # [prompts] are for generated prompts: not the user's, so not refused
            if isinstance(raw.get("grid"), dict):  # as a config giving them beside CSV data is (grid.noise)
                raw["grid"].pop("noise", None)
                if isinstance(raw["grid"].get("ood"), list):  # student-t redraws x from the generator's slope
                    from icl_bench.prompts.ood import needs_generator  # (loads torch: not at --help time)

                    dropped = [v for v in raw["grid"]["ood"] if needs_generator(v)]
                    raw["grid"]["ood"] = [v for v in raw["grid"]["ood"] if not needs_generator(v)]
                    if dropped:  # documented, but a run must say what it left out (a review)
                        print(f"icl-bench: --data: the packaged {given!r} matrix's ood values {', '.join(dropped)} "
                              "redraw x from the generator and do not apply to CSV data: left out", file=sys.stderr)
    elif args.x or args.y:
        raise ConfigError("--x/--y: only with --data FILE")
    if args.out is not None and not args.out.strip():  # an empty --cache: refused by run_matrix's cache check
        raise ConfigError("--out: empty path; give a folder")
    if args.scheduler is not None and not args.scheduler.strip():
        raise ConfigError("--scheduler: empty address; give the scheduler's, e.g. tcp://host:8786")
    if args.resume and not args.out:
        raise ConfigError("--resume: needs --out DIR, the folder of the run to continue")
    for flag, value in (("--workers", args.workers), ("--scheduler", args.scheduler)):
        if value is not None and args.executor == "local":  # (the config's key would be named otherwise)
            raise ConfigError(f"{flag}: only with --executor dask, not --executor local")
    flags = {"kind": args.executor, "scheduler": args.scheduler, "n_workers": args.workers,
             "exclusive_timing": True if args.exclusive_timing else None}
    if any(v is not None for v in flags.values()):  # flags override the config's [executor] table
        given = raw.get("executor", {}) if isinstance(raw.get("executor"), dict) else {}
        if (args.scheduler or args.workers is not None) and args.executor is None:
            flags["kind"] = "dask"  # --scheduler / --workers alone mean: run on that cluster / a LocalCluster
        # a flag replaces the table's keys it contradicts, as the flags override the table (docs/scale-out.md;
        # a config's n_workers refused --scheduler, its scheduler --executor local: a review)
        dropped = ({"scheduler", "n_workers", "retries"} if flags["kind"] == "local" else set()) | (
            {"n_workers", "retries"} if args.scheduler else set()) | ({"scheduler"} if args.workers is not None else set())
        given = {k: v for k, v in given.items() if k not in dropped}
        raw["executor"] = {**given, **{k: v for k, v in flags.items() if v is not None}}
    named = [("data.path:", "--data:", args.data), ("data.x:", "--x:", args.data), ("data.y:", "--y:", args.data),
             *[("executor.kind:", f"{f}:", v) for f, v in (("--executor", args.executor), ("--workers", args.workers),
                                                          ("--scheduler", args.scheduler)) if v is not None][:1],
             ("executor.scheduler:", "--scheduler:", args.scheduler),
             ("executor.n_workers:", "--workers:", args.workers),
             *((f"solvers.{name}: unknown name", "--solver: unknown name", name) for name in args.solver or [])]

    def flag_named(exc: Exception) -> ConfigError:  # name the flag the user typed, not the config key it set
        msg = str(exc)
        for key, flag, given in named:
            msg = flag + msg[len(key):] if (given is not None and msg.startswith(key)) else msg
        return ConfigError(msg)

    warn_conflicts(sys.stderr, "icl-bench: ")  # once, before the config is read: a shadowed plugin name must not
    try:  # pass silently, least of all when it explains the refusal below (a review); prefixed as every warning there
        if recorded is not None:
            cfg = parse_recorded(raw)
        else:
            cfg = parse_config(raw, base_dir=None if args.data is not None else path.parent)  # --data: from the current folder
    except ConfigError as exc:
        if recorded is not None and str(flag_named(exc)) == str(exc):  # (a flag typed beside --resume is named)
            raise ConfigError(f"--resume: the config recorded in {path} no longer loads: {exc}; {_advice(exc)}") from None
        if args.resume and args.config is None and (args.data is not None or args.solver):  # (a review: the
            raise ConfigError(f"{flag_named(exc)} (--resume with --data or --solver and no --config reads the packaged "
                              "default matrix, not the run's config.json: drop them to resume the run as "
                              "recorded)") from None  # message blamed the file for the default grid's N = 300)
        raise flag_named(exc) from None
    if cfg.data is not None:
        from icl_bench.prompts.data import data_summary, snapshot

        note = data_summary(cfg.data, snapshot(cfg.data))[2]  # of the bytes checked, which the run uses
        if note:
            print(f"icl-bench: {note}", file=sys.stderr)
    made = None if args.out else first_existing(RUNS_ROOT)  # above the folders a run without --out makes
    out = Path(args.out) if args.out else fresh_run_folder()
    started = datetime.now().timestamp()
    try:
        try:
            table = _run_matrix(cfg, out, resume=args.resume, progress=not args.no_progress, cache=args.cache)
        except BaseException:  # refused or stopped before the store wrote to it (a review: an empty folder
            if args.out is None:  # and a resume line that --resume refused)
                drop_made_folders(out, made)
            raise
        print(console_summary(table))
        print(f"wrote {out / 'results.parquet'}, results.csv, metadata.json ({len(table)} cells)")
        cell_warnings(table)
    except ConfigError as exc:  # e.g. an unreachable --scheduler, found when the cluster is joined
        other = "holds a run of another config" in str(exc)  # (store.prepare's refusal of a --resume)
        changed = [f for f, v in (("--solver", args.solver), ("--data", args.data)) if v]
        if other and recorded is not None:  # the record, read back, differs from itself (a review)
            raise ConfigError(f"--resume: {path}, read back, describes another matrix than its run's: it was written "
                              "by an older icl-bench, whose config lacked keys added since (grid.d, grid.ood, ...); "
                              "resume it with the icl-bench version that made it") from None
        if other and changed:  # the flag made the difference (the hint named only the --config; a tryout)
            many = len(changed) > 1
            raise ConfigError(f"{exc}; {' and '.join(changed)} {'change' if many else 'changes'} the config: drop "
                              f"{'them' if many else 'it'} to resume the run as it was started") from None
        raise flag_named(exc) from None
    except (KeyboardInterrupt, RunAborted) as exc:
        meta = out / "metadata.json"  # written last: this run's table is complete (a Ctrl-C while a Dask
        if meta.is_file() and meta.stat().st_mtime >= started:  # cluster shuts down, or the summary prints)
            print(f"icl-bench: interrupted after the run had finished; its table is complete in {out}", file=sys.stderr)
            return _interrupt_code(exc) if isinstance(exc, KeyboardInterrupt) else 1
        what = _interrupted(exc) if isinstance(exc, KeyboardInterrupt) else f"error: {flag_named(exc)}"
        done = getattr(exc, "cells_done", None)  # (runner._recorded: cells stored, of the matrix, to run again)
        cells = f"{done[0]} of {done[1]} cells finished, kept" if done else "the finished cells are kept"
        again = (f" ({done[2]} of them skipped or failed, which --resume runs again)" if done and done[2] else "")
        from icl_bench.bench.store import CONFIG_NAME  # (what --resume needs to find in `out`)

        if (out / CONFIG_NAME).is_file():
            kept = f"; {cells} in {out}{again}. Resume with:\n  {_resume_command(args.argv, out)}"
        elif args.out is None:  # (no resume line where --resume would refuse: a folder made and removed,
            kept = f" before anything was stored; the empty folder {out} was removed"  # one left empty (a
        else:  # tryout: an empty --out named a resume that failed), or one never made)
            kept = f" before anything was stored in {out}" if out.is_dir() else f" before {out} was made"
        print(f"icl-bench: {what}{kept}", file=sys.stderr)
        return _interrupt_code(exc) if isinstance(exc, KeyboardInterrupt) else 1
    return 1 if (table.status == "error").any() else 0
