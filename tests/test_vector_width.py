"""fused_cpu.wide_vectors: numba's code generator is told to write 512-bit vectors on AVX-512 x86
CPUs (LLVM's Intel server tuning prefers 256 bits), before it compiles anything, and leaves every
other machine and an explicit NUMBA_CPU_FEATURES alone (docs/throughput.md, "Vector width")."""
import os

import pytest

from icl_bench.solvers import fused, fused_cpu

pytestmark = pytest.mark.skipif(not fused.available(), reason="numba is not installed: no fused path to test")


@pytest.fixture
def host(monkeypatch):
    """Pretend the host has the features `host(text)` says, with numba's CPU_FEATURES unset."""
    from numba.core import codegen, config
    from numba.core.registry import cpu_target

    monkeypatch.delenv("NUMBA_CPU_FEATURES", raising=False)
    monkeypatch.setattr(config, "CPU_FEATURES", None)
    monkeypatch.delitem(vars(cpu_target), "_toplevel_target_context", raising=False)  # as before any compile

    def set_host(text: str):
        monkeypatch.setattr(codegen, "get_host_cpu_features", lambda: text)
        return config

    return set_host


def test_avx512_host_gets_wide_vectors(host):
    config = host("+64bit,+avx2,+avx512f,+fma")
    assert fused_cpu.wide_vectors() is True
    assert config.CPU_FEATURES == "+64bit,+avx2,+avx512f,+fma,-prefer-256-bit"


@pytest.mark.parametrize("features", ["+64bit,+avx2,+fma,-avx512f", "+neon,+fp-armv8", ""])
def test_other_hosts_are_left_alone(host, features):
    config = host(features)
    assert fused_cpu.wide_vectors() is False
    assert config.CPU_FEATURES is None


def test_explicit_numba_cpu_features_is_left_alone(host, monkeypatch):
    config = host("+64bit,+avx512f")
    monkeypatch.setenv("NUMBA_CPU_FEATURES", "+64bit,+avx512f")
    assert fused_cpu.wide_vectors() is False
    assert config.CPU_FEATURES is None


def test_host_query_failure_is_left_alone(host, monkeypatch):
    from numba.core import codegen

    config = host("")

    def fail():
        raise RuntimeError("no host")

    monkeypatch.setattr(codegen, "get_host_cpu_features", fail)
    assert fused_cpu.wide_vectors() is False
    assert config.CPU_FEATURES is None


def test_the_kernels_code_generator_has_it_where_the_host_has_avx512():
    """In effect for what this process compiles: set before numba's CPU code generator was made
    (fused.available() runs first), on this machine's real features, unless the environment
    sets numba's features itself (NUMBA_CPU_FEATURES, or NUMBA_CPU_NAME=generic: then "")."""
    from numba.core.codegen import get_host_cpu_features
    from numba.core.registry import cpu_target

    features = cpu_target.target_context.codegen().magic_tuple()[2]
    chosen = "NUMBA_CPU_FEATURES" in os.environ or os.environ.get("NUMBA_CPU_NAME", "").lower() == "generic"
    if chosen:
        expected = "-prefer-256-bit" in os.environ.get("NUMBA_CPU_FEATURES", "").split(",")
    else:
        expected = "+avx512f" in get_host_cpu_features().split(",")
    assert ("-prefer-256-bit" in features.split(",")) == expected


PLUGIN_WITH_NJIT = """
import numba
from icl_bench import Solver


@numba.njit
def _first(y):
    return y[:, 0].copy()


class FirstY(Solver):
    \"\"\"Predict the first context y, through a numba function made when the module is imported.\"\"\"

    def predict(self, batch):
        import torch
        return torch.from_numpy(_first(batch.y.numpy()))
"""


def test_a_plugin_that_uses_numba_does_not_change_the_setting(tmp_path):
    """numba makes its code generator at a plugin's first @njit: the registry must have set the
    vector width before it imports the plugin, so a run's kernels (and `ols`'s last bits) do not
    depend on which plugins it loads (found by a review: they did)."""
    import subprocess
    import sys

    from tests.conftest import write_plugin

    root = write_plugin(tmp_path / "site", "njit-plugin", {"njit-first-y": "njit_first_y:FirstY"},
                        {"njit_first_y": PLUGIN_WITH_NJIT})
    code = ("import icl_bench; from icl_bench.solvers import fused, fused_cpu; "
            "names = [s.name for s in icl_bench.list_solvers() if not s.error]; "  # loads every plugin, as a run does
            "print('njit-first-y' in names); fused.available(); print(fused_cpu.describe())")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU")}
    plain = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    with_plugin = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert with_plugin.stdout.splitlines()[0] == "True", with_plugin.stdout + with_plugin.stderr
    assert with_plugin.stdout.splitlines()[1] == plain.stdout.splitlines()[1]


def test_a_process_where_numba_has_compiled_is_left_alone(host, monkeypatch):
    """The code generator is made with numba's first compile; setting the features after that
    would change nothing but the describe() line."""
    from numba.core.registry import cpu_target

    config = host("+64bit,+avx512f")
    monkeypatch.setitem(vars(cpu_target), "_toplevel_target_context", object())
    assert fused_cpu.wide_vectors() is False
    assert config.CPU_FEATURES is None


class _Context:
    """A stand-in for numba's CPU target context whose code generator has `features`."""

    def __init__(self, features: str):
        self.features = features

    def codegen(self):
        return self

    def magic_tuple(self):
        return ("x86_64-unknown-linux-gnu", "emeraldrapids", self.features)


HOST = "+64bit,+avx2,+avx512f"


@pytest.mark.parametrize("features, text", [
    (HOST, "LLVM's default for this CPU"),
    (HOST + ",-prefer-256-bit", "-prefer-256-bit"),
    ("", "custom CPU features"),
    ("+64bit,+avx2", "custom CPU features"),
    ("+64bit,+avx512f,-prefer-256-bit", "custom CPU features, -prefer-256-bit"),
])
def test_describe_names_the_code_generators_setting(host, monkeypatch, features, text):
    from numba.core.registry import cpu_target

    host(HOST)
    monkeypatch.setitem(vars(cpu_target), "_toplevel_target_context", _Context(features))
    assert fused_cpu.describe() == text


def test_describe_says_when_the_jit_is_disabled(monkeypatch):
    from numba.core import config

    monkeypatch.setattr(config, "DISABLE_JIT", True)
    assert fused_cpu.describe() == "JIT disabled"


def test_describe_before_the_first_kernel_does_not_fix_the_narrow_width():
    """Asking for the setting first (a benchmark's header) must not make numba's code generator
    with the host's preferred width: describe() applies wide_vectors first (a first version did
    not, and a measurement script ran every kernel at 256 bits)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU")}
    code = ("from icl_bench.solvers import fused_cpu; from numba.core.codegen import get_host_cpu_features; "
            "print(fused_cpu.describe() == ('-prefer-256-bit' if '+avx512f' in get_host_cpu_features().split(',') "
            "else \"LLVM's default for this CPU\"))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "True"


def test_a_numba_that_fails_to_import_does_not_break_a_plugin(plugin_path, monkeypatch):
    """The registry sets the width before a plugin loads; a numba whose import raises something
    other than ImportError is the fused path's problem, and the plugin still loads."""
    def broken():
        raise RuntimeError("numba: a version clash")

    monkeypatch.setattr(fused, "available", broken)
    from icl_bench import get_solver

    assert get_solver("plugin-mean-y").name == "plugin-mean-y"
