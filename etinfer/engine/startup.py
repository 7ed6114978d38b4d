"""The engine's start-up line: what it runs and how, in one line of the log (as vLLM and
llama.cpp print theirs), so that a figure can be read against the forms the engine chose."""

from __future__ import annotations

import os
from collections import Counter

import torch

from etinfer.config import EngineConfig
from etinfer.model import native_kernels
from etinfer.model.loader import LoadedModel


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
    config: EngineConfig,
    loaded: LoadedModel,
    forms: Counter[str],
    num_blocks: int,
    decode_path: str = "layer by layer",
) -> str:
    """An engine built with ``config`` over ``loaded``, whose weights multiply as ``forms``
    counts, whose cache holds ``num_blocks`` blocks and whose decode steps run as
    ``decode_path`` says."""
    device = config.torch_device()
    where = str(device)
    if device.type == "cpu":
        where = f"cpu ({instruction_set()}, {torch.get_num_threads()} threads)"
    layers, kv = loaded.config.num_layers, str(config.torch_kv_cache_dtype())
    return (
        f"etinfer: {loaded.path.name}, {layers} layers on {where}; weights: "
        f"{weight_forms(forms)}; KV cache {kv.removeprefix('torch.')}, {num_blocks} blocks of "
        f"{config.block_size} tokens; decode steps {decode_path}"
    )
