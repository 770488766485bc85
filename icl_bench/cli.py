"""`icl-bench` command line: list, run, train, analyze, publish.

Bad input (config, flags, data, checkpoints) prints one line `icl-bench: error: <field>: <problem>`
and exits with code 2, without a traceback and without writing anything. A run whose cells
failed exits with code 1 after writing every row.
"""
from __future__ import annotations

import argparse
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


def cmd_run(args) -> int:
    from icl_bench.config import parse_config, read_toml
    from icl_bench.runner import run_matrix

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
    flags = {"kind": args.executor, "scheduler": args.scheduler, "n_workers": args.workers,
             "exclusive_timing": True if args.exclusive_timing else None}
    if any(v is not None for v in flags.values()):  # flags override the config's [executor] table
        given = raw.get("executor", {}) if isinstance(raw.get("executor"), dict) else {}
        if args.scheduler and args.executor is None:
            flags["kind"] = "dask"  # --scheduler alone means: run on that cluster
        raw["executor"] = {**given, **{k: v for k, v in flags.items() if v is not None}}
    try:
        cfg = parse_config(raw, base_dir=path.parent)
    except ConfigError as exc:  # name the flag the user typed, not the config key it set
        msg = str(exc)
        named = [("data.path:", "--data:", args.data), ("data.x:", "--x:", args.data), ("data.y:", "--y:", args.data),
                 ("executor.kind:", "--executor:", args.executor), ("executor.scheduler:", "--scheduler:", args.scheduler),
                 ("executor.n_workers:", "--workers:", args.workers)]
        for key, flag, given in named:
            msg = flag + msg[len(key):] if (given is not None and msg.startswith(key)) else msg
        raise ConfigError(msg) from None
    out = Path(args.out) if args.out else Path("results/runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    table = run_matrix(cfg, out, resume=args.resume, progress=not args.no_progress)
    summary = table.groupby("solver").agg(
        ok=("status", lambda s: int((s == "ok").sum())),
        skipped=("status", lambda s: int((s == "skipped").sum())),
        error=("status", lambda s: int((s == "error").sum())),
        median_mse_vs_ols=("mse_vs_ols", "median"),
        median_prompts_per_s=("prompts_per_s", "median"),
    )
    print(summary.to_string(float_format=lambda v: f"{v:.3g}"))
    print(f"wrote {out / 'results.parquet'}, results.csv, metadata.json ({len(table)} cells)")
    errors = table[table.status == "error"]
    for _, r in errors.head(5).iterrows():
        print(f"error: {r['solver']} {r['solver_params']} N={r['N']} R={r['R']} {r['dtype']} {r['device']}: {r['message']}",
              file=sys.stderr)
    return 1 if len(errors) else 0


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
    run.add_argument("--executor", help="where cells run: local (default, this process) or dask (docs/scale-out.md)")
    run.add_argument("--scheduler", metavar="ADDRESS", help="Dask scheduler to use, e.g. tcp://host:8786 "
                     "(implies --executor dask; without it, dask starts a LocalCluster)")
    run.add_argument("--workers", type=int, metavar="N", help="worker processes of the dask LocalCluster (default 2)")
    run.add_argument("--exclusive-timing", action="store_true",
                     help="time at most one cell per machine at a time (others compute meanwhile)")
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
        args = build_parser().parse_args(argv)
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
