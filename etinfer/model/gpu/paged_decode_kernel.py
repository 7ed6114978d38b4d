"""The Triton kernel of paged decode attention (imported only where Triton is; see
``gpu/paged_decode.py``, which launches it and merges its partial results).

One program per (decode row, KV head, split of the context): it reads its row of the block
table itself, a tile of positions at a time, so no block is gathered or copied, and computes the
online softmax of its query heads (the KV head's group, padded to the 16 rows ``tl.dot`` takes;
the head dimension padded to a power of two) over its share of the context. Splitting the
context (flash-decoding) keeps the GPU busy when a few rows have long contexts; the splits'
partial maxima, sums and weighted values are merged afterwards. Dots are IEEE float32 (never
tf32): the engine's float32 path stays exact against transformers to rounding.
"""

from __future__ import annotations

import triton
import triton.language as tl

from etinfer.model.gpu.attention_tile import load_kv_tile, online_softmax_step, soft_cap


# Triton compiles a variant per integer argument that is 1 or a multiple of 16. The table's stride
# and the mask's width change from step to step with the batch's longest context (the pool's size
# and the window, with the engine and the layer), and a compile in the middle of a served step
# costs more than any step (the mixed workload's eager arms paid it).
@triton.jit(do_not_specialize=["num_slots", "table_stride", "keep_width", "window"])
def paged_decode_partials(
    q_ptr,  # [rows, heads, dim] float32
    k_ptr,  # [kv_heads, slots, dim] the layer's cache, any stored type
    v_ptr,
    k_scale_ptr,  # [kv_heads, slots] float32 (int8 caches), else unused
    v_scale_ptr,
    table_ptr,  # [rows, table_stride] block ids (rows may be views into a wider buffer)
    context_ptr,  # [rows] tokens each row attends to
    keep_ptr,  # [rows, kv_heads, keep_width] uint8: table entries read (pruning), else unused
    acc_ptr,  # out [rows, heads, splits, dim] float32: unnormalised weighted values
    max_ptr,  # out [rows, heads, splits] float32: the split's largest score
    sum_ptr,  # out [rows, heads, splits] float32: the split's sum of exp(score - max)
    num_slots,
    table_stride,
    keep_width,
    window,  # tokens a row sees back from itself; 0: all of them
    scale,
    softcap,  # scores become softcap * tanh(score / softcap) (Gemma 2) where CAPPED
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    CAPPED: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    splits = tl.num_programs(2)  # a launch's, not a compiled constant: no variant per count
    context = tl.load(context_ptr + row).to(tl.int32)
    first = 0
    if window > 0:
        first = tl.maximum(context - window, 0)
    tiles = tl.cdiv(context - first, TILE)
    per_split = tl.cdiv(tiles, splits) * TILE
    start = first + split * per_split
    end = tl.minimum(start + per_split, context)

    group = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    in_dim = dims < DIM
    heads = kv_head * GROUP + group
    in_group = group < GROUP
    q = tl.load(
        q_ptr + (row * HEADS + heads)[:, None] * DIM + dims[None, :],
        mask=in_group[:, None] & in_dim[None, :],
        other=0.0,
    )
    q = q * scale
    row_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    cache_base = kv_head.to(tl.int64) * num_slots
    tile_start = start
    while tile_start < end:  # a while loop: Triton's interpreter takes no tensor range bounds
        positions = tile_start + tl.arange(0, TILE)
        valid = positions < end
        entries = positions // BLOCK_SIZE
        blocks = tl.load(table_ptr + row * table_stride + entries, mask=valid, other=0)
        if HAS_KEEP:
            kept = tl.load(
                keep_ptr + (row * KV_HEADS + kv_head) * keep_width + entries,
                mask=valid,
                other=0,
            )
            valid = valid & (kept != 0)
        slots = cache_base + blocks.to(tl.int64) * BLOCK_SIZE + positions % BLOCK_SIZE
        keys, values = load_kv_tile(
            k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, slots, valid, dims, in_dim, DIM, HAS_SCALES,
            False,
        )  # fmt: skip
        scores = tl.dot(q, tl.trans(keys), input_precision="ieee")  # [GROUP_PAD, TILE]
        if CAPPED:
            scores = soft_cap(scores, softcap)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        row_max, row_sum, acc = online_softmax_step(scores, values, row_max, row_sum, acc, False)
        tile_start += TILE

    out = (row * HEADS + heads) * splits + split
    tl.store(
        acc_ptr + out[:, None] * DIM + dims[None, :], acc, mask=in_group[:, None] & in_dim[None, :]
    )
    tl.store(max_ptr + out, row_max, mask=in_group)
    tl.store(sum_ptr + out, row_sum, mask=in_group)
