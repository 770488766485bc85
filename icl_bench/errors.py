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


def cell_message(text: str | BaseException, *, prefix: str = "", where: str = "") -> str:
    """A row's message from a solver's text (an exception's, a SkipCell reason): `prefix` + `text` +
    `where` on one line (line breaks become spaces, other control characters are escaped as repr
    does), `text` cut to its first MAX_MESSAGE characters once escaped and "… (N characters)" when
    it is longer (a plugin's 10 MB exception would otherwise fill the table, the store and the
    terminal). An exception is read with exception_text."""
    if isinstance(text, BaseException):
        text = exception_text(text)
    kept, size, cut = [], 0, len(text) > MAX_MESSAGE  # escape one character at a time, never split an escape
    for c in text[:MAX_MESSAGE].replace("\r\n", "\n"):
        piece = _one_line(c) if c not in "\r\n" else " "
        if size + len(piece) > MAX_MESSAGE:
            cut = True
            break
        kept.append(piece)
        size += len(piece)
    escaped = "".join(kept) + (f"… ({len(text)} characters)" if cut else "")
    return _one_line(prefix) + escaped + _one_line(where)


def exception_text(exc: BaseException) -> str:
    """str(exc), or a placeholder naming its type when its __str__ raises or returns a non-string
    (a plugin's exception must become an error row, not crash the run)."""
    try:
        return str(exc)
    except KeyboardInterrupt:
        raise
    except BaseException:
        return f"<{type(exc).__name__} whose str() failed>"


def _one_line(text: str) -> str:
    text = " ".join(text.splitlines())
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
