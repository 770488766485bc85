"""`python -m icl_bench` = the `icl-bench` command."""
import sys

from icl_bench.cli import main

sys.exit(main())
