"""Checks of what `icl-bench publish` reads from a run folder, before anything uses it.

A run folder may be old, hand-edited or not written by icl-bench at all; whatever is wrong with it
is refused as one ConfigError line that names the file and what was expected (the CLI prints it
and exits with code 2, docs/report.md), never a traceback from deep inside the report.
"""
from __future__ import annotations

import json
from pathlib import Path

from icl_bench.errors import ConfigError


def read_metadata(path: Path) -> dict | None:
    """The run folder's metadata.json as a dict, or None when the folder has none.

    Raises:
        ConfigError: the file cannot be read, is not UTF-8 JSON, or is JSON but not an object
            (`icl-bench run` writes an object: config, seed, versions, device, start / end).
    """
    file = path / "metadata.json"
    if not file.is_file():
        return None
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"RUN_DIR: {file} cannot be read ({exc})") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"RUN_DIR: {file} holds a JSON {_json_kind(meta)}; expected a JSON object "
                          "(the metadata `icl-bench run` writes)")
    return meta


def _json_kind(value) -> str:
    """The JSON name of a decoded value's type (array, string, number, ...)."""
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")
