"""Run metadata stored beside every result table: what ran, where, with which versions."""
from __future__ import annotations

import platform
import subprocess
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

PACKAGES = ("icl-bench", "torch", "numpy", "scipy", "pandas", "pyarrow", "matplotlib", "seaborn", "safetensors")


def package_versions() -> dict[str, str]:
    """Installed versions of the packages the numbers depend on (plus Python)."""
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def git_commit() -> str:
    """HEAD of the source checkout (with "-dirty" if it has local changes), or "unknown"."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_info() -> dict:
    """CPU and (if present) CUDA device names, thread count and torch build."""
    info = {
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "torch_cuda_build": torch.version.cuda,
    }
    if torch.cuda.is_available():
        info["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def collect(config, *, started: str, table) -> dict:
    """The metadata.json content of one run of `config` (a MatrixConfig) that produced `table`."""
    return {
        "config": config.to_dict(),
        "seed": config.seed,
        "packages": package_versions(),
        "device": device_info(),
        "git_commit": git_commit(),
        "started_at": started,
        "finished_at": datetime.now(timezone.utc).isoformat(),
        "n_cells": int(len(table)),
        "status_counts": {str(k): int(v) for k, v in table["status"].value_counts().items()},
    }
