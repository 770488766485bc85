"""Provenance of every number the suite writes: package versions, the git commit, the device.

The one place these are read; run folders (bench/store.py), checkpoints (solvers/checkpoint.py)
and published reports (report/publish.py) all record them through here.
"""
from __future__ import annotations

import platform
import subprocess
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


def git_commit(root: str | Path | None = None) -> str:
    """HEAD of the git checkout around `root` (default: this package's source folder), with
    "-dirty" if tracked files have local changes; "unknown" outside a checkout (an installed
    package) or without git."""
    root = Path(root) if root is not None else Path(__file__).resolve().parent
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
