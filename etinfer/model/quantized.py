"""Weights in integer form: a GGUF file's blocks as read, and the group-wise formats that the
CPU's weight-only kernels take, with the exact mapping from one to the other.

``quantization`` picks a format per weight matrix at load:

- ``none``: float, dequantized by the ``gguf`` package exactly as before.
- ``auto``: ``gguf`` on the CPU wherever etinfer's block kernels run (``resolve_auto`` says why).
  Without them a GGUF keeps its own format where torch has a kernel for it: Q4_0 and Q4_1
  become ``Int4Weight`` and Q8_0 ``Int8Weight`` (both group 32, as in the file); float tensors
  stay float. A block type no kernel takes is dequantized to float and the loader says so (a
  warning naming each tensor and its type).
- ``gguf``: every block type ``quant_kernels`` takes stays in its blocks and runs on those
  kernels (8-bit activations, as llama.cpp computes); the rest as ``auto``.
- ``gguf-a16``: as ``gguf``, each activation block multiplied as two 8-bit blocks, its codes and
  the codes of what they leave out (about 15 bits). On the default file top-1 agreement with the
  float32 path goes from 97.3 % to 99.9 % of 2,048 positions of real text (KL 0.0024 to 6e-7
  nat), for 1.0-1.25x the batch-1 step and 1.5-1.7x the batch-16 one (BENCHMARKS.md): the
  choice for output that must follow the file's float model, where ``gguf`` follows llama.cpp.
- ``gguf-a32``: as ``gguf``, Q4_0 and Q4_1 (rows interleaved by eight) times the float32
  activations as they are (``native/quant_float.c``): float32's tokens on the default file held
  to AVX2, slower than 8-bit activations at every batch once a step runs in one native call.
- ``int4``: ``Int4Weight``, group 32, asymmetric, round to nearest (Q4_1's rule). 32 because it
  is GGUF's block: a Q4_0/Q4_1 tensor maps onto it exactly, with no second rounding, and it is
  the smallest group torch's kernel takes (the smaller the group, the smaller the error).
- ``int8``: ``Int8Weight``, one scale per output row, symmetric, round to nearest. Per row
  because torch's int8 kernel takes no other layout, and it is the fastest kernel on an AVX2-only
  host; with 255 levels a row's range costs little precision (measured in BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from etinfer.model import quant_kernels

QUANTIZATION_MODES = ("auto", "none", "int8", "int4", "gguf", "gguf-a16", "gguf-a32")
# The modes that keep every block type etinfer's kernels take in its blocks, and the bits of
# the activations each multiplies them by.
ACTIVATION_BITS = {"gguf": 8, "gguf-a16": 16, "gguf-a32": 32}
BLOCK_MODES = tuple(ACTIVATION_BITS)
GROUP_SIZE = 32
_Q = GGMLQuantizationType
# Block types that map onto a kernel's format exactly.
NATIVE_TYPES = (_Q.Q4_0, _Q.Q4_1, _Q.Q8_0)


@dataclass(frozen=True)
class GGUFBlocks:
    """One GGUF weight matrix still in its blocks: row ``o`` of ``data`` holds the blocks of
    output row ``o`` (a block never spans two rows), so rows can be reordered and stacked."""

    qtype: GGMLQuantizationType
    data: torch.Tensor  # uint8 [out, bytes per row], as the file stores them
    in_features: int
    # Bits of the activations the kernels multiply it by: 8, 16 as two 8-bit parts
    # (``gguf-a16``), or 32, float32 as they are (``gguf-a32``'s 4-bit weights); how
    # the product is computed, set by the mode, not read from the file.
    activation_bits: int = 8
    # Output row ``o`` is row ``order[o]`` of ``data`` (None: the file's order). Where the file
    # orders rows otherwise than the model (llama.cpp's rotary layout of q and k), the rows are
    # moved when read, so a loaded model keeps the file's bytes and no reordered copy of them
    # (a 7B llama's q and k in Q4_K_M are about 360 MiB).
    order: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.in_features

    @property
    def ordered(self) -> torch.Tensor:
        """``data`` with its rows in the model's order (a copy where they move)."""
        return self.data if self.order is None else self.data[self.order]

    def rows(self, index: torch.Tensor | slice) -> GGUFBlocks:
        """Those output rows (a slice of rows in the file's order is a view, not a copy)."""
        index = index if self.order is None else self.order[index]
        return replace(self, data=self.data[index], order=None)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [out, in], by the ``gguf`` package (the reference every format is held to).
        With ``rows`` (token ids, the head's candidates), those rows [*rows.shape, in]: for
        Q4_0, Q4_1 and Q8_0 by torch operations with gguf's formulas (the same bits, a tenth of
        the time of a numpy call at batch 1)."""
        if rows is None:
            values = dequantize(self.ordered.numpy(), self.qtype).reshape(self.shape)
            return torch.from_numpy(values.astype("float32", copy=False))
        return self.rows(rows.reshape(-1)).decoded().view(*rows.shape, self.in_features)

    def decoded(self) -> torch.Tensor:
        """Every row as float32 [out, in]: Q4_0, Q4_1 and Q8_0 by torch operations with gguf's
        formulas, other formats by ``gguf``."""
        if self.qtype not in NATIVE_TYPES:
            return self.dequantize()
        fields, codes = self.blocks()
        d, codes = fields[..., :1], codes.float()
        if self.qtype == _Q.Q8_0:
            values = d * codes
        else:
            values = d * (codes - 8) if self.qtype == _Q.Q4_0 else d * codes + fields[..., 1:2]
        return values.view(self.shape)

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The block headers as float32 [out, blocks, fields] and each weight's code [out,
        blocks, 32] in order: 0..15 (uint8) for Q4_0 and Q4_1, int8 for Q8_0."""
        group, size = GGML_QUANT_SIZES[self.qtype]
        header = {_Q.Q4_0: 2, _Q.Q4_1: 4, _Q.Q8_0: 2}[self.qtype]
        raw = self.ordered.view(self.data.shape[0], self.in_features // group, size)
        fields = raw[..., :header].contiguous().view(torch.float16).float()
        payload = raw[..., header:]
        if self.qtype == _Q.Q8_0:
            return fields, payload.view(torch.int8)
        # Byte j holds weight j in its low nibble and weight j + 16 in its high nibble.
        return fields, torch.cat([payload & 0x0F, payload >> 4], dim=-1)


@dataclass(frozen=True)
class MixedBlocks:
    """Weights of one input in blocks of several formats, stacked by output rows: a fused
    projection of a file that mixes formats (Q4_K_M keeps v in Q6_K beside q and k in Q4_K)."""

    parts: tuple[GGUFBlocks, ...]
    activation_bits: int = 8  # as GGUFBlocks'

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].in_features

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])


Weight = torch.Tensor | GGUFBlocks | MixedBlocks


@dataclass(frozen=True)
class Int4Weight:
    """``w[o, k] = scale[o, g] * (codes[o, k] - 8) + zero[o, g]`` with ``g = k // group_size``
    and codes in 0..15: the form torch's int4 CPU kernel dequantizes (it takes ``(scale, zero)``
    per group). ``planes == 2`` is an 8-bit weight split into a high and a low plane of nibbles
    side by side; the weight is their sum and the kernel sees the input twice."""

    codes: torch.Tensor  # uint8 [out, planes * in]
    scale: torch.Tensor  # float32 [out, planes * in / group_size]
    zero: torch.Tensor  # float32, like scale
    group_size: int = GROUP_SIZE
    planes: int = 1

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] // self.planes

    @classmethod
    def from_gguf(cls, weight: GGUFBlocks) -> Int4Weight:
        """Q4_1 stores ``w = d q + m``: scale d, zero m + 8d. Q4_0 stores ``w = d (q - 8)``:
        scale d, zero 0. Both are exact in float32, as the kernel computes them."""
        fields, codes = weight.blocks()
        d = fields[..., 0]
        zero = fields[..., 1] + 8 * d if weight.qtype == _Q.Q4_1 else torch.zeros_like(d)
        return cls(codes.reshape(weight.shape), d, zero)

    @classmethod
    def quantize(cls, weight: torch.Tensor, name: str) -> Int4Weight:
        """Round to nearest over [min, max] of each group of 32 (Q4_1's rule, float32 scales)."""
        out, inp = weight.shape
        if inp % GROUP_SIZE:
            raise ValueError(
                f"{name}: int4 needs input widths divisible by the group size {GROUP_SIZE}, "
                f"this weight's is {inp}"
            )
        groups = weight.float().reshape(out, inp // GROUP_SIZE, GROUP_SIZE)
        low, high = groups.amin(-1), groups.amax(-1)
        d = (high - low) / 15
        inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        codes = ((groups - low[..., None]) * inverse[..., None]).round().clamp(0, 15)
        return cls(codes.to(torch.uint8).reshape(out, inp), d, low + 8 * d)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 weights (of the rows ``rows`` only, when given), as the kernel computes them:
        one fused multiply-add per weight."""
        codes, scale, zero = self.codes, self.scale, self.zero
        if rows is not None:
            codes, scale, zero = codes[rows], scale[rows], zero[rows]
        group = self.group_size
        values = torch.addcmul(
            zero.repeat_interleave(group, -1), codes.float() - 8, scale.repeat_interleave(group, -1)
        )
        return values.view(*values.shape[:-1], self.planes, -1).sum(-2)

    def to(self, device: torch.device) -> Int4Weight:
        moved = {name: getattr(self, name).to(device) for name in ("codes", "scale", "zero")}
        return replace(self, **moved)


@dataclass(frozen=True)
class Int8Weight:
    """``w[o, k] = scale[o, k // group_size] * codes[o, k]``; one group per row when
    ``group_size`` is the input width (the form of torch's int8 kernel)."""

    codes: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # float32 [out, in / group_size]
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @classmethod
    def from_gguf(cls, weight: GGUFBlocks) -> Int8Weight:
        """Q8_0: ``w = d q`` per block of 32, q in -127..127."""
        fields, codes = weight.blocks()
        return cls(codes.reshape(weight.shape), fields[..., 0], GROUP_SIZE)

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        """Symmetric, round to nearest, one scale per output row."""
        weight = weight.float()
        scale = weight.abs().amax(-1, keepdim=True) / 127
        inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        codes = (weight * inverse).round().clamp(-127, 127).to(torch.int8)
        return cls(codes, scale, weight.shape[1])

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        codes, scale = self.codes, self.scale
        if rows is not None:
            codes, scale = codes[rows], scale[rows]
        return codes.float() * scale.repeat_interleave(self.group_size, -1)

    def to(self, device: torch.device) -> Int8Weight:
        return replace(self, codes=self.codes.to(device), scale=self.scale.to(device))

    def as_int4_planes(self) -> Int4Weight:
        """The same weights as two 4-bit planes, for the int4 kernel (torch's int8 kernel takes
        one scale per row only). With ``u = q + 128 = 16 h + l``: the high plane has scale 16d
        and zero 0, giving ``16 d (h - 8)``; the low plane scale d and zero 8d, giving ``d l``;
        their sum is ``d q`` exactly."""
        unsigned = (self.codes.to(torch.int16) + 128).to(torch.uint8)
        codes = torch.cat([unsigned >> 4, unsigned & 0x0F], dim=-1)
        scale = torch.cat([16 * self.scale, self.scale], dim=-1)
        zero = torch.cat([torch.zeros_like(self.scale), 8 * self.scale], dim=-1)
        return Int4Weight(codes, scale, zero, self.group_size, planes=2)


Format = torch.Tensor | Int4Weight | Int8Weight | GGUFBlocks | MixedBlocks


def stack_rows(parts: list[Weight]) -> Weight:
    """Weights of one input stacked by output rows (fused q/k/v, gate/up). Blocks of one type
    stay blocks; blocks of several types stay blocks where etinfer's kernels take each of them;
    any other mixture becomes float."""
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, GGUFBlocks) and p.qtype == parts[0].qtype for p in parts):
        data = torch.cat([p.ordered for p in parts])
        return GGUFBlocks(parts[0].qtype, data, parts[0].in_features)
    takes = [
        isinstance(p, GGUFBlocks) and quant_kernels.takes(p.qtype, p.in_features) for p in parts
    ]
    if all(takes):
        return MixedBlocks(tuple(parts))
    return torch.cat([as_float(p) for p in parts])


def form_of(weight: Weight | Int4Weight | Int8Weight) -> str:
    """How a prepared weight multiplies, in the words of the engine's start-up line."""
    if isinstance(weight, GGUFBlocks | MixedBlocks):
        parts = weight.parts if isinstance(weight, MixedBlocks) else (weight,)
        types = "+".join(sorted({p.qtype.name for p in parts}))
        activations = {8: "8-bit", 16: "two 8-bit", 32: "float32"}[weight.activation_bits]
        return f"{types} blocks on etinfer's kernels ({activations} activations)"
    if isinstance(weight, Int4Weight | Int8Weight) and weight.codes.device.type == "cuda":
        return f"{type(weight).__name__} on the GPU's weight-only kernel"
    if isinstance(weight, Int8Weight) and weight.group_size == weight.shape[1]:
        return "int8 rows on torch's int8 kernel"
    if isinstance(weight, Int8Weight):  # ``make_linear`` runs it as two 4-bit planes
        return f"int8 groups of {weight.group_size} as two int4 planes on torch's int4 kernel"
    if isinstance(weight, Int4Weight):
        return f"int4 groups of {weight.group_size} on torch's int4 kernel"
    return str(weight.dtype).removeprefix("torch.")


def resolve_auto(quantization: str, weights: dict[str, Weight], device: torch.device) -> str:
    """The mode ``auto`` means for these weights on ``device`` (another mode is itself).

    On a GPU, float weights: a small model's decode step there is bound by its launches, not
    its weights' bytes (BENCHMARKS.md), and float needs no dequantizing. On the CPU, ``gguf``
    wherever the block kernels run: at every size measured (94 MiB to 3.9 GiB) and on AVX2 and
    AVX-512 alike they are the fastest form at batch 1 and 16 and in prefill once a decode step
    runs its layers in one native call (``native_decoder.py``), which needs every projection on
    them; torch's int4 kernel had led on the default model with AVX-512 (BENCHMARKS.md)."""
    if quantization != "auto":
        return quantization
    if device.type != "cpu":
        return "none"
    blocks = any(isinstance(w, GGUFBlocks) for w in weights.values())
    return "gguf" if blocks and quant_kernels.available() else "auto"


def as_float(weight: Weight) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, GGUFBlocks | MixedBlocks) else weight


def weight_format(weight: Weight, mode: str, name: str) -> tuple[Format, str | None]:
    """The format ``mode`` gives ``weight``, and why a block type was dequantized, if it was."""
    if mode == "none":
        return as_float(weight), None
    if mode == "int8":
        return Int8Weight.quantize(as_float(weight)), None
    native = isinstance(weight, GGUFBlocks) and weight.qtype in NATIVE_TYPES
    if mode == "int4":
        if native and weight.qtype != _Q.Q8_0:
            return Int4Weight.from_gguf(weight), None
        return Int4Weight.quantize(as_float(weight), name), None
    bits = ACTIVATION_BITS.get(mode, 8)
    if isinstance(weight, MixedBlocks):  # a mixture the block kernels take, never in float32
        return replace(weight, activation_bits=min(bits, 16)), None
    if not isinstance(weight, GGUFBlocks):  # float
        return weight, None
    if quant_kernels.takes(weight.qtype, weight.in_features) and (
        mode in BLOCK_MODES or not native
    ):
        if bits == 32 and not quant_kernels.takes_float_activations(weight.qtype, weight.shape[0]):
            bits = 8  # the float32 kernel takes interleaved Q4_0 and Q4_1 only
        return replace(weight, activation_bits=bits), None
    if weight.qtype == _Q.Q8_0:
        return Int8Weight.from_gguf(weight), None
    if native:
        return Int4Weight.from_gguf(weight), None
    return weight.dequantize(), f"{name} ({weight.qtype.name}: no kernel, dequantized to float)"
