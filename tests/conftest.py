"""Shared fixtures: a tiny matrix config and a fake plugin distribution on sys.path."""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

import icl_bench.solvers.registry as registry


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """One torch thread per test process, as `run`, `train` and `analyze` use by default: each
    pytest-xdist worker is a process of its own, and torch's default of one thread per core put
    twice as many threads as cores on the machine, where the many small operations of an analysis
    wait at barriers (one analyze call took 90 s instead of 27; docs/throughput.md). A test that
    needs other threads sets them and puts this count back."""
    torch.set_num_threads(1)
    yield


@pytest.fixture
def tiny_raw() -> dict:
    """A small valid matrix config dict (TOML-shaped)."""
    return {
        "seed": 0, "n_prompts": 64, "batch_size": 32,
        "grid": {"N": [5, 12], "noise": [0.0, 0.1], "R": [100.0], "dtype": ["float32", "float64"], "device": ["cpu"]},
        "solvers": {"ols": {}, "scipy-lstsq": {}},
        "timing": {"repeats": 1},
    }


def write_plugin(root: Path, dist: str, entries: dict[str, str], modules: dict[str, str]) -> Path:
    """Write an installed-looking distribution (dist-info with entry points) plus its modules."""
    info = root / f"{dist}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "\n".join(f"{k} = {v}" for k, v in entries.items())
    (info / "entry_points.txt").write_text(f"[icl_bench.solvers]\n{lines}\n")
    for name, src in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(src))
    return root


GOOD_PLUGIN = '''
    import torch
    from icl_bench import Param, Solver

    class MeanY(Solver):
        """Predict the context mean of y (a deliberately poor plugin solver)."""
        params = {"shift": Param(0.0, "added to the prediction")}

        def predict(self, batch):
            return batch.y.mean(dim=1) + self.values["shift"]
'''


@pytest.fixture
def plugin_path(tmp_path, monkeypatch):
    """sys.path gains a fake distribution with one good and one broken icl_bench.solvers plugin."""
    root = write_plugin(
        tmp_path / "site", "fake-icl-plugin",
        {"plugin-mean-y": "fake_plugin_good:MeanY", "plugin-broken": "fake_plugin_bad:Nope"},
        {"fake_plugin_good": GOOD_PLUGIN, "fake_plugin_bad": "raise ImportError('this plugin is broken on purpose')\n"},
    )
    monkeypatch.syspath_prepend(str(root))
    yield root
    for name in ("plugin-mean-y", "plugin-broken"):
        registry.REGISTRY.unregister(name)
    for mod in ("fake_plugin_good", "fake_plugin_bad"):
        sys.modules.pop(mod, None)
