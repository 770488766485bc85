"""The exception types the CLI turns into one line: ConfigError for bad user input (configs, CLI
flags, data files, checkpoints), RunAborted for a run its environment stopped.

The CLI turns a ConfigError into one line on stderr and exit code 2, with no traceback. Its
message names the offending field and the accepted values, e.g. "grid.dtype: unknown value 'f16'; accepted: ...".
`cell_message` makes a solver's own text (an exception, a skip reason, a plugin's import error)
fit one line of a table or a terminal.
"""


class ConfigError(ValueError):
    """Bad user input; the message is one line naming the field and the accepted values."""


class RunAborted(RuntimeError):
    """A run stopped by its environment, not its input (e.g. the Dask scheduler went away mid-run):
    the finished cells are stored; `icl-bench run` prints the message and the resume command and
    exits 1."""


MAX_MESSAGE = 500  # characters of a solver's own text kept in a row's message (cell_message)


def cell_message(text: str, *, prefix: str = "", where: str = "") -> str:
    """A row's message from a solver's text (an exception's, a SkipCell reason): `prefix` + `text` +
    `where` on one line (line breaks become spaces, other control characters are escaped as repr
    does), `text` cut to its first MAX_MESSAGE characters and "… (N characters)" when it is longer
    (a plugin's 10 MB exception would otherwise fill the table, the store and the terminal)."""
    if len(text) > MAX_MESSAGE:
        text = f"{text[:MAX_MESSAGE]}… ({len(text)} characters)"
    text = " ".join(f"{prefix}{text}{where}".splitlines())
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
