"""Paged decode attention on the GPU: one Triton kernel that reads the block table itself
(``paged_decode_kernel.py``), then a merge of its per-split partial results.

This replaces, on CUDA, the torch form of ``attention/torch_backend.py`` (a CSR pattern built each
step with ``nonzero``/``repeat_interleave``, scores by ``sampled_addmm``): that form costs a few
dozen kernel launches and host syncs a layer, and the GPU waits on the host. Here a layer's
decode attention is one launch plus a few elementwise ones, with no host sync and shapes fixed
by the batch, so a step can be captured as a CUDA graph (``engine/runner/cuda_graphs.py``).
"""

from __future__ import annotations

import functools
import importlib
import math
from types import ModuleType

import torch

from etinfer.model.gpu import dot_width, next_power_of_2

# Positions a program reads per loop iteration (several blocks of 16 at once).
TILE = 64
# Programs worth launching: about two per streaming multiprocessor (an H100 has 132). A batch
# with fewer (row, KV head) pairs splits each row's context to reach it.
PROGRAMS_PER_SM = 2
# Where no GPU says how many it has (Triton's interpreter, in the tests): an H100's.
DEFAULT_SMS = 132
MAX_SPLITS = 32


@functools.cache
def _target_programs(device: torch.device) -> int:
    sms = DEFAULT_SMS
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    return PROGRAMS_PER_SM * sms


@functools.cache
def _kernel() -> ModuleType:
    # Imported on first use: Triton reads TRITON_INTERPRET (its CPU interpreter, which the
    # tests use without a GPU) when the kernel is defined.
    return importlib.import_module("etinfer.model.gpu.paged_decode_kernel")


def num_splits(
    rows: int, kv_heads: int, max_context: int, programs: int = PROGRAMS_PER_SM * DEFAULT_SMS
) -> int:
    """How many parts each row's context is cut into: enough to launch ``programs`` programs,
    about a tile or more each, rounded up to a power of two (a split left empty merges as
    nothing)."""
    wanted = math.ceil(programs / max(1, rows * kv_heads))
    return next_power_of_2(min(wanted, math.ceil(max_context / TILE), MAX_SPLITS))


def paged_decode(
    q: torch.Tensor,  # [rows, heads, dim] float32
    keys: torch.Tensor,  # [kv_heads, slots, dim] one layer's cache
    values: torch.Tensor,
    key_scales: torch.Tensor | None,  # [kv_heads, slots] float32, int8 caches only
    value_scales: torch.Tensor | None,
    block_tables: torch.Tensor,  # [rows, width]
    context_lens: torch.Tensor,  # [rows]
    block_size: int,
    scale: float,
    sliding_window: int | None = None,
    keep: torch.Tensor | None = None,  # [rows, kv_heads, width] bool: the blocks read
    splits: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's attention over the first ``context_lens[row]`` positions of its block table
    (the last ``sliding_window`` of them where set; only ``keep``'s blocks where given), in
    float32: [rows, heads, dim] (zeros for a row that sees nothing); and per row and head the
    largest scaled score and the softmax denominator below it (the pruning certificate's
    inputs), [rows, heads] each.

    ``splits``: parts each row's context is cut into (default: enough to fill the GPU, which
    depends on the batch, so a row's rounding does too; 1 makes each row's result its own).
    ``softcap``: scores soft-capped (Gemma 2), as ``softcap.py`` defines it."""
    rows, heads, dim = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    width = block_tables.shape[1]
    splits = splits or num_splits(rows, kv_heads, width * block_size, _target_programs(q.device))
    acc = torch.empty(rows, heads, splits, dim, device=q.device, dtype=torch.float32)
    maxima = torch.empty(rows, heads, splits, device=q.device, dtype=torch.float32)
    sums = torch.empty_like(maxima)
    has_scales = key_scales is not None
    has_keep = keep is not None
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    _kernel().paged_decode_partials[(rows, kv_heads, splits)](
        q.contiguous(),
        keys,
        values,
        key_scales if has_scales else maxima,
        value_scales if has_scales else maxima,
        block_tables,
        context_lens.contiguous(),
        keep.to(torch.uint8).contiguous() if has_keep else maxima,
        acc,
        maxima,
        sums,
        keys.shape[1],
        block_tables.stride(0),
        width,
        sliding_window or 0,
        scale,
        softcap or 1.0,
        HEADS=heads,
        KV_HEADS=kv_heads,
        GROUP=group,
        GROUP_PAD=dot_width(group),
        DIM=dim,
        DIM_PAD=dot_width(dim),
        BLOCK_SIZE=block_size,
        TILE=TILE,
        HAS_SCALES=has_scales,
        HAS_KEEP=has_keep,
        CAPPED=softcap is not None,
    )
    return merge_splits(acc, maxima, sums)


def merge_splits(
    acc: torch.Tensor, maxima: torch.Tensor, sums: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The softmax-weighted values, the row maxima and denominators, from the splits'
    partials (the log-sum-exp merge)."""
    row_max = maxima.amax(-1, keepdim=True)
    shift = torch.where(row_max == -torch.inf, 0.0, row_max)  # rows that saw nothing
    weights = torch.exp(maxima - shift)
    denominators = (sums * weights).sum(-1, keepdim=True)
    out = (acc * weights[..., None]).sum(2)
    out /= denominators.clamp_min(torch.finfo(torch.float32).tiny)
    return out, row_max.squeeze(-1), denominators.squeeze(-1)
