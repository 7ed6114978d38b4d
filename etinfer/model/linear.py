"""Dense layers with weights laid out for the fastest kernel the device has: float32 prepacked for
oneDNN, or integer weights for torch's weight-only int4 and int8 kernels.

Every kernel here computes each row of its output independently of the others (checked in the
tests): a row's result does not depend on how many rows share the call, which greedy batching,
recompute after preemption and speculative verification rest on. That is why the choice is fixed
per weight format rather than per row count: plain ``F.linear`` is faster at some shapes but not
row-independent, and a prefill path through a different kernel than decode would make the same
token's activations differ between the two.

One exception, taken where it pays most: weights in GGUF blocks that are not interleaved by
eight (the K formats, Q5_0: Gemma 3's files) are decoded to float32 for calls of at least
``DENSE_ROWS`` rows and multiplied in torch's float32 GEMM (``BlockProduct.dense``), 2.5-4.7x
the block kernels at 2,048 rows. llama.cpp and vLLM likewise compute a prompt with other
kernels than a decode step. Engines that need every row computed alone (``batch_invariant``)
run inside ``rows_alone()``, which keeps the block kernels at any row count.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

from etinfer.model import native_kernels, quant_kernels
from etinfer.model.gpu.weight_only import WeightOnlyLinear
from etinfer.model.quantized import Format, GGUFBlocks, Int4Weight, Int8Weight, MixedBlocks

# oneDNN picks its blocked weight layout from a batch-size hint. Measured on a 2-core AVX2 machine,
# a hint of 16 is the fastest of 1, 16 for every batch from 1 to 2,048 rows.
_ONEDNN_BATCH_HINT = 16
# The int4 kernel's packing interleaves output rows by 16; other widths are padded.
_INT4_ROW_MULTIPLE = 16
# The weight-only kernels' fast paths take bfloat16 activations (with float32 ones they are 20-50x
# slower, measured by `etinfer bench kernels`); they accumulate in float32 and answer in bfloat16,
# which is returned as is: a residual add promotes it for free, and an MLP's gate and up feed the
# down projection, which takes bfloat16 anyway (each conversion is an operation of its own, and at
# batch 1 those are a sizeable share of a step).
KERNEL_DTYPE = torch.bfloat16
# Rows from which a call on non-interleaved GGUF blocks takes the float32 GEMM (the module's
# docstring): at 64 rows the two paths are level on Gemma 3's matrices, at 128 the GEMM is
# 1.3-2x faster, at 2,048 2.5-4.7x.
DENSE_ROWS = 128
# Set while a batch-invariant engine steps: every call on the block kernels, a row at a time.
_ROWS_ALONE: ContextVar[bool] = ContextVar("rows_alone", default=False)
# Logits per row recomputed in float32 by an integer-kernel head (see TopRefinedLinear).
_REFINED_CANDIDATES = 32


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear:
    """``y = x W^T + b`` for ``x`` of shape [rows, in].

    On the CPU in float32 the weight is prepacked once into oneDNN's blocked layout (the path
    PyTorch's own compiler takes with frozen weights): a decode step's weight matmuls then take
    about half the time of ``F.linear`` on the plain [out, in] weight, at batch 1 and at batch 16
    alike. Anywhere else the plain weight and ``F.linear`` are used.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = weight.device.type == "cpu" and weight.dtype == torch.float32
        self.packed = self.packed and _onednn_available()
        if self.packed:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, _ONEDNN_BATCH_HINT)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class Int4Linear:
    """torch's int4 weight-only CPU kernel: two weights a byte, one (scale, zero) per group.

    ``dtype`` is that of the activations and scales the kernel sees; in float32 it uses the
    weights exactly as ``Int4Weight`` defines them (slowly: the tests check it that way)."""

    def __init__(
        self,
        weight: Int4Weight,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = KERNEL_DTYPE,
    ) -> None:
        self.out_features, self.in_features = weight.shape
        self.dtype = dtype
        self.bias, self.group_size, self.planes = bias, weight.group_size, weight.planes
        codes, scale, zero = weight.codes, weight.scale, weight.zero
        pad = -self.out_features % _INT4_ROW_MULTIPLE
        if pad:  # rows of code 8 with zero scale contribute nothing and are cut off the output
            codes = F.pad(codes, (0, 0, 0, pad), value=8)
            scale, zero = F.pad(scale, (0, 0, 0, pad)), F.pad(zero, (0, 0, 0, pad))
        self.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        # [groups, out, (scale, zero)]
        self.scales = torch.stack([scale, zero], dim=-1).transpose(0, 1).to(dtype)
        self.scales = self.scales.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = x if x.dtype == self.dtype else x.to(self.dtype)
        if self.planes > 1:
            h = h.repeat(1, self.planes)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(h, self.weight, self.group_size, self.scales)
        y = y[:, : self.out_features]
        return y if self.bias is None else y + self.bias


class Int8Linear:
    """torch's int8 weight-only kernel: one byte a weight, one scale per output row."""

    def __init__(
        self,
        weight: Int8Weight,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = KERNEL_DTYPE,
    ) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias, self.weight, self.dtype = bias, weight.codes, dtype
        self.scale = weight.scale.reshape(-1).to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.to(self.dtype), self.weight, self.scale)
        return y if self.bias is None else y + self.bias


class BlockLinear:
    """A GGUF weight in its own blocks on etinfer's kernels (``quant_kernels``): float32 in and
    out, the activations quantized to 8 bits a block inside the call (twice, the second time
    what the first left out, where the weight's ``activation_bits`` is 16; not at all, float32
    as they are, where it is 32)."""

    def __init__(self, weight: GGUFBlocks | MixedBlocks, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        parts = weight.parts if isinstance(weight, MixedBlocks) else (weight,)
        self.product = quant_kernels.BlockProduct(
            [quant_kernels.BlockWeight.prepare(p.qtype, p.ordered, p.in_features) for p in parts],
            precise=weight.activation_bits == 16,
            float_activations=weight.activation_bits == 32,
        )
        # Interleaved rows run fast on their own kernel at any row count (2,048 rows of the
        # default model's Q4_1 at 360 GFLOP/s): only the other layouts take the GEMM.
        interleaved = all(part.interleaved for part in self.product.parts)
        self.dense_rows = None if interleaved else DENSE_ROWS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dense = self.dense_rows is not None and x.shape[0] >= self.dense_rows
        y = self.product.dense(x) if dense and not _ROWS_ALONE.get() else self.product(x)
        return y if self.bias is None else y + self.bias

    def dequantize(self, rows: torch.Tensor) -> torch.Tensor:
        """Output rows ``rows`` as float32 [*rows.shape, in], read from the kernels' own copy
        (a tied embedding, the head's candidates): the same bytes as the file's blocks."""
        (part,) = self.product.parts  # a head or an embedding is one matrix
        blocks = GGUFBlocks(part.qtype, part.file_rows(rows.reshape(-1)), part.in_features)
        return blocks.decoded().view(*rows.shape, -1)


@contextmanager
def rows_alone(on: bool = True) -> Iterator[None]:
    """While ``on``: calls on GGUF blocks compute each row alone, as a decode step does, at any
    row count (a batch-invariant engine's steps)."""
    token = _ROWS_ALONE.set(on)
    try:
        yield
    finally:
        _ROWS_ALONE.reset(token)


Layer = Linear | Int4Linear | Int8Linear | BlockLinear | WeightOnlyLinear


def make_linear(
    weight: Format, bias: torch.Tensor | None = None, dtype: torch.dtype = KERNEL_DTYPE
) -> Layer:
    """The layer for a weight in any format (``dtype``: torch's integer kernels' activations).
    An 8-bit weight with groups smaller than a row (Q8_0) runs as two 4-bit planes, since the
    int8 kernel takes one scale per row only."""
    if isinstance(weight, GGUFBlocks | MixedBlocks):
        return BlockLinear(weight, bias)
    if isinstance(weight, Int4Weight | Int8Weight) and weight.codes.device.type == "cuda":
        return WeightOnlyLinear(weight, bias)
    if isinstance(weight, Int8Weight):
        if weight.group_size == weight.shape[1]:
            return Int8Linear(weight, bias, dtype)
        weight = weight.as_int4_planes()
    if isinstance(weight, Int4Weight):
        return Int4Linear(weight, bias, dtype)
    return Linear(weight, bias)


class TopRefinedLinear:
    """An output head on an integer kernel whose largest outputs are recomputed in float32.

    The kernels answer in bfloat16, whose spacing near a logit of 16 is 0.125: rounding alone
    turns near-ties into ties and moved the greedy token at 2.3 % of positions of real text
    (BENCHMARKS.md). The ``candidates`` largest logits of each row, which decide greedy choice,
    top-k/top-p and the logprobs reported, are recomputed from the exact weights in float32;
    the tail keeps the kernel's rounding (it changes entropy by far less than a millinat).
    On etinfer's block kernels the same recomputation undoes the 8-bit activations' rounding.
    """

    def __init__(
        self,
        layer: Int4Linear | Int8Linear | BlockLinear | WeightOnlyLinear,
        weight: Int4Weight | Int8Weight | GGUFBlocks | BlockLinear | WeightOnlyLinear,
    ) -> None:
        self.layer, self.weight = layer, weight
        self.candidates = min(_REFINED_CANDIDATES, layer.out_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.layer(x).float()
        top = _largest_ids(logits, self.candidates)  # [rows, candidates]
        return logits.scatter_(1, top, self.exact(x, top))

    def exact(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[rows, n]: each row of ``x``'s logits of the tokens ``ids`` [rows, n], in float32 from
        the exact weights."""
        rows = self.weight.dequantize(ids.flatten()).view(*ids.shape, -1)
        # A product and a sum over the last axis: its order depends on the width alone, so a row's
        # result does not depend on the others (a batched matmul picks kernels by batch size).
        return (rows * x.float().unsqueeze(1)).sum(-1)


def _largest_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's ``k`` largest logits' ids, in one native pass on the CPU (``top_ids`` in
    native/row_scores.c: tens of microseconds on a 262,144-entry row, where torch's top-k took
    0.52 ms, a twentieth of Gemma 3's decode step), else torch's top-k."""
    native = native_kernels.library() if logits.device.type == "cpu" else None
    if native is not None and logits.dtype == torch.float32:
        logits = logits.contiguous()
        ids = torch.empty(logits.shape[0], k, dtype=torch.int64)
        rows, width = logits.shape
        threads = torch.get_num_threads()
        if native.top_ids(logits.data_ptr(), rows, width, k, threads, ids.data_ptr()) == 0:
            return ids
        # else k is outside what the kernel keeps (64) or the row's width
    return logits.topk(k, dim=-1, sorted=False).indices


def kernel_input_dtype(layer: Layer) -> torch.dtype | None:
    """The input an integer kernel wants (what a norm before it may produce), None for float."""
    if isinstance(layer, BlockLinear):
        return torch.float32
    if isinstance(layer, Int4Linear | Int8Linear) and layer.dtype == torch.bfloat16:
        return torch.bfloat16
    return None


def make_head(weight: Format) -> Linear | TopRefinedLinear:
    """The output head. A head in GGUF blocks takes the block kernels where they run (the
    reader gives it to them in ``auto`` too). Without them, an 8-bit head in groups (Q8_0) runs
    on the int8 kernel requantized per row, unlike the other layers: its two-plane form reads
    every weight twice and took twice as long at batch 1 (0.78 against 0.37 ms on the default
    head). The second rounding reaches only the logits past the refined candidates: entropy
    moved by 4e-4 nats on average on real text, while bfloat16 output rounding alone moves it
    by 1.6e-3 (BENCHMARKS.md)."""
    kernel_weight = weight
    grouped = isinstance(weight, Int8Weight) and weight.group_size != weight.shape[1]
    if grouped and weight.codes.device.type == "cpu":  # the GPU's kernel takes groups
        kernel_weight = Int8Weight.quantize(weight.dequantize())
    layer = make_linear(kernel_weight)
    if isinstance(layer, Linear):
        return layer
    # The GPU's layer reads its rows back from its own codes (two to a byte in int4), and a
    # block layer from its prepared blocks: one copy of the matrix, not the file's pages too.
    reads_itself = isinstance(layer, WeightOnlyLinear | BlockLinear)
    return TopRefinedLinear(layer, layer if reads_itself else weight)
