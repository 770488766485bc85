"""Files that travel with the package: the default configs and the shipped checkpoints.

Found through importlib.resources, so an installed package (a wheel, not only the source tree)
runs `icl-bench run`, `train`, `analyze` and the trained-* solvers from any folder.

    icl_bench/configs/<name>.toml   matrix configs for `run` (default, ood, trained), the training
                                    config for `train` (train: the shipped models), the sweep config
                                    for `sweep` (l1_sweep); config_names(kind) lists them by kind
    icl_bench/models/               the shipped checkpoints and their model card (README.md);
                                    solvers/checkpoint.py's checkpoint_path finds one by name
    icl_bench/docs/<name>.md        in a wheel: the repository's docs/ folder (pyproject.toml maps it),
                                    which messages and tables cite as docs/<name>.md; `icl-bench docs`
                                    shows them (docs_dir: the source tree's docs/ when run from it)
"""
from __future__ import annotations

import difflib
import os
import shlex
from functools import cache
from importlib.resources import files
from pathlib import Path

from icl_bench.errors import ConfigError


@cache  # the package does not move while it runs; importlib.resources costs ~0.1-0.25 ms a call
def _dir(name: str) -> Path:
    return Path(str(files("icl_bench") / name))


def configs_dir() -> Path:
    """The folder of the packaged TOML configs."""
    return _dir("configs")


def models_dir() -> Path:
    """The folder of the shipped checkpoints (<stem>.safetensors + <stem>.json pairs)."""
    return _dir("models")


def docs_dir() -> Path:
    """The docs that messages and tables cite as docs/<name>.md: the package's docs/ in an
    installed wheel, else the source tree's docs/ beside the package (a checkout, an editable install)."""
    shipped = _dir("docs")
    return shipped if shipped.is_dir() else Path(__file__).resolve().parent.parent / "docs"


def doc_names() -> list[str]:
    """Names of the docs (file stems of docs_dir()/*.md), sorted; [] when there is no docs folder."""
    return sorted(p.stem for p in docs_dir().glob("*.md"))


def doc_path(name: str) -> Path:
    """The doc `name`: "analysis", "analysis.md" or "docs/analysis.md" (as messages cite it).

    Raises:
        ConfigError: "NAME: no doc 'x' (did you mean 'y'?); docs: ..." when there is none of that name.
    """
    stem = Path(name).name.removesuffix(".md")
    if stem in doc_names() and Path(name).parent in (Path("."), Path("docs")):
        return docs_dir() / f"{stem}.md"
    close = difflib.get_close_matches(stem.lower(), doc_names(), n=1)  # (REPORT: report)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"NAME: no doc {name!r}{hint}; docs: {', '.join(doc_names()) or 'none installed'}")


# the command that runs each kind of config, and what the kind is called in messages
KINDS = {"run": "matrix", "train": "training", "sweep": "sweep"}


def config_kind(doc: dict) -> str | None:
    """The command a parsed config is for, from its tables: "sweep" (a [sweep] table), "train"
    ([runs.NAME] / [defaults] tables), "run" ([grid] / [solvers] / [timing] tables); None when it
    has none of them (the command's validator then says what is wrong)."""
    if "sweep" in doc:
        return "sweep"
    if "runs" in doc or "defaults" in doc:
        return "train"
    if any(k in doc for k in ("grid", "solvers", "timing")):
        return "run"
    return None


@cache
def _packaged_kind(name: str) -> str | None:
    from icl_bench.config_base import read_toml

    return config_kind(read_toml(configs_dir() / f"{name}.toml"))


def config_names(kind: str | None = None) -> list[str]:
    """Names of the packaged configs (file stems), sorted; only those for command `kind` ("run",
    "train", "sweep": config_kind) when given."""
    names = sorted(p.stem for p in configs_dir().glob("*.toml"))
    return names if kind is None else [n for n in names if _packaged_kind(n) == kind]


def check_kind(doc: dict, given: str | Path, command: str, key: str = "--config") -> None:
    """Refuse a config made for another command, naming the command that runs it (`key`: the
    argument's name in the message).

    Raises:
        ConfigError: e.g. "--config: 'train' is a training config; run it with
            `icl-bench train --config train`".
    """
    kind = config_kind(doc)
    if kind is not None and kind != command:
        raise ConfigError(f"{key}: {str(given)!r} is a {KINDS[kind]} config; run it with "
                          f"`icl-bench {kind} --config {shlex.quote(str(given))}`")


def config_path(name_or_path: str | Path, key: str = "--config") -> Path:
    """A config file: a packaged config's bare name ("default": no folder, no suffix) is that packaged
    config, whatever the current folder holds; else an existing path as given; else, for a name
    without a folder ("default.toml"), the packaged config of that name. A name with a folder
    ("./default", "cfg/x.toml") is only ever that file.

    Raises:
        ConfigError (naming `key`): empty, a path that does not exist (a link to nothing is named so),
            or a name that is neither a file nor a packaged config; lists the packaged names.
    """
    if not str(name_or_path).strip():  # Path("") is ".", which exists
        raise ConfigError(f"{key}: empty path; give a TOML file or a packaged config ({', '.join(config_names())})")
    raw, path = str(name_or_path), Path(name_or_path)
    in_folder = any(sep in raw for sep in {"/", os.sep})  # (Path("./x") drops its "./": the text decides)
    if not in_folder and not path.suffix and (packaged := _packaged(raw)):  # a folder `train/` or `default/` of
        return packaged  # the user's had hidden the packaged config: `icl-bench train` failed (a tryout)
    if path.exists():
        return path
    if path.is_symlink():
        raise ConfigError(f"{key}: {raw} is a link to {os.readlink(path)}, which does not exist")
    if not in_folder and path.suffix == ".toml" and (packaged := _packaged(path.stem)):  # (not for "./train":
        return packaged  # missing, it had trained the 12 packaged runs; a review)
    close = difflib.get_close_matches(path.stem, config_names(), n=1) if not in_folder else []
    hint = f" (did you mean {close[0]!r}?)" if close else ""  # as for a mistyped solver name
    raise ConfigError(f"{key}: no such file {raw!r}{hint}; packaged configs: {', '.join(config_names())}")


def _packaged(name: str) -> Path | None:
    """The packaged config file `name`.toml, or None (a name too long for a file name is none)."""
    try:
        path = configs_dir() / f"{name}.toml"
        return path if path.is_file() else None
    except OSError:  # ENAMETOOLONG: the error named the package's folder, not --config (a review)
        return None
