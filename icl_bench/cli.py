"""`icl-bench` command line: list, run, train, sweep, analyze, publish, docs (each a thin handler over
the package's stages; docs/design.md, "Command line").

Exit codes (every subcommand):
    0    done; for `run`: every cell is ok or skipped. Skipped cells (CUDA absent, no fitting
         checkpoint, ...) are counted by reason in the summary on stdout; those a user may not
         expect (a plugin that fails to import while running every solver, a cell with no
         well-posed prompt) and cells whose solver answered no prompt also get a WARNING line
         on stderr, so they are never silent; so does, before the matrix, a plugin name ignored
         because a built-in or an earlier plugin takes it.
    1    `run` only: some cell errored (rows are still written for every cell). A solver asked for
         by name ([solvers.NAME] or --solver) that fails to import counts as an error.
    2    bad input (config, flags, data, checkpoints, a used --out): one line
         `icl-bench: error: <field>: <problem>`, no traceback, nothing written.
    130  interrupted (Ctrl-C); `run` prints the command that resumes it. 143: the same on SIGTERM.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from importlib.metadata import version
from pathlib import Path

from icl_bench import resources
from icl_bench.cli_models import cmd_analyze, cmd_sweep, cmd_train
from icl_bench.cli_run import _interrupt_code, _interrupted, cmd_run, warn_conflicts
from icl_bench.errors import ConfigError
from icl_bench.files import refuse_link_loop
from icl_bench.startup import load_libraries, sigterm_as_interrupt


PATH_FLAGS = ("--out", "--cache", "--readme", "--config", "--data", "--checkpoint")  # flags that name a path
# the axes `publish --at` accepts, for its help: the grid axes, bench/axes.py AXIS_NAMES, which publish
# validates against (report/aggregate.py). Spelled out because bench/axes.py loads torch, which --help
# does not (2 s); tests/test_cli_guards.py checks the two are equal.
AT_AXES = ("N", "noise", "R", "dtype", "device", "d", "ood")


def _packaged(kind: str) -> str:
    """The packaged configs a command runs, for its --config help (icl_bench/configs/*.toml)."""
    return ", ".join(resources.config_names(kind))


def _field_form(message: str, prog: str) -> str:
    """argparse's error messages in the suite's `field: problem` form, naming what it accepts:
    "argument --workers: invalid int value: 'x'" -> "--workers: 'x' is not an integer";
    "the following arguments are required: CHECKPOINT" -> "CHECKPOINT: required (icl-bench analyze
    --help)". A message of another shape is kept as argparse wrote it."""
    usage = f"({prog} --help)"
    if m := re.fullmatch(r"the following arguments are required: (.*)", message):
        return f"{m[1]}: required {usage}"
    if m := re.fullmatch(r"ambiguous option: (\S+) could match (.*)", message, re.S):
        return f"{m[1]}: ambiguous, could be {m[2]} {usage}"
    if not (m := re.fullmatch(r"argument ([^:]+): (.*)", message, re.S)):
        return message
    field, problem = m[1], m[2]
    if v := re.fullmatch(r"invalid (int|float) value: (.*)", problem):
        return f"{field}: {v[2]} is not {'an integer' if v[1] == 'int' else 'a number'} {usage}"
    if v := re.fullmatch(r"invalid choice: (.*) \(choose from (.*)\)", problem):
        return f"{field}: {v[1]} is not one of {v[2].replace(chr(39), '')} {usage}"
    if v := re.fullmatch(r"expected (one|at least one) argument", problem):
        return f"{field}: needs a value {usage}"
    if v := re.fullmatch(r"ignored explicit argument (.*)", problem):
        return f"{field}: takes no value (got {v[1]}) {usage}"
    return f"{field}: {problem}"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage + message by default)
        if message == "the following arguments are required: command":  # a bare `icl-bench`
            commands = next(a.choices for a in self._actions if isinstance(a, argparse._SubParsersAction))
            message = f"command: give one of {', '.join(commands)} (icl-bench --help; icl-bench COMMAND --help)"
        raise ConfigError(_field_form(message, self.prog))

    def parse_args(self, args=None, namespace=None):  # argparse's "unrecognized arguments: x" names
        argv = list(sys.argv[1:] if args is None else args)  # neither the field nor the command
        args, extra = self.parse_known_args(argv, namespace)
        if extra:
            command = getattr(args, "command", None)  # (an unknown option before the command is the top level's)
            before = command in argv and any(a in argv[:argv.index(command)] for a in extra)
            prog = f"{self.prog} {command}" if command and not before else self.prog
            hint = _param_flag_hint(extra) if command == "run" and not before else ""
            raise ConfigError(f"{' '.join(extra)}: not an argument of {prog} ({prog} --help){hint}")
        return args


LIST_FOOTER = ("Parameters are config keys, not command-line flags: set them in a matrix config's [solvers.NAME] "
               "table, e.g. [solvers.gd-lsa] steps = [1, 4, 16] (a list is a grid), then icl-bench run --config FILE.toml")


def _param_flag_hint(extra: list[str]) -> str:
    """`run --steps 4`: say that a solver parameter is a key of the config's [solvers.NAME] table
    (`extra`: the arguments `run` did not recognise)."""
    flags = [a[2:].partition("=")[0].replace("-", "_") for a in extra if a.startswith("--")]
    if not flags:
        return ""
    from icl_bench.solvers.registry import list_solvers

    params = {p for info in list_solvers() if not info.error for p in info.params}  # once: 300 unknown flags took 14 s
    hit = [f for f in flags if f in params]
    return f"; {hit[0]} is a solver parameter: a key of the config's [solvers.NAME] table (icl-bench list)" if hit else ""


def cmd_list(args) -> int:
    """Print every registered solver, its parameters (config keys) and origin; exit 0."""
    from icl_bench.solvers.registry import list_solvers

    for info in list_solvers():
        print(f"{info.name}  [{info.origin}]")
        if info.error:
            print(f"    BROKEN: {info.error}")
            continue
        if info.doc:
            print(f"    {info.doc}")
        for pname, p in info.params.items():
            print(f"    {p.describe(pname)}")
    print(LIST_FOOTER)
    warn_conflicts()
    return 0


def cmd_docs(args) -> int:
    """Without NAME: list the docs (name, title) and their folder (--path: only the folder); with
    NAME: print that doc's markdown (--path: only its path); exit 0. An unknown NAME is a
    ConfigError (exit 2)."""
    if args.name is None and args.path:
        print(resources.docs_dir())
        return 0
    if args.name is not None:
        path = resources.doc_path(args.name)
        print(path if args.path else path.read_text(encoding="utf-8"), end="\n" if args.path else "")
        return 0
    names = resources.doc_names()
    if not names:
        raise ConfigError(f"docs: no docs installed (looked in {resources.docs_dir()})")
    width = max(map(len, names))
    for name in names:
        with open(resources.docs_dir() / f"{name}.md", encoding="utf-8") as f:
            title = next((line[2:].strip() for line in f if line.startswith("# ")), "")
        print(f"{name:<{width}}  {title}")
    print(f"in {resources.docs_dir()}; messages and tables cite them as docs/<name>.md; "
          "`icl-bench docs NAME` prints one")
    return 0


def cmd_publish(args) -> int:
    """Aggregate run folders into --out (tables, plots, index.html), optionally a README block."""
    from icl_bench.report.docblock import read_block, replace_block
    from icl_bench.report.publish import publish

    at = {}
    for item in args.at or []:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ConfigError(f"--at: expected AXIS=VALUE (e.g. R=100), got {item!r}")
        if key in at:  # the last one used to win silently
            raise ConfigError(f"--at: {key} is given twice ({key}={at[key]}, {item}); give each axis once")
        at[key] = value
    if args.checkpoint:  # an explicitly named checkpoint must load (ConfigError otherwise)
        from icl_bench.solvers.checkpoint import checkpoint_path, load_checkpoint

        for name in args.checkpoint:  # a path, or a shipped model's name as for analyze
            try:
                load_checkpoint(checkpoint_path(name, "--checkpoint"))
            except ConfigError as exc:  # name the flag: "--checkpoint: ... is a folder; ..."
                raise ConfigError(re.sub(r"^checkpoint:", "--checkpoint:", str(exc))) from None
    if args.readme is not None and not args.readme.strip():  # (it was skipped without a word: a review)
        raise ConfigError("--readme: empty path; give the README file")
    if args.readme:  # check the target block before anything is written
        if Path(args.readme).is_dir():
            raise ConfigError(f"--readme: {args.readme} is a folder; give the README file")
        if not Path(args.readme).is_file():
            raise ConfigError(f"--readme: no such file {args.readme!r}")
        read_block(args.readme, "headline")
        # it is replaced through a temp file beside it: an unwritable folder was refused only after the
        # whole report was written, naming the temp file instead of --readme (a review)
        folder = Path(args.readme).resolve().parent
        if not os.access(folder, os.W_OK) or not os.access(args.readme, os.W_OK):
            raise ConfigError(f"--readme: cannot write {args.readme} (its folder {folder} or the file is not writable)")
    seen = set()
    for d in args.run_dirs:  # the same run twice would count every cell twice
        refuse_link_loop(d, "RUN_DIR", "give the --out folder of `icl-bench run`")  # (resolve raises RuntimeError)
        key = Path(d).resolve()
        if key in seen:
            raise ConfigError(f"RUN_DIR: {d} is given twice")
        seen.add(key)
    result = publish(args.run_dirs, args.out, force=args.force, at=at, checkpoints=args.checkpoint or [],
                     readme=args.readme)
    if args.readme:
        replace_block(args.readme, "headline", (Path(result["out"]) / "headline.md").read_text())
        print(f"updated the headline block of {args.readme}")
    for note in result["notes"]:
        print(f"note: {note}")
    print(f"wrote {len(result['files'])} files to {result['out']} (open {result['out'] / 'index.html'})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand; each sets `func`, its handler."""
    p = _Parser(prog="icl-bench", description="Benchmark in-context learning algorithms for linear regression.")
    p.add_argument("--version", action="version", version=f"icl-bench {version('icl-bench')}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def command(name: str, text: str) -> argparse.ArgumentParser:  # its own --help says what it does too
        return sub.add_parser(name, help=text, description=text)

    command("list", "list solvers, their parameters and where they come from").set_defaults(func=cmd_list)
    run = command("run", "run a benchmark matrix (default: the packaged default matrix)")
    run.add_argument("--config", help=f"matrix config: a TOML file or a packaged matrix ({_packaged('run')}; default: default); "
                     "training configs: `icl-bench train`, sweeps: `icl-bench sweep`")
    run.add_argument("--out", help="output folder (default: results/runs/<timestamp>)")
    run.add_argument("--solver", action="append", help="run only this solver (repeatable)")
    run.add_argument("--resume", action="store_true", help="reuse the finished cells in --out")
    run.add_argument("--data", help="CSV file to draw prompts from instead of the generator")
    run.add_argument("--x", help="CSV column of x (with --data)")
    run.add_argument("--y", help="CSV column of y (with --data)")
    run.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    run.add_argument("--cache", help="folder of finished cells shared across runs: reuse a cell by its key, add new ones")
    run.add_argument("--executor", help="where cells run: local (default, this process) or dask (docs/scale-out.md)")
    run.add_argument("--scheduler", metavar="ADDRESS", help="Dask scheduler to use, e.g. tcp://host:8786 "
                     "(implies --executor dask; without it, dask starts a LocalCluster)")
    run.add_argument("--workers", type=int, metavar="N", help="worker processes of the dask LocalCluster (default 2; implies --executor dask)")
    run.add_argument("--exclusive-timing", action="store_true",
                     help="time at most one cell per machine at a time (others compute meanwhile)")
    run.set_defaults(func=cmd_run)
    for name in ("publish", "report"):  # `report` is an alias
        pub = command(name, "aggregate run folders into tables, plots and index.html"
                             + (" (alias of publish)" if name == "report" else ""))
        pub.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="folders written by `icl-bench run`")
        pub.add_argument("--out", required=True, help="output folder (must be absent or empty unless --force)")
        pub.add_argument("--force", action="store_true", help="replace an earlier report at --out (a folder publish wrote, holding nothing else) once the new one is complete")
        pub.add_argument("--at", action="append", metavar="AXIS=VALUE",
                         help=f"fix an axis of the plots and headline ({', '.join(AT_AXES)}); repeatable")
        pub.add_argument("--checkpoint", action="append", help="a trained-model checkpoint (a path, or a shipped name such as trained-l1-R100) to draw beside the construction")
        pub.add_argument("--readme", help="also rewrite the <!-- headline:begin/end --> block of this file with headline.md")
        pub.set_defaults(func=cmd_publish)
    ana = command("analyze", "mechanism analysis of a checkpoint: sparsity, similarity to the construction, probes")
    ana.add_argument("checkpoint", metavar="CHECKPOINT",
                     help="<stem>.safetensors, <stem>.json, the stem, or a shipped checkpoint's name (e.g. trained-l1-R100)")
    ana.add_argument("--out", help="write every number to this JSON file")
    ana.add_argument("--n-prompts", type=int, default=2048, help="analysis prompts (default 2048)")
    ana.add_argument("--seed", type=int, default=0, help="seed of the prompts and the alignment search")
    ana.add_argument("--N", type=int, default=None, help="context length (default: the checkpoint's)")
    ana.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as run and train; 0 = torch's "
                     "default: on a shared machine more threads mostly wait, see docs/throughput.md)")
    ana.set_defaults(func=cmd_analyze)
    tr = command("train", "train transformers from a TOML config and save checkpoints")
    tr.add_argument("--config", default="train", help="training TOML ([defaults] + [runs.NAME]) or a packaged "
                    f"training config ({_packaged('train')}; default: train)")
    tr.add_argument("--out", default="models", help="folder for <name>.safetensors + <name>.json (default: ./models)")
    tr.add_argument("--run", action="append", default=None, help="train only this run (repeatable; default: all)")
    tr.add_argument("--steps", type=int, default=None, help="override every run's step budget (e.g. 20 for a smoke test)")
    tr.add_argument("--no-progress", action="store_true", help="no progress bars")
    tr.add_argument("--force", action="store_true", help="overwrite checkpoints of the same names in --out")
    tr.set_defaults(func=cmd_train)
    sw = command("sweep", "l1 sweep: train a lambda grid x seeds and tabulate what the penalty changes")
    sw.add_argument("--config", default="l1_sweep", help=f"sweep TOML ([sweep] + [train]) or a packaged sweep config "
                    f"({_packaged('sweep')}; default: l1_sweep)")
    sw.add_argument("--reuse", action="store_true", help="reuse checkpoints already saved by an earlier sweep")
    sw.add_argument("--force", action="store_true", help="overwrite the tables <out>.md / .csv and retrain over the "
                    "checkpoints in <out>_models/ (with --reuse: the tables, and a saved checkpoint that cannot be reused: a half pair, a damaged file, other [train] settings)")
    sw.add_argument("--no-progress", action="store_true", help="no progress bars")
    sw.set_defaults(func=cmd_sweep)
    doc = command("docs", "list the docs that messages and tables cite (docs/<name>.md), or print one")
    doc.add_argument("name", nargs="?", metavar="NAME", help="a doc's name (analysis, docs/analysis.md); "
                     "without it: the list")
    doc.add_argument("--path", action="store_true", help="print the doc's path, not its text")
    doc.set_defaults(func=cmd_docs)
    return p


LIGHT = {"docs"}  # commands that need none of startup.LIBRARIES (a doc page printed in 0.3 s, not 5)


def _one_line_warning(fallback):
    """A warnings.showwarning that prints the suite's own warnings (raised from a file of this
    package) as one line, `icl-bench: WARNING: <message>`, not Python's two lines with a source
    path; any other warning (torch's, a plugin's) goes to `fallback` as before."""
    package = str(Path(__file__).resolve().parent) + os.sep

    def show(message, category, filename, lineno, file=None, line=None):
        if str(Path(filename).resolve()).startswith(package):
            print(f"icl-bench: WARNING: {' '.join(str(message).splitlines())}", file=file or sys.stderr, flush=True)
        else:
            fallback(message, category, filename, lineno, file, line)
    return show


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `icl-bench` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)  # before torch & co load (2-5 s): --help, --version at once
        if args.command not in LIGHT and load_libraries():  # a Ctrl-C while numpy / torch loaded: held
            raise KeyboardInterrupt  # back until they are whole
        args.argv = argv  # for messages that repeat the command (the resume line)
        with sigterm_as_interrupt(), warnings.catch_warnings():  # (sigterm: `kill` / a batch time limit: stopped
            warnings.showwarning = _one_line_warning(warnings.showwarning)  # as on Ctrl-C, with the resume line)
            return args.func(args)
    except ConfigError as exc:
        print(f"icl-bench: error: {' '.join(str(exc).splitlines())}", file=sys.stderr)  # always one line
        return 2
    except KeyboardInterrupt as exc:
        print(f"icl-bench: {_interrupted(exc)}", file=sys.stderr)
        return _interrupt_code(exc)
    except BrokenPipeError:  # stdout closed early (`icl-bench list | head`): no message, the exit code
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # of a writer killed by SIGPIPE
        return 141  # (128 + 13, as `cat file | head` gives): never a success that hides errored cells
    except OSError as exc:  # an unwritable / unreadable path named on the command line: name its flag
        # no file name: a write to stdout (`list`, `docs`: they have no --out; a tryout) or to --out
        where = "stdout" if argv[:1] in (["list"], ["docs"]) else "--out"
        if exc.filename is not None:  # the flag whose value is that path, a folder above it or a file below it
            name, given = str(exc.filename), [*zip(argv, argv[1:]), *(a.split("=", 1) for a in argv if "=" in a)]
            full = lambda f: next((p for p in PATH_FLAGS if len(f) > 3 and p.startswith(f)), None)  # noqa: E731 (--ou)
            flag = next((full(f) for f, v in given if full(f) and (
                v == name or v.startswith(f"{name}/") or name.startswith(f"{v.rstrip('/')}/"))), None)
            run_dir = argv[:1] == ["publish"] and any(  # publish's positional RUN_DIRs (a review: unnamed)
                not v.startswith("-") and (name == v or name.startswith(f"{v.rstrip('/')}/")) for v in argv[1:])
            where = f"{flag}: {name}" if flag else f"RUN_DIR: {name}" if run_dir else name
        print(f"icl-bench: error: {where}: {exc.strerror or type(exc).__name__}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
