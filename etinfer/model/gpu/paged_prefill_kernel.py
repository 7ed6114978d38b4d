"""The Triton kernel of prefill attention over the paged cache (imported only where Triton is;
see ``gpu/paged_prefill.py``, which launches it).

One program per (tile of a chunk's queries, query head): it reads the cache slot of each key
position from the chunk's slot list and the keys and values from the cache where they are, so
no prefix is gathered or copied, and computes the causal online softmax of its queries (each
sees the positions up to its own, and only the last ``window`` of them where set) a tile of
keys at a time. Given a list of positions (KEYED: sparse prefill's kept blocks and local
window), it reads those alone. Dots are IEEE float32 (never tf32), as in the decode kernel, or
(TENSOR_CORES, a 16-bit cache) in the cache's own type on tensor cores with float32 sums: the
queries and each tile's softmax weights rounded to that type, as FlashAttention does.
"""

from __future__ import annotations

import triton
import triton.language as tl

from etinfer.model.gpu.attention_tile import load_kv_tile, online_softmax_step, soft_cap


# No compiled variant per chunk: Triton would compile one for each pattern of these integers
# being 1 or a multiple of 16, and every chunk's length, start and keys differ (the pool's size
# and the window differ only between engines and layers; ``paged_decode_kernel``).
@triton.jit(do_not_specialize=["queries", "first", "num_keys", "num_slots", "window"])
def paged_prefill(
    q_ptr,  # [queries, heads, dim] float32: the chunk's queries
    k_ptr,  # [kv_heads, slots, dim] the layer's cache, any stored type
    v_ptr,
    k_scale_ptr,  # [kv_heads, slots] float32 (int8 caches), else unused
    v_scale_ptr,
    slot_ptr,  # [context] the cache slot of each position of the sequence
    key_pos_ptr,  # [num_keys] the positions read, where KEYED (sparse prefill's); else unused
    out_ptr,  # out [queries, heads, dim] float32
    queries,
    first,  # the position of the first query (the queries' positions follow on)
    num_keys,
    num_slots,
    window,  # positions a query sees back from itself; 0: all of them
    scale,
    softcap,  # scores become softcap * tanh(score / softcap) where CAPPED
    HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    CAPPED: tl.constexpr,
    KEYED: tl.constexpr,
    TENSOR_CORES: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < queries
    positions = first + rows
    dims = tl.arange(0, DIM_PAD)
    in_dim = dims < DIM
    q = tl.load(
        q_ptr + (rows[:, None] * HEADS + head) * DIM + dims[None, :],
        mask=row_ok[:, None] & in_dim[None, :],
        other=0.0,
    )
    q = q * scale
    if TENSOR_CORES:
        q = q.to(k_ptr.dtype.element_ty)
    if KEYED:  # the listed positions, each masked by its position
        end = num_keys
        lowest = 0
    else:  # positions [lowest, end): before ``lowest`` out of every window, after ``end`` ahead
        end = tl.minimum(first + (tile + 1) * BLOCK_M, first + queries)
        lowest = 0
        if window > 0:
            lowest = tl.maximum(first + tile * BLOCK_M - window + 1, 0)
    oldest = tl.where(window > 0, positions - window, -1)  # a query sees keys after this
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    cache_base = kv_head.to(tl.int64) * num_slots
    key_start = lowest
    while key_start < end:  # a while loop: Triton's interpreter takes no tensor range bounds
        keys_at = key_start + tl.arange(0, TILE)
        valid = keys_at < end
        if KEYED:
            keys_at = tl.load(key_pos_ptr + keys_at, mask=valid, other=0)
        slots = cache_base + tl.load(slot_ptr + keys_at, mask=valid, other=0).to(tl.int64)
        keys, values = load_kv_tile(
            k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, slots, valid, dims, in_dim, DIM, HAS_SCALES,
            TENSOR_CORES,
        )  # fmt: skip
        if TENSOR_CORES:  # float32 sums of 16-bit products
            scores = tl.dot(q, tl.trans(keys))  # [BLOCK_M, TILE]
        else:
            scores = tl.dot(q, tl.trans(keys), input_precision="ieee")
        if CAPPED:
            scores = soft_cap(scores, softcap)
        visible = valid[None, :] & (keys_at[None, :] <= positions[:, None])
        visible = visible & (keys_at[None, :] > oldest[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        row_max, row_sum, acc = online_softmax_step(
            scores, values, row_max, row_sum, acc, TENSOR_CORES
        )
        key_start += TILE
    out = acc / tl.maximum(row_sum, 1e-30)[:, None]
    tl.store(
        out_ptr + (rows[:, None] * HEADS + head) * DIM + dims[None, :],
        out,
        mask=row_ok[:, None] & in_dim[None, :],
    )
