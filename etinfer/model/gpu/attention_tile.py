"""What the decode and prefill attention kernels do to each tile of keys, as Triton functions
they both call (Triton inlines them; its interpreter runs them as they are)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
    k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, slots, valid, dims, in_dim, DIM: tl.constexpr,
    HAS_SCALES: tl.constexpr, AS_STORED: tl.constexpr,
):  # fmt: skip
    """The keys and values at cache ``slots`` (rows where ``valid``), in float32: [tile, dim
    padded], zero where not read; an int8 cache's rows times their scales. ``AS_STORED``: a
    16-bit cache's rows in their own type, for dots on tensor cores."""
    where = slots[:, None] * DIM + dims[None, :]
    readable = valid[:, None] & in_dim[None, :]
    keys = tl.load(k_ptr + where, mask=readable, other=0.0)
    values = tl.load(v_ptr + where, mask=readable, other=0.0)
    if not AS_STORED:
        keys, values = keys.to(tl.float32), values.to(tl.float32)
    if HAS_SCALES:
        keys = keys * tl.load(k_scale_ptr + slots, mask=valid, other=0.0)[:, None]
        values = values * tl.load(v_scale_ptr + slots, mask=valid, other=0.0)[:, None]
    return keys, values


@triton.jit
def soft_cap(scores, cap):
    """``cap * tanh(scores / cap)`` (Gemma 2), tanh from one exp of a non-positive argument, so
    it never overflows."""
    t = tl.exp(-2.0 * tl.abs(scores) / cap)
    magnitude = cap * (1.0 - t) / (1.0 + t)
    return tl.where(scores < 0, -magnitude, magnitude)


@triton.jit
def online_softmax_step(scores, values, row_max, row_sum, acc, AS_STORED: tl.constexpr):
    """One tile of the online softmax: ``scores`` [rows, tile] (-inf where not seen) and the
    tile's ``values`` [tile, dim] folded into each row's running maximum, sum of weights and
    weighted values. A row that has seen nothing yet keeps its maximum at -inf and is shifted
    by 0, not by -inf. ``AS_STORED``: ``values`` are a 16-bit cache's, and the weights are
    rounded to their type for a dot on tensor cores (FlashAttention's rounding); the sums stay
    float32."""
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    weights = tl.exp(scores - shift[:, None])
    rescale = tl.exp(row_max - shift)
    row_sum = row_sum * rescale + tl.sum(weights, axis=1)
    if AS_STORED:
        acc = acc * rescale[:, None] + tl.dot(weights.to(values.dtype), values)
    else:
        acc = acc * rescale[:, None] + tl.dot(weights, values, input_precision="ieee")
    return new_max, row_sum, acc
