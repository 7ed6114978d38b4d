"""The CUDA path's own kernels, in Triton (imported only where Triton is installed), and what
their launchers share: whether they serve a device, and the padding ``tl.dot`` needs."""

from __future__ import annotations

import importlib.util
import os

import torch


def available() -> bool:
    """Whether Triton is installed (the CUDA path needs it; the CPU never uses it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton runs its kernels in its CPU interpreter (``TRITON_INTERPRET=1``: the tests
    without a GPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def serves(device: torch.device) -> bool:
    """Whether attention on ``device`` runs on these kernels (CUDA, with Triton)."""
    return device.type == "cuda" and available()


def next_power_of_2(n: int) -> int:
    """The least power of two not below ``n`` (1 for ``n`` <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def dot_width(n: int) -> int:
    """``n`` padded for ``tl.dot``: a power of two, and no dimension under 16."""
    return max(16, next_power_of_2(n))
