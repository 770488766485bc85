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
    src = _read(path)
    start, end = _match(src, name, path)
    return re.sub(r"\r\n?", "\n", src[start:end].strip())  # as the text was given, whatever the file's line endings


def replace_block(path: str | Path, name: str, text: str) -> None:
    """Rewrite the text between the NAME markers of `path` with `text` (the markers stay).

    Only that text changes: every byte outside it stays as it was, and `text` is written with the
    file's own line endings (those of its first line: CRLF, CR or LF). The file is replaced
    atomically (files.write_atomic: a crash leaves the old file or the new one, never half of
    it), keeping its permission bits; a symbolic link keeps pointing at the rewritten file.

    Raises:
        ConfigError: `path` is not UTF-8 text, or has no `<!-- NAME:begin ... -->` /
            `<!-- NAME:end -->` pair on lines of their own outside fenced code, or more than one
            begin marker.
    """
    real = Path(path).resolve()  # a link is followed: the file it names is rewritten, the link stays
    src = _read(path)
    start, end = _match(src, name, path)
    ending = re.search(r"\r\n|\r|\n", src)
    nl = ending.group(0) if ending else "\n"
    body = re.sub(r"\r\n|\r|\n", lambda _: nl, text.strip())
    new = src[:start] + nl + body + nl + src[end:]
    write_atomic(real, new.encode("utf-8"), mode=stat.S_IMODE(real.stat().st_mode))


def _read(path: str | Path) -> str:
    """The text of `path` decoded as UTF-8 (whatever the locale), its line endings as they are
    (no newline translation); ConfigError if it is not UTF-8."""
    try:
        return Path(path).read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--readme: {path} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                          "give a UTF-8 markdown file") from None


def _match(src: str, name: str, path) -> tuple[int, int]:
    """(start, end) of the text of the one NAME block of `src`: from the begin marker to the first
    end marker after it. Only a marker alone on its line and outside fenced code (``` or ~~~) counts,
    so a README may quote or show the markers. ConfigError when there is no begin marker, or more
    than one (the second would stay stale, or, with a mistyped end marker between them, the prose
    up to the next end would be replaced; found by reviews), or no end marker after it."""
    n = re.escape(name)
    bol, eol = r"(?:\A\ufeff?|(?<=[\r\n]))[ \t]*", r"[ \t]*(?=[\r\n]|\Z)"  # a line's start (after a BOM) and end
    fenced = _fenced(src)
    begins = [m for m in re.finditer(rf"{bol}<!-- {n}:begin[^>\r\n]*-->{eol}", src) if not fenced(m.start())]
    ends = [m for m in re.finditer(rf"{bol}<!-- {n}:end -->{eol}", src) if not fenced(m.start())]
    if len(begins) > 1:
        line = len(re.findall(r"\r\n|\r|\n", src[:begins[1].start()])) + 1
        raise ConfigError(f"--readme: {path} has {len(begins)} lines <!-- {name}:begin -->, the second at line {line}; "
                          "keep one (markers in fenced code do not count)")
    end = next((e for e in ends if begins and e.start() > begins[0].end()), None)
    if not begins or end is None:
        raise ConfigError(f"--readme: {path} has no block marked <!-- {name}:begin --> ... <!-- {name}:end --> "
                          "(each marker on a line of its own, outside fenced code)")
    return begins[0].end(), end.start()


def _fenced(src: str):
    """A test of whether a position of `src` lies inside a fenced code block (``` or ~~~ at the
    start of a line, up to three spaces in, closed by a fence of the same character, at least as
    long, with nothing after it but spaces: CommonMark's rule; "```python" inside a ``` block is
    its text, not its end)."""
    spans, opened = [], None
    for m in re.finditer(r"(?:\A|(?<=[\r\n])) {0,3}(`{3,}|~{3,})([^\r\n]*)", src):
        if opened is None:
            opened = m
        elif (m.group(1)[0] == opened.group(1)[0] and len(m.group(1)) >= len(opened.group(1))
              and not m.group(2).strip()):
            spans.append((opened.start(), m.end()))
            opened = None
    if opened is not None:  # an unclosed fence runs to the end
        spans.append((opened.start(), len(src)))
    return lambda pos: any(a <= pos < b for a, b in spans)
