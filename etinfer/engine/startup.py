"""The engine's start-up line: what it runs and how, in one line of the log (as vLLM and
llama.cpp print theirs), so that a figure can be read against the forms the engine chose."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import torch

from etinfer.model import native_kernels


def instruction_set() -> str:
    """The widest vector extension the CPU offers torch and etinfer's kernels, and whether
    torch is held below it (``ATEN_CPU_CAPABILITY``)."""
    flags = native_kernels.cpu_flags().split()
    widest = next(
        (name for flag, name in (("avx512_vnni", "AVX-512 VNNI"), ("avx512f", "AVX-512"),
                                 ("avx2", "AVX2")) if flag in flags),
        "no AVX2",
    )  # fmt: skip
    held = os.environ.get("ATEN_CPU_CAPABILITY")
    return f"{widest}, torch held to {held}" if held else widest


def weight_forms(forms: Counter[str]) -> str:
    """``forms`` (how many matrices multiply each way), the most common first."""
    return ", ".join(f"{count} x {form}" for form, count in forms.most_common())


def startup_line(
    path: Path,
    layers: int,
    forms: Counter[str],
    device: torch.device,
    kv: tuple[torch.dtype, int, int],
) -> str:
    """``kv``: the cache's element type, its blocks and their size in tokens."""
    dtype, blocks, size = kv
    where = str(device)
    if device.type == "cpu":
        where = f"cpu ({instruction_set()}, {torch.get_num_threads()} threads)"
    return (
        f"etinfer: {path.name}, {layers} layers on {where}; weights: {weight_forms(forms)}; "
        f"KV cache {str(dtype).removeprefix('torch.')}, {blocks} blocks of {size} tokens"
    )
