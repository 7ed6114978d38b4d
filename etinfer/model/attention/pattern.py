"""Which cache rows each decode query reads, as a CSR pattern built at block granularity.

The step's query rows (sequence, head) and the cache rows ``kv_head * num_slots + slot`` they
attend to form the pattern the C and torch decode forms run on (``native_backend.py``,
``torch_backend.py``). Attending to fewer blocks is only a smaller pattern, so a selector that
keeps fewer blocks makes attention compute less, not just mask more.
"""

from __future__ import annotations

import torch

from etinfer.model import block_kernels
from etinfer.model.block_layout import DecodeBlocks, DecodePattern


def decode_pattern(
    blocks: DecodeBlocks,
    num_kv_heads: int,
    queries_per_kv: int,
    num_slots: int,
    block_mask: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> tuple[torch.Tensor, DecodePattern]:
    """The blocks each (sequence, KV head) reads (``visible_blocks``) and the pattern of their
    cache rows (``build_decode_pattern``): in one native call where the kernels run (a pruned
    layer at 8K tokens built it in some thirty torch operations, 0.5 ms at batch 8), else as
    torch operations, with the same bits."""
    native = block_kernels.decode_pattern(
        blocks.block_tables,
        blocks.context_lens,
        blocks.block_size,
        num_kv_heads,
        queries_per_kv,
        num_slots // blocks.block_size,
        block_mask,
        sliding_window,
    )
    if native is not None:
        visible, crow, cols, outside = native
        return visible, DecodePattern(crow, cols, outside)
    visible = visible_blocks(blocks, num_kv_heads, block_mask, sliding_window)
    return visible, build_decode_pattern(blocks, visible, queries_per_kv, num_slots, sliding_window)


def visible_blocks(
    blocks: DecodeBlocks,
    num_kv_heads: int,
    block_mask: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Which blocks each (sequence, KV head) attends to: [seqs, kv_heads, max_blocks].

    Blocks in context (and in the sliding window), restricted to ``block_mask`` when given;
    the block holding the current token is kept whatever the mask says, so no row is empty.
    """
    tables, lens, bs = blocks.block_tables, blocks.context_lens, blocks.block_size
    positions = torch.arange(tables.shape[1], device=tables.device)
    exists = positions * bs < lens[:, None]
    if sliding_window is not None:
        exists &= (positions + 1) * bs > lens[:, None] - sliding_window
    visible = exists[:, None, :].expand(-1, num_kv_heads, -1)
    if block_mask is not None:
        current = positions == torch.div(lens - 1, bs, rounding_mode="floor")[:, None]
        visible = visible & (block_mask | current[:, None, :])
    return visible


def build_decode_pattern(
    blocks: DecodeBlocks,
    visible: torch.Tensor,
    queries_per_kv: int,
    num_slots: int,
    sliding_window: int | None = None,
) -> DecodePattern:
    """CSR pattern of decode rows against the cache rows of their ``visible`` blocks.

    Built at block granularity: the kept (sequence, head, block) triples become runs of
    ``block_size`` consecutive cache rows, so the work scales with what is kept, not with the
    context, and every per-entry tensor is one broadcast of a per-block one. Rows follow the
    query layout ``seq * num_heads + kv_head * queries_per_kv + j``; a row's blocks are in
    order. Slots of a kept block outside the context are read and masked (see DecodePattern):
    they belong to the sequence's own blocks, whose cache rows only ever hold finite keys and
    values (or the zeros of untouched memory).
    """
    tables, lens, bs = blocks.block_tables, blocks.context_lens, blocks.block_size
    seqs, kv_heads, _ = visible.shape
    device = tables.device
    seq, head, block = visible.nonzero(as_tuple=True)  # in (seq, head, block) order
    start = (head * num_slots + tables[seq, block] * bs).int()  # the kernels' index type
    # Tokens of each block inside the context: [skip, end) of its bs slots.
    end = (lens[seq] - block * bs).clamp(max=bs)
    skip = torch.zeros_like(end)
    if sliding_window is not None:
        skip = (lens[seq] - sliding_window - block * bs).clamp(0, bs)
    # Repeat each (seq, head) run of blocks once per query head of the group: the runs of row r
    # are those of its segment (seq, kv head), found by their index within the segment.
    segment = seq * kv_heads + head
    per_segment = torch.bincount(segment, minlength=seqs * kv_heads)
    segment_start = torch.cumsum(per_segment, 0) - per_segment
    rows = seqs * kv_heads * queries_per_kv
    row_runs = per_segment.repeat_interleave(queries_per_kv)
    _check_int32_entries(rows * tables.shape[1] * bs, row_runs, bs)
    run_row = torch.repeat_interleave(torch.arange(rows, device=device), row_runs)
    run_in_row = (
        torch.arange(run_row.numel(), device=device)
        - (torch.cumsum(row_runs, 0) - row_runs)[run_row]
    )
    which = segment_start.repeat_interleave(queries_per_kv)[run_row] + run_in_row
    offsets = torch.arange(bs, device=device, dtype=torch.int32)
    cols = (start[which, None] + offsets).view(-1)
    crow = torch.zeros(rows + 1, dtype=torch.int32, device=device)
    torch.cumsum(row_runs * bs, 0, out=crow[1:])
    # Entries outside the context: only in the few runs whose block is cut.
    end, skip = end[which], skip[which]
    (cut,) = ((end < bs) | (skip > 0)).nonzero(as_tuple=True)
    outside = (offsets >= end[cut, None]) | (offsets < skip[cut, None])
    masked = (cut[:, None] * bs + offsets)[outside]
    flags = torch.zeros(cols.numel(), dtype=torch.uint8, device=device).index_fill_(0, masked, 1)
    return DecodePattern(crow, cols, flags)


def check_batch_invariant_fits(
    max_rows: int, block_size: int, num_heads: int, max_model_len: int
) -> None:
    """At construction, for ``batch_invariant``: a step's prefill rows (up to ``max_rows``, the
    engine's max_num_batched_tokens) each read their whole context through the decode pattern,
    whose offsets must stay in int32."""
    bound = max_rows * num_heads * (-(-max_model_len // block_size) + 1) * block_size
    if bound >= 2**31:
        raise ValueError(
            f"batch_invariant: max_num_batched_tokens={max_rows} with {num_heads} heads and "
            f"max_model_len={max_model_len} could make one step's attention pattern {bound:,} "
            "entries, over the 2**31 its int32 offsets take: lower max_num_batched_tokens"
        )


def _check_int32_entries(bound: int, row_runs: torch.Tensor, block_size: int) -> None:
    """Refuse, rather than wrap, a pattern whose entry offsets leave int32 (the kernels' index
    type). Only prefill rows of long contexts (``batch_invariant``) come near it; the bound from
    host-known shapes spares the exact count's sync every other time."""
    if bound < 2**31:
        return
    entries = int(row_runs.sum()) * block_size
    if entries >= 2**31:
        raise ValueError(
            f"a step's attention pattern would hold {entries:,} entries, over the 2**31 its "
            "int32 offsets take: lower max_num_batched_tokens"
        )
