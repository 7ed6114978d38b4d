"""The Triton kernel of weight-only integer matmuls on the GPU (imported only where Triton is;
see ``gpu/weight_only.py``, which prepares the weights and launches it).

``out = x @ W^T`` where ``W`` stays in its integer codes in GPU memory and is dequantized a tile
at a time in registers, as llama.cpp's CUDA kernels and torch's tinygemm do: a weight's bytes
cross the memory bus once, as 4 or 8 bits. One program per tile of [BLOCK_M rows, BLOCK_N
outputs]; its loop over the input dimension takes BLOCK_K inputs at a time (one quantization
group or part of one, so a tile needs one scale per output), in the same order whatever the batch:
a row's result never depends on the rows beside it.
"""

from __future__ import annotations

import triton
import triton.language as tl


# The batch's row count changes every step; Triton would compile a variant for 1 and for
# multiples of 16 (``paged_decode_kernel``).
@triton.jit(do_not_specialize=["rows"])
def weight_only_matmul(
    x_ptr,  # [rows, in] activations, the dot's input type
    codes_ptr,  # int4: uint8 [out, in / 2], input k's code in byte k // 2 (low nibble first);
    # int8: int8 [out, in]
    scale_ptr,  # float32 [out, groups]
    zero_ptr,  # float32 [out, groups] (int4 only)
    out_ptr,  # [rows, out]
    rows,
    outputs,
    groups,
    x_stride,
    out_stride,
    INPUTS: tl.constexpr,  # a layer's width: its loop's bounds known when compiled
    GROUP: tl.constexpr,  # inputs per scale (a multiple of BLOCK_K)
    INT4: tl.constexpr,
    WIDE: tl.constexpr,  # dots in IEEE float32 (never tf32), whatever the activations' type
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # 64-bit offsets: a head of 262,144 outputs over 8,192 rows passes 2**31 elements.
    row = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    col = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    row_ok = row < rows
    col_ok = col < outputs
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, INPUTS, BLOCK_K):
        x = tl.load(x_ptr + row[:, None] * x_stride + start + k[None, :], mask=row_ok[:, None])
        group = start // GROUP
        scale = tl.load(scale_ptr + col * groups + group, mask=col_ok, other=0.0)
        if INT4:
            # Each byte is read for both its nibbles (the second read hits the cache).
            packed = tl.load(
                codes_ptr + col[:, None] * (INPUTS // 2) + (start + k[None, :]) // 2,
                mask=col_ok[:, None],
                other=0,
            )
            codes = (packed >> ((k[None, :] % 2) * 4).to(tl.uint8)) & 15
            zero = tl.load(zero_ptr + col * groups + group, mask=col_ok, other=0.0)
            w = (codes.to(tl.float32) - 8.0) * scale[:, None] + zero[:, None]
        else:
            codes = tl.load(
                codes_ptr + col[:, None] * INPUTS + start + k[None, :],
                mask=col_ok[:, None],
                other=0,
            )
            w = codes.to(tl.float32) * scale[:, None]
        if WIDE:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(
        out_ptr + row[:, None] * out_stride + col[None, :],
        out,
        mask=row_ok[:, None] & col_ok[None, :],
    )
