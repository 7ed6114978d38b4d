"""Prefill attention on the GPU over the paged cache: a chunk that follows a cached prefix reads
its keys and values where the cache holds them (``paged_prefill_kernel.py``), where SDPA needed
the prefix gathered into one copy per layer first. A chunk with no prefix keeps SDPA's flash
kernel, which needs no cache at all."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import NamedTuple

import torch

from etinfer.model.gpu import dot_width

# Caches whose rows the kernel multiplies on tensor cores in their own type.
SIXTEEN_BIT = (torch.float16, torch.bfloat16)


class PrefillTiles(NamedTuple):
    """A launch's shape: queries a program, keys a loop iteration, warps a program."""

    queries: int
    keys: int
    warps: int


# Launch shapes per kind of dot and head dimension, the fastest measured on an H200 (one layer,
# 2,048 queries after 6,144 positions in shuffled blocks of a bfloat16 cache; BENCHMARKS.md, "The
# CUDA path on an H200: prefill on tensor cores"), save at head dim 64 with tensor cores:
# 64x64x4 took 0.40 ms and 64x32x4 0.38, within the run's noise, and the engine's figures ran
# the first.
# Tensor-core dots took 0.40 ms at head dim 64 (SDPA over the gathered prefix 2.2), 1.8 at 128
# (7.9), 0.83 at 256 (2.3); float32 dots lost to SDPA at every shape (3.9, 40, 15). Register
# spills did not predict the times: float32 dots of 16 queries in 4 warps spill 372 bytes a
# thread (ptxas, sm_90) and took 3.9 ms, in 8 warps they spill none and took 6.4.
TILES = {
    True: {64: PrefillTiles(64, 64, 4), 128: PrefillTiles(64, 32, 4), 256: PrefillTiles(64, 16, 8)},
    False: {
        64: PrefillTiles(16, 64, 4),
        128: PrefillTiles(16, 64, 8),
        256: PrefillTiles(32, 16, 8),
    },
}


def prefill_tiles(dim_pad: int, tensor_cores: bool) -> PrefillTiles:
    """The launch shape for a head dimension padded to ``dim_pad``: that of the least measured
    dimension not below it (the widest's beyond)."""
    shapes = TILES[tensor_cores]
    return shapes[min((d for d in shapes if d >= dim_pad), default=max(shapes))]


@functools.cache
def _kernel() -> ModuleType:
    # Imported on first use: Triton reads TRITON_INTERPRET (its CPU interpreter, which the
    # tests use without a GPU) when the kernel is defined.
    return importlib.import_module("etinfer.model.gpu.paged_prefill_kernel")


def paged_prefill(
    q: torch.Tensor,  # [queries, heads, dim] float32: the chunk's, its last query the newest
    keys: torch.Tensor,  # [kv_heads, slots, dim] one layer's cache, the chunk's keys written
    values: torch.Tensor,
    key_scales: torch.Tensor | None,  # [kv_heads, slots] float32, int8 caches only
    value_scales: torch.Tensor | None,
    slots: torch.Tensor,  # [context] the cache slot of each position, the chunk's last
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    key_positions: torch.Tensor | None = None,
    first: int | None = None,
    tensor_cores: bool | None = None,
    tiles: PrefillTiles | None = None,
) -> torch.Tensor:
    """Causal attention of the chunk's queries over positions [0, context) (the last
    ``sliding_window`` of them for each query, where set), in float32: [queries, heads, dim].
    ``key_positions``: read those positions only (causally still), the queries' positions then
    starting at ``first``, which must be given. ``tensor_cores``: dots in a 16-bit cache's own
    type (default: wherever the cache is 16-bit), else IEEE float32. ``tiles``: the launch's
    shape (default ``prefill_tiles``; the benchmark sweeps them)."""
    queries, heads, dim = q.shape
    keyed = key_positions is not None
    if keyed and first is None:
        raise ValueError("paged_prefill: key_positions needs the queries' first position")
    if first is None:
        first = slots.shape[0] - queries
    if tensor_cores is None:
        tensor_cores = keys.dtype in SIXTEEN_BIT
    elif tensor_cores and keys.dtype not in SIXTEEN_BIT:
        raise ValueError(f"paged_prefill: tensor_cores needs a 16-bit cache, not {keys.dtype}")
    group = heads // keys.shape[0]
    dim_pad = dot_width(dim)
    tiles = tiles or prefill_tiles(dim_pad, tensor_cores)
    out = torch.empty(queries, heads, dim, device=q.device, dtype=torch.float32)
    has_scales = key_scales is not None
    _kernel().paged_prefill[(-(-queries // tiles.queries), heads)](
        q.contiguous(),
        keys,
        values,
        key_scales if has_scales else out,
        value_scales if has_scales else out,
        slots.contiguous(),
        key_positions.contiguous() if keyed else slots,
        out,
        queries,
        first,
        key_positions.shape[0] if keyed else 0,
        keys.shape[1],
        sliding_window or 0,
        scale,
        softcap or 1.0,
        HEADS=heads,
        GROUP=group,
        DIM=dim,
        DIM_PAD=dim_pad,
        BLOCK_M=tiles.queries,
        TILE=tiles.keys,
        HAS_SCALES=has_scales,
        CAPPED=softcap is not None,
        KEYED=keyed,
        TENSOR_CORES=tensor_cores,
        num_warps=tiles.warps,
    )
    return out
