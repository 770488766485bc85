"""numba's code generator for the fused CPU kernels: the vector width LLVM may use.

fused.available() calls `wide_vectors` when it first imports numba, before anything is compiled.
Measured effect: docs/throughput.md, "Vector width".
"""
from __future__ import annotations

import os


def wide_vectors() -> bool:
    """Let LLVM write 512-bit vector code on an x86 CPU with AVX-512: set numba's CPU_FEATURES
    (what the NUMBA_CPU_FEATURES environment variable sets) to the host's features plus
    `-prefer-256-bit`, before numba compiles anything. Returns whether it did.

    LLVM's tuning of Intel's AVX-512 server cores prefers 256-bit vectors, so the kernels'
    blocks of 16 float32 lanes (512 bits, fused_source.LANES) became two 256-bit halves, with
    twice the instructions and more spills: on an Emerald Rapids machine the dense d_model 4 /
    2-head kernel's forward (`trained-nol1`, float32) took 10.4-14.5 ns per token with that
    preference and 7.7-12.6 without, faster in each of 5 pairs of processes
    (results/vector_width.md, docs/throughput.md "Vector width"). On the Zen 4 machine measured
    earlier LLVM wrote 512-bit code already. numba has no per-function setting, so this applies
    to every numba function the process compiles later.
    Left as it is: an explicit NUMBA_CPU_FEATURES (or a .numba_config.yaml's cpu_features, or
    NUMBA_CPU_NAME=generic: numba's CPU_FEATURES is then set), a CPU without AVX-512, and a
    process in which numba has already made its code generator (at its first @njit, not only at
    its first compile: the registry therefore calls fused.available() before it imports a
    plugin); the kernels then still run, at the host's preferred width.
    Rounding: the transformer kernels (no reassociation) give the same bits at either width;
    the `ols` kernel's sums are reassociated into vector lanes (fused_ols.py), so on such a CPU
    their last bits follow the lane count, as they differ between CPUs (docs/design.md §11).
    """
    from numba.core import config, codegen
    from numba.core.registry import cpu_target

    if config.CPU_FEATURES is not None or os.environ.get("NUMBA_CPU_FEATURES"):
        return False
    if "_toplevel_target_context" in vars(cpu_target):  # numba has made its code generator (an @njit did)
        return False
    try:
        features = codegen.get_host_cpu_features()
    except Exception:  # (a platform llvmlite cannot query: leave numba's default)
        return False
    if "+avx512f" not in features.split(","):
        return False
    config.CPU_FEATURES = features + ",-prefer-256-bit"
    return True


def describe() -> str:
    """The vector setting of numba's code generator in this process, in words, for a benchmark's
    machine line and a run's metadata: "-prefer-256-bit" (wide_vectors took effect), "LLVM's
    default for this CPU" (the host's own features), "custom CPU features" (NUMBA_CPU_FEATURES,
    .numba_config.yaml, NUMBA_CPU_NAME=generic; with ", -prefer-256-bit" where they hold it), or
    "JIT disabled" (NUMBA_DISABLE_JIT: the kernels run as Python). Read from the code generator
    itself, which this makes if numba has not made it yet: wide_vectors() runs first, so asking
    before the first kernel does not fix the narrower width (it did, in a first version)."""
    from numba.core import codegen, config
    from numba.core.registry import cpu_target

    wide_vectors()
    if config.DISABLE_JIT:
        return "JIT disabled"
    features = cpu_target.target_context.codegen().magic_tuple()[2]  # (triple, cpu name, features)
    host = codegen.get_host_cpu_features()
    if features == host + ",-prefer-256-bit":
        return "-prefer-256-bit"
    if features == host:
        return "LLVM's default for this CPU"
    return "custom CPU features" + (", -prefer-256-bit" if "-prefer-256-bit" in features.split(",") else "")
