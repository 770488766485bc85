"""A non-editable install works from any folder: the default configs and the shipped checkpoints
travel with the package (docs/design.md §2). Builds a wheel once, installs it into a fresh
virtual environment (reusing this interpreter's dependencies; the package itself comes only from
the wheel) and runs every command from an unrelated folder."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from icl_bench.config_base import tomllib

ROOT = Path(__file__).resolve().parents[1]


def sh(*cmd, cwd, env=None, timeout=600) -> subprocess.CompletedProcess:
    p = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(map(str, cmd))} exited {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    base = tmp_path_factory.mktemp("install")
    # built from a copy of what the wheel holds: a build in ROOT would rewrite ROOT/build and
    # ROOT/icl_bench.egg-info (where the baselines' entry points are read) under the tests that
    # other pytest-xdist workers run meanwhile
    src = base / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("icl_bench", "icl_bench_baselines", "docs"):  # docs/: pyproject.toml ships it as icl_bench.docs
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", base / "dist", src, cwd=base)
    wheel = next((base / "dist").glob("icl_bench-*.whl"))
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(base / "venv")
    py = base / "venv" / "bin" / "python"
    sh(sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", wheel, cwd=base) \
        if _pip_has_python_flag() else sh(py, "-m", "pip", "install", "--no-deps", "--no-index", wheel, cwd=base)
    work = base / "elsewhere"  # an unrelated folder: no source tree, no benchmarks/, no results/
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{base / 'venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return py, work, env


def _pip_has_python_flag() -> bool:  # pip >= 22.3 can install into another environment
    out = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True).stdout.split()
    major, minor = (int(v) for v in out[1].split(".")[:2])
    return (major, minor) >= (22, 3)


def test_the_package_comes_from_the_wheel(installed):
    py, work, env = installed
    where = sh(py, "-c", "import icl_bench, icl_bench_baselines; print(icl_bench.__file__); print(icl_bench_baselines.__file__)", cwd=work, env=env)
    assert all("venv" in line and "site-packages" in line for line in where.stdout.split()), where.stdout


def test_every_command_runs_from_an_unrelated_folder(installed):
    py, work, env = installed
    cli = [py, "-m", "icl_bench"]
    run = sh(*cli, "run", "--solver", "ols", "--solver", "trained-l1", "--out", "run", "--no-progress", cwd=work, env=env)
    table = json.loads((work / "run" / "metadata.json").read_text())
    assert table["config"]["grid"]["N"] == [10, 30, 100, 300]  # the packaged default matrix
    assert table["status_counts"].get("error", 0) == 0 and "ok" in table["status_counts"], run.stdout
    sh(*cli, "train", "--config", "train", "--run", "trained-l1-R10", "--steps", "3", "--out", "models", "--no-progress",
       cwd=work, env=env)
    assert (work / "models" / "trained-l1-R10.safetensors").is_file()
    ana = sh(*cli, "analyze", "trained-l1-R100", "--n-prompts", "64", "--out", "a.json", cwd=work, env=env)
    doc = json.loads((work / "a.json").read_text())
    assert doc["R"] == 100.0 and "similarity" in ana.stdout
    assert doc["checkpoint"] == "icl_bench/models/trained-l1-R100"  # not this machine's install path
    sh(*cli, "publish", "run", "--out", "pub", cwd=work, env=env)
    assert (work / "pub" / "index.html").is_file() and (work / "pub" / "headline.md").is_file()
    shown = sh(*cli, "docs", "docs/analysis.md", cwd=work, env=env).stdout  # as messages cite it
    assert shown == (ROOT / "docs" / "analysis.md").read_text(encoding="utf-8")
    where = sh(*cli, "docs", "scale-out", "--path", cwd=work, env=env).stdout.strip()
    assert "site-packages" in where and where.endswith("icl_bench/docs/scale-out.md"), where
    listed = sh(*cli, "list", cwd=work, env=env).stdout
    assert "ols  [plugin icl_bench_baselines.ols:OLS" in listed and "trained-l1  [built-in" in listed


def test_the_wheel_lists_every_package_of_the_source_tree():
    """pyproject.toml lists the packages by hand (to map docs/ to icl_bench.docs): a new subpackage
    left out of that list would be missing from the wheel only, unseen by the tests of the checkout."""
    import setuptools

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set(setuptools.find_packages(str(ROOT), include=["icl_bench", "icl_bench.*", "icl_bench_baselines*"]))
    assert listed == found | {"icl_bench.docs"}, (listed ^ (found | {"icl_bench.docs"}))
