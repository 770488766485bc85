"""Generated blocks inside hand-written docs: `<!-- NAME:begin ... -->` text `<!-- NAME:end -->`.

Tools that publish numbers (icl-bench publish --readme, benchmarks/experiments/summarize.py --update-docs)
rewrite only the text between the two markers, so a README keeps its prose and its tables stay
exactly what the code produced.
"""
from __future__ import annotations

import re
from pathlib import Path

from icl_bench.errors import ConfigError


def read_block(path: str | Path, name: str) -> str:
    """The text between the NAME markers of `path` (stripped). ConfigError if the file is not
    UTF-8 text or the markers are absent."""
    m = _match(_read(path), name, path)
    return m.group(2).strip()


def replace_block(path: str | Path, name: str, text: str) -> None:
    """Rewrite the text between the NAME markers of `path` with `text` (the markers stay).

    Raises:
        ConfigError: `path` is not UTF-8 text or has no `<!-- NAME:begin ... -->` /
            `<!-- NAME:end -->` pair.
    """
    path = Path(path)
    src = _read(path)
    m = _match(src, name, path)
    path.write_text(src[: m.start(2)] + "\n" + text.strip() + "\n" + src[m.end(2):], encoding="utf-8")


def _read(path: str | Path) -> str:
    """The text of `path` decoded as UTF-8 (whatever the locale); ConfigError if it is not UTF-8."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--readme: {path} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                          "give a UTF-8 markdown file") from None


def _match(src: str, name: str, path) -> re.Match:
    pattern = rf"(<!-- {re.escape(name)}:begin[^>]*-->)(.*?)(<!-- {re.escape(name)}:end -->)"
    m = re.search(pattern, src, flags=re.S)
    if m is None:
        raise ConfigError(f"--readme: {path} has no block marked <!-- {name}:begin --> ... <!-- {name}:end -->")
    return m
