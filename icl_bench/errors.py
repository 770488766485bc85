"""The exception types the CLI turns into one line: ConfigError for bad user input (configs, CLI
flags, data files, checkpoints), RunAborted for a run its environment stopped.

The CLI turns a ConfigError into one line on stderr and exit code 2, with no traceback. Its
message names the offending field and the accepted values, e.g. "grid.dtype: unknown value 'f16'; accepted: ...".
"""


class ConfigError(ValueError):
    """Bad user input; the message is one line naming the field and the accepted values."""


class RunAborted(RuntimeError):
    """A run stopped by its environment, not its input (e.g. the Dask scheduler went away mid-run):
    the finished cells are stored; `icl-bench run` prints the message and the resume command and
    exits 1."""
