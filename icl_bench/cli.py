"""`icl-bench` command line: list, run, train, analyze, publish.

Exit codes (every subcommand):
    0    done; for `run`: every cell is ok or skipped. Skipped cells (CUDA absent, no fitting
         checkpoint, a plugin that fails to import while running every solver) and cells whose
         solver answered no prompt are listed on stderr, so they are never silent.
    1    `run` only: some cell errored (rows are still written for every cell). A solver asked for
         by name ([solvers.NAME] or --solver) that fails to import counts as an error.
    2    bad input (config, flags, data, checkpoints, a used --out): one line
         `icl-bench: error: <field>: <problem>`, no traceback, nothing written.
    130  interrupted (Ctrl-C); `run` prints the command that resumes it.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from datetime import datetime
from pathlib import Path

from icl_bench.errors import ConfigError

DEFAULT_CONFIG = "benchmarks/default.toml"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage + message by default)
        raise ConfigError(message)


def default_config_path() -> Path:
    """benchmarks/default.toml of the source checkout (or of the current folder)."""
    for base in (Path(__file__).resolve().parents[1], Path.cwd()):
        if (base / DEFAULT_CONFIG).is_file():
            return base / DEFAULT_CONFIG
    raise ConfigError(f"--config: no default matrix found ({DEFAULT_CONFIG}); pass --config FILE.toml")


def cmd_list(args) -> int:
    from icl_bench.registry import conflicts, list_solvers

    for info in list_solvers():
        print(f"{info.name}  [{info.origin}]")
        if info.error:
            print(f"    BROKEN: {info.error}")
            continue
        if info.doc:
            print(f"    {info.doc}")
        for pname, p in info.params.items():
            choices = f" choices: {', '.join(map(str, p.choices))}" if p.choices else ""
            print(f"    --{pname} = {p.default!r}  {p.help}{choices}")
    for line in conflicts():
        print(f"WARNING: {line}")
    return 0


def _run_matrix(*args, **kwargs):
    from icl_bench.runner import run_matrix

    return run_matrix(*args, **kwargs)


def _resume_command(argv: list[str], out: Path) -> str:
    """The `icl-bench run ...` line that continues an interrupted run in `out`."""
    argv = list(argv)
    if "--out" not in argv and not any(a.startswith("--out=") for a in argv):
        argv += ["--out", str(out)]
    if "--resume" not in argv:
        argv.append("--resume")
    return shlex.join(["icl-bench", *argv])


def _report_cells(table) -> None:
    """stderr lines for cells that are not plain successes: skipped plugins that failed to
    import (once per solver), cells whose solver answered no prompt, the first errors."""
    from icl_bench.runner import NO_ANSWER

    broken = table[(table.status == "skipped") & table.message.str.contains("failed to load", regex=False)]
    for solver, rows in broken.groupby("solver"):
        print(f"icl-bench: WARNING: solver {solver!r} skipped ({len(rows)} cells): {rows.message.iloc[0]}", file=sys.stderr)
    silent = table[(table.status == "ok") & table.message.str.startswith(NO_ANSWER)]
    for solver, rows in silent.groupby("solver"):
        print(f"icl-bench: WARNING: {solver}: {NO_ANSWER} in {len(rows)} of {int((table.solver == solver).sum())} cells "
              f"(e.g. N={rows.N.iloc[0]} R={rows.R.iloc[0]} {rows.dtype.iloc[0]}: {rows.message.iloc[0]})", file=sys.stderr)
    errors = table[table.status == "error"]
    for _, r in errors.head(5).iterrows():
        print(f"error: {r['solver']} {r['solver_params']} N={r['N']} R={r['R']} {r['dtype']} {r['device']}: {r['message']}",
              file=sys.stderr)


def cmd_run(args) -> int:
    from icl_bench.config import parse_config, read_toml

    path = Path(args.config) if args.config else default_config_path()
    raw = read_toml(path)
    if args.solver:  # keep the config's parameters for a named solver, defaults otherwise
        given = raw.get("solvers", {}) if isinstance(raw.get("solvers"), dict) else {}
        raw["solvers"] = {name: given.get(name, {}) for name in args.solver}
        raw["all_solvers"] = False
    if args.data is not None:
        if not (args.x and args.y):
            raise ConfigError("--data: needs --x COLUMN and --y COLUMN")
        raw["data"] = {"path": args.data, "x": args.x, "y": args.y}
    elif args.x or args.y:
        raise ConfigError("--x/--y: only with --data FILE")
    if args.resume and not args.out:
        raise ConfigError("--resume: needs --out DIR, the folder of the run to continue")
    try:
        cfg = parse_config(raw, base_dir=path.parent)
    except ConfigError as exc:  # name the flag the user typed, not the config key it set
        msg = str(exc)
        if args.data is not None:
            for key, flag in (("data.path:", "--data:"), ("data.x:", "--x:"), ("data.y:", "--y:")):
                msg = flag + msg[len(key):] if msg.startswith(key) else msg
        raise ConfigError(msg) from None
    out = Path(args.out) if args.out else Path("results/runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    if cfg.data is not None:
        from icl_bench.data import data_summary

        note = data_summary(cfg.data)[2]
        if note:
            print(f"icl-bench: {note}", file=sys.stderr)
    try:
        table = _run_matrix(cfg, out, resume=args.resume, progress=not args.no_progress, cache=args.cache)
    except KeyboardInterrupt:
        print(f"icl-bench: interrupted; the finished cells are kept in {out}. Resume with:\n"
              f"  {_resume_command(args.argv, out)}", file=sys.stderr)
        return 130
    summary = table.groupby("solver").agg(
        ok=("status", lambda s: int((s == "ok").sum())),
        skipped=("status", lambda s: int((s == "skipped").sum())),
        error=("status", lambda s: int((s == "error").sum())),
        median_mse_vs_ols=("mse_vs_ols", "median"),
        median_prompts_per_s=("prompts_per_s", "median"),
    )
    print(summary.to_string(float_format=lambda v: f"{v:.3g}"))
    print(f"wrote {out / 'results.parquet'}, results.csv, metadata.json ({len(table)} cells)")
    _report_cells(table)
    return 1 if (table.status == "error").any() else 0


def cmd_publish(args) -> int:
    from icl_bench.docblock import read_block, replace_block
    from icl_bench.publish import publish

    at = {}
    for item in args.at or []:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ConfigError(f"--at: expected AXIS=VALUE (e.g. R=100), got {item!r}")
        at[key] = value
    if args.checkpoint:  # an explicitly named checkpoint must load (ConfigError otherwise)
        from icl_bench.checkpoint import load_checkpoint

        for path in args.checkpoint:
            load_checkpoint(path)
    if args.readme:  # check the target block before anything is written
        if not Path(args.readme).is_file():
            raise ConfigError(f"--readme: no such file {args.readme!r}")
        read_block(args.readme, "headline")
    result = publish(args.run_dirs, args.out, force=args.force, at=at, checkpoints=args.checkpoint or [])
    if args.readme:
        replace_block(args.readme, "headline", (Path(result["out"]) / "headline.md").read_text())
        print(f"updated the headline block of {args.readme}")
    for note in result["notes"]:
        print(f"note: {note}")
    print(f"wrote {len(result['files'])} files to {result['out']} (open {result['out'] / 'index.html'})")
    return 0


def cmd_analyze(args) -> int:
    from icl_bench.analysis import run_cli

    return run_cli(args.checkpoint, out=args.out, n_prompts=args.n_prompts, seed=args.seed, N=args.N)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="icl-bench", description="Benchmark in-context learning algorithms for linear regression.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser("list", help="list solvers, their parameters and where they come from").set_defaults(func=cmd_list)
    run = sub.add_parser("run", help="run a benchmark matrix (default: benchmarks/default.toml)")
    run.add_argument("--config", help="matrix config (TOML)")
    run.add_argument("--out", help="output folder (default: results/runs/<timestamp>)")
    run.add_argument("--solver", action="append", help="run only this solver (repeatable)")
    run.add_argument("--resume", action="store_true", help="reuse the finished cells in --out")
    run.add_argument("--data", help="CSV file to draw prompts from instead of the generator")
    run.add_argument("--x", help="CSV column of x (with --data)")
    run.add_argument("--y", help="CSV column of y (with --data)")
    run.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    run.add_argument("--cache", help="folder of finished cells shared across runs: reuse a cell by its key, add new ones")
    run.set_defaults(func=cmd_run)
    for name in ("publish", "report"):  # `report` is an alias
        pub = sub.add_parser(name, help="aggregate run folders into tables, plots and index.html"
                             + (" (alias of publish)" if name == "report" else ""))
        pub.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="folders written by `icl-bench run`")
        pub.add_argument("--out", required=True, help="output folder (must be absent or empty unless --force)")
        pub.add_argument("--force", action="store_true", help="replace a non-empty --out once the new report is complete")
        pub.add_argument("--at", action="append", metavar="AXIS=VALUE",
                         help="fix an axis of the plots and headline (N, noise, R, dtype, device); repeatable")
        pub.add_argument("--checkpoint", action="append", help="a trained-model checkpoint to draw beside the construction")
        pub.add_argument("--readme", help="also rewrite the <!-- headline:begin/end --> block of this file with headline.md")
        pub.set_defaults(func=cmd_publish)
    ana = sub.add_parser("analyze", help="mechanism analysis of a checkpoint: sparsity, similarity to the construction, probes")
    ana.add_argument("checkpoint", metavar="CHECKPOINT", help="<stem>.safetensors, <stem>.json or the stem")
    ana.add_argument("--out", help="write every number to this JSON file")
    ana.add_argument("--n-prompts", type=int, default=2048, help="analysis prompts (default 2048)")
    ana.add_argument("--seed", type=int, default=0, help="seed of the prompts and the alignment search")
    ana.add_argument("--N", type=int, default=None, help="context length (default: the checkpoint's)")
    ana.set_defaults(func=cmd_analyze)
    from icl_bench.train import add_train_command  # light: torch + tqdm, no pandas

    add_train_command(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `icl-bench` console script; returns the exit code."""
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        args = build_parser().parse_args(argv)
        args.argv = argv  # for messages that repeat the command (the resume line)
        return args.func(args)
    except ConfigError as exc:
        print(f"icl-bench: error: {' '.join(str(exc).splitlines())}", file=sys.stderr)  # always one line
        return 2
    except KeyboardInterrupt:
        print("icl-bench: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # an unwritable / unreadable path named on the command line
        where = exc.filename if exc.filename is not None else "--out"
        print(f"icl-bench: error: {where}: {exc.strerror or type(exc).__name__}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
