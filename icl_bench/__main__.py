"""`python -m icl_bench` = the `icl-bench` command; its console script runs `main` here.

The command line's own modules take 0.2-0.4 s to import (pydantic, the config models) before
`icl_bench.cli.main` can catch anything, so this file, which imports almost nothing, is where
the command starts: a Ctrl-C during that import is recorded and becomes the usual
"icl-bench: interrupted" (exit 130) once the import is whole, not a traceback from a
half-imported module (icl_bench/startup.py says why a half import does harm).
"""
import sys

from icl_bench.startup import sigint_recorded


def main() -> int:
    """Import icl_bench.cli with SIGINT recorded, then run it on sys.argv; returns the exit code
    (130 when a Ctrl-C came during the import: nothing ran)."""
    with sigint_recorded(reraise=False) as seen:
        from icl_bench.cli import main as cli_main
    if seen:
        print("icl-bench: interrupted", file=sys.stderr)
        return 130
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
