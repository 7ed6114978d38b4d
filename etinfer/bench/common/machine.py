"""The machine a figure was measured on: every benchmark prints or records it beside its
figures, since ratios hold across hosts and absolute figures do not."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

# Environment that holds torch (its own kernels, oneDNN's and MKL's, which does torch's float32
# GEMM) to an instruction set, for `--isa` flags: the native kernels follow ATEN_CPU_CAPABILITY
# (model/native_kernels.py). Without MKL's own variable a float32 GEMM held "to AVX2" ran on
# AVX-512: 300 GFLOP/s on two cores where AVX2 gives 206.
ISA_ENV = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }
}
# The flags that decide which kernels run fast here.
_WANTED_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "avx_vnni")


def cpuinfo(field: str) -> str | None:
    """The first value of ``field`` in /proc/cpuinfo, where Linux tells it."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(field)), None)


def cpu_flags() -> str:
    """Those of the CPU's flags that choose kernels, or "unknown"."""
    flags = cpuinfo("flags")
    if flags is None:
        return "unknown"
    present = flags.split()
    return " ".join(f for f in _WANTED_FLAGS if f in present)


def machine() -> dict:
    return {
        "processor": cpuinfo("model name") or platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }
