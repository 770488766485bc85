"""The one exception type for bad user input (configs, CLI flags, data files, checkpoints).

The CLI turns it into one line on stderr and exit code 2, with no traceback. Its message names
the offending field and the accepted values, e.g. "grid.dtype: unknown value 'f16'; accepted: ...".
"""


class ConfigError(ValueError):
    """Bad user input; the message is one line naming the field and the accepted values."""
