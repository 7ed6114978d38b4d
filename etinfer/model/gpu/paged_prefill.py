"""Prefill attention on the GPU over the paged cache: a chunk that follows a cached prefix reads
its keys and values where the cache holds them (``paged_prefill_kernel.py``), where SDPA needed
the prefix gathered into one copy per layer first. A chunk with no prefix keeps SDPA's flash
kernel, which needs no cache at all."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from etinfer.model.gpu import dot_width

# Keys a program reads per loop iteration.
TILE = 64


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
) -> torch.Tensor:
    """Causal attention of the chunk's queries over positions [0, context) (the last
    ``sliding_window`` of them for each query, where set), in float32: [queries, heads, dim].
    ``key_positions``: read those positions only (causally still), the queries' positions then
    starting at ``first``, which must be given."""
    queries, heads, dim = q.shape
    keyed = key_positions is not None
    if keyed and first is None:
        raise ValueError("paged_prefill: key_positions needs the queries' first position")
    if first is None:
        first = slots.shape[0] - queries
    group = heads // keys.shape[0]
    dim_pad = dot_width(dim)
    # 16 queries a program: on an H200 (head dim 64, 2,048 queries after 6,144 positions) 64 in
    # 4 warps spilled registers (51.6 ms), 64 in 8 warps took 4.6, 32 4.1, 16 3.9.
    block_m = 16
    out = torch.empty(queries, heads, dim, device=q.device, dtype=torch.float32)
    has_scales = key_scales is not None
    _kernel().paged_prefill[(-(-queries // block_m), heads)](
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
        BLOCK_M=block_m,
        TILE=TILE,
        HAS_SCALES=has_scales,
        CAPPED=softcap is not None,
        KEYED=keyed,
        # Wide heads in 4 warps spilled tens of KB of registers a program (ptxas, sm_90).
        num_warps=8 if dim_pad >= 128 else 4,
    )
    return out
