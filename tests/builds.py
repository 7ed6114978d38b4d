"""Builds of the native kernels for other hosts, so that a test on this machine runs the code an
AVX2 host would: results that must not depend on how a call is grouped are checked in each."""

from __future__ import annotations

import platform
import subprocess
from collections.abc import Callable

import pytest

from etinfer.model import native_kernels

# This CPU's build, an AVX2 host's (x86-64-v3, AVX2 and FMA: what the engine builds when ATen is
# held to AVX2) and an AMD Zen 2/3 host's (its -march=native tunes for it, and GCC then forms
# fewer FMAs in accumulation loops, so a kernel's two paths for an entry, eight at a time and the
# remainder, compile differently).
BUILDS = {
    "native": ["-march=native"],
    "x86-64-v3": ["-march=x86-64-v3"],
    "x86-64-v3, Zen 3 tuning": ["-march=x86-64-v3", "-mtune=znver3"],
    # Without F16C: float16 caches through the portable conversions.
    "x86-64": ["-march=x86-64"],
}


def built_for(name: str, compile: Callable[[list[str]], object]) -> object:
    """``compile(BUILDS[name])``, or the test skipped where this host cannot run that code or
    its compiler does not know the target."""
    target = BUILDS[name]
    cpu = native_kernels.cpu_flags().split()
    if "x86-64" in target[0] and "x86_64" not in platform.machine():
        pytest.skip("not an x86-64 host")
    if "x86-64-v3" in target[0] and not {"avx2", "fma"} <= set(cpu):
        pytest.skip("this CPU cannot run code built for x86-64-v3")
    try:
        return compile(target)
    except subprocess.CalledProcessError as error:
        pytest.skip(f"{' '.join(target)} not built: {error.stderr.strip()[:200]}")
