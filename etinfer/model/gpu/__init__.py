"""The CUDA path's own kernels, in Triton (imported only where Triton is installed)."""

from __future__ import annotations

import importlib.util


def available() -> bool:
    """Whether Triton is installed (the CUDA path needs it; the CPU never uses it)."""
    return importlib.util.find_spec("triton") is not None
