"""Files that travel with the package: the default configs and the shipped checkpoints.

Found through importlib.resources, so an installed package (a wheel, not only the source tree)
runs `icl-bench run`, `train`, `analyze` and the trained-* solvers from any folder.

    icl_bench/configs/<name>.toml   default (the matrix), train (the shipped models), trained, l1_sweep
    icl_bench/models/               the shipped checkpoints and their model card (README.md)
"""
from __future__ import annotations

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


def config_names() -> list[str]:
    """Names of the packaged configs (file stems), sorted."""
    return sorted(p.stem for p in configs_dir().glob("*.toml"))


def config_path(name_or_path: str | Path, key: str = "--config") -> Path:
    """A config file: an existing path as given, else the packaged config of that name
    ("default" or "default.toml").

    Raises:
        ConfigError (naming `key`): neither a file nor a packaged config; lists the packaged names.
    """
    path = Path(name_or_path)
    if path.exists():
        return path
    packaged = configs_dir() / (path.name if path.suffix == ".toml" else f"{path.name}.toml")
    if path.parent == Path(".") and packaged.is_file():
        return packaged
    raise ConfigError(f"{key}: no such file {str(path)!r}; packaged configs: {', '.join(config_names())}")
