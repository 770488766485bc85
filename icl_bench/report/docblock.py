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
    """The text between the NAME markers of `path` (stripped). ConfigError if the markers are absent."""
    m = _match(Path(path).read_text(), name, path)
    return m.group(2).strip()


def replace_block(path: str | Path, name: str, text: str) -> None:
    """Rewrite the text between the NAME markers of `path` with `text` (the markers stay).

    Raises:
        ConfigError: `path` has no `<!-- NAME:begin ... -->` / `<!-- NAME:end -->` pair.
    """
    path = Path(path)
    src = path.read_text()
    m = _match(src, name, path)
    path.write_text(src[: m.start(2)] + "\n" + text.strip() + "\n" + src[m.end(2):])


def _match(src: str, name: str, path) -> re.Match:
    pattern = rf"(<!-- {re.escape(name)}:begin[^>]*-->)(.*?)(<!-- {re.escape(name)}:end -->)"
    m = re.search(pattern, src, flags=re.S)
    if m is None:
        raise ConfigError(f"--readme: {path} has no block marked <!-- {name}:begin --> ... <!-- {name}:end -->")
    return m
