"""Weight-only int4 and int8 layers on the GPU: ``quantization="int4"`` or ``"int8"`` on CUDA.

The weights keep the CPU path's formats exactly (``Int4Weight``: group 32, a scale and a zero
per group, as GGUF's Q4_0/Q4_1 store them; ``Int8Weight``: a scale per group of 32 as Q8_0, or
per row), so a GGUF file's 4- and 8-bit tensors reach the GPU with no second rounding. Two codes
share a byte in int4. The matmul is one Triton kernel that dequantizes a tile at a time
(``weight_only_kernel.py``); it takes the engine's activations as they are (bfloat16 by default
on CUDA, float32 in IEEE dots where the engine runs float32) and answers in their type.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from etinfer.model.gpu import interpreting
from etinfer.model.quantized import Int4Weight, Int8Weight

# A tile of 16 rows (the fewest ``tl.dot`` takes), 64 outputs, 32 inputs (one quantization
# group). Fixed, not tuned per batch: a row's result then never depends on the batch (greedy
# batching and preemption's recompute rest on that). Decode's tile; a long prefill dequantizes
# each weight once per 16 rows, which a prefill tiling of its own would cut.
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


@functools.cache
def _kernel() -> ModuleType:
    # Imported on first use: Triton reads TRITON_INTERPRET (its CPU interpreter, which the
    # tests use without a GPU) when the kernel is defined.
    return importlib.import_module("etinfer.model.gpu.weight_only_kernel")


@functools.cache
def _float32_dots_only() -> bool:
    """Whether the kernel runs in Triton's interpreter (the tests without a GPU), which gets
    bfloat16 dots wrong (numpy has no bfloat16): there the dots are float32, the rest of the
    program the same. Read once, at the first launch, as Triton reads it."""
    return interpreting()


class WeightOnlyLinear:
    """``y = x W^T + b`` with ``W`` in 4 or 8 bits in GPU memory."""

    def __init__(self, weight: Int4Weight | Int8Weight, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        if self.in_features % BLOCK_K or weight.group_size % BLOCK_K:
            raise ValueError(
                f"the GPU's weight-only kernel takes input widths and groups divisible by "
                f"{BLOCK_K}; this weight's are {self.in_features} and {weight.group_size}"
            )
        self.int4 = isinstance(weight, Int4Weight)
        if self.int4:
            if weight.planes != 1:
                raise ValueError("the GPU's int4 kernel takes one plane of codes")
            codes = weight.codes
            self.codes = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
            self.zero = weight.zero.float().contiguous()
        else:
            self.codes, self.zero = weight.codes.contiguous(), None
        self.scale = weight.scale.float().contiguous()
        self.group_size, self.bias = weight.group_size, bias

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 weights (of ``rows`` only, where given: token ids, a head's candidates) read
        back from the codes as stored, by the format's own formula: an embedding or a refined
        head needs no second, unpacked copy of the codes."""

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t if rows is None else t[rows]

        if not self.int4:
            return Int8Weight(pick(self.codes), pick(self.scale), self.group_size).dequantize()
        packed = pick(self.codes)
        codes = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)
        zero = pick(self.zero)
        return Int4Weight(codes, pick(self.scale), zero, self.group_size).dequantize()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        rows = x.shape[0]
        out = torch.empty(rows, self.out_features, device=x.device, dtype=x.dtype)
        grid = (-(-rows // BLOCK_M), -(-self.out_features // BLOCK_N))
        _kernel().weight_only_matmul[grid](
            x,
            self.codes,
            self.scale,
            self.scale if self.zero is None else self.zero,
            out,
            rows,
            self.out_features,
            self.scale.shape[1],
            x.stride(0),
            out.stride(0),
            INPUTS=self.in_features,
            GROUP=self.group_size,
            INT4=self.int4,
            WIDE=x.dtype == torch.float32 or _float32_dots_only(),
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
        )
        return out if self.bias is None else out + self.bias
