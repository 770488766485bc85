"""Generated blocks inside hand-written docs: `<!-- NAME:begin ... -->` text `<!-- NAME:end -->`,
each marker on a line of its own (a marker quoted in prose or inline code is text, not a marker).

Tools that publish numbers (icl-bench publish --readme, benchmarks/experiments/summarize.py --update-docs)
rewrite only the text between the two markers, so a README keeps its prose and its tables stay
exactly what the code produced.
"""
from __future__ import annotations

import re
import stat
from pathlib import Path

from icl_bench.errors import ConfigError
from icl_bench.files import write_atomic


def read_block(path: str | Path, name: str) -> str:
    """The text between the NAME markers of `path` (stripped, LF line endings). ConfigError if the
    file is not UTF-8 text or the markers are absent."""
    m = _match(_read(path), name, path)
    return re.sub(r"\r\n?", "\n", m.group(2).strip())  # as the text was given, whatever the file's line endings


def replace_block(path: str | Path, name: str, text: str) -> None:
    """Rewrite the text between the NAME markers of `path` with `text` (the markers stay).

    Only that text changes: every byte outside it stays as it was, and `text` is written with the
    file's own line endings (those of its first line: CRLF, CR or LF). The file is replaced
    atomically (files.write_atomic: a crash leaves the old file or the new one, never half of
    it), keeping its permission bits; a symbolic link keeps pointing at the rewritten file.

    Raises:
        ConfigError: `path` is not UTF-8 text, or has no `<!-- NAME:begin ... -->` /
            `<!-- NAME:end -->` pair on lines of their own, or more than one.
    """
    real = Path(path).resolve()  # a link is followed: the file it names is rewritten, the link stays
    src = _read(path)
    m = _match(src, name, path)
    ending = re.search(r"\r\n|\r|\n", src)
    nl = ending.group(0) if ending else "\n"
    body = re.sub(r"\r\n|\r|\n", lambda _: nl, text.strip())
    new = src[: m.start(2)] + nl + body + nl + src[m.end(2):]
    write_atomic(real, new.encode("utf-8"), mode=stat.S_IMODE(real.stat().st_mode))


def _read(path: str | Path) -> str:
    """The text of `path` decoded as UTF-8 (whatever the locale), its line endings as they are
    (no newline translation); ConfigError if it is not UTF-8."""
    try:
        return Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--readme: {path} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                          "give a UTF-8 markdown file") from None


def _match(src: str, name: str, path) -> re.Match:
    """The one NAME block of `src`: group 2 is the text between the markers. Only a marker alone on
    its line counts; ConfigError when there is none, or more than one (the second would stay stale)."""
    n = re.escape(name)
    bol, eol = r"(?:\A|(?<=[\r\n]))[ \t]*", r"[ \t]*(?=[\r\n]|\Z)"  # a line's start and end, any line ending
    pattern = rf"{bol}(<!-- {n}:begin[^>\r\n]*-->){eol}(.*?){bol}(<!-- {n}:end -->){eol}"
    found = list(re.finditer(pattern, src, flags=re.S))
    if not found:
        raise ConfigError(f"--readme: {path} has no block marked <!-- {name}:begin --> ... <!-- {name}:end --> "
                          "(each marker on a line of its own)")
    if len(found) > 1:
        line = len(re.findall(r"\r\n|\r|\n", src[:found[1].start()])) + 1
        raise ConfigError(f"--readme: {path} has {len(found)} blocks marked <!-- {name}:begin -->, the second at "
                          f"line {line}; keep one")
    return found[0]
