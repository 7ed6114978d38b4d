"""Matrix products with weights in their GGUF blocks (``native/quant_matmul.c``, and
``native/quant_interleaved.c`` for Q4_0, Q4_1 and Q8_0 with rows interleaved by eight at load),
called through ctypes: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K and Q6_K.

Why our own kernels rather than ggml's: ggml ships only inside llama.cpp's builds (a source build
of ``llama-cpp-python`` takes about 8 minutes on 2 cores, no wheel is published), while these
compile in about a second with the engine's other kernels. The activations are quantized to 8
bits a block as llama.cpp does (32 values a block for the 32-element formats, 256 for the K
formats), so a product costs one integer dot product per block.

Built only for x86 hosts with AVX2, FMA and F16C (x86-64-v3, nearly every x86 CPU since 2013);
elsewhere, or with ``ETINFER_NATIVE=0``, ``available()`` is False and the weights take the torch
path, with one warning.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from etinfer.model import native_kernels

logger = logging.getLogger("etinfer.model")

_Q = GGMLQuantizationType
# Elements per activation block each format meets.
ACTIVATION_BLOCK = {
    _Q.Q4_0: 32,
    _Q.Q4_1: 32,
    _Q.Q5_0: 32,
    _Q.Q8_0: 32,
    _Q.Q4_K: 256,
    _Q.Q5_K: 256,
    _Q.Q6_K: 256,
}
# Bytes of a quantized activation block: a float scale, a float sum (32) or 16 int16 sums (256),
# and the codes (Act32 and Act256 in quant_matmul.c).
_ACTIVATION_BYTES = {32: 4 + 4 + 32, 256: 4 + 32 + 256}
_NATIVE = Path(native_kernels.__file__).parent / "native"
_SOURCES = [_NATIVE / "quant_matmul.c", _NATIVE / "quant_interleaved.c", _NATIVE / "pool.c"]
# Formats whose rows are interleaved by eight at load (native/quant_interleaved.c says why).
_INTERLEAVED = (_Q.Q4_0, _Q.Q4_1, _Q.Q8_0)
_NEEDS = {"avx2", "fma", "f16c"}


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("ETINFER_NATIVE", "1") == "0":
        return None
    flags = set(native_kernels.cpu_flags().split())
    if not flags >= _NEEDS:
        logger.warning(
            "no AVX2, FMA and F16C on this CPU: GGUF blocks run on torch's kernels (slower)"
        )
        return None
    try:
        return compiled(native_kernels.target())
    except native_kernels.NoCompiler:
        logger.warning("no C compiler found: GGUF blocks run on torch's kernels (slower)")
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        logger.warning("quantized kernels not built (%s): GGUF blocks run on torch's", detail)
    return None


def compiled(target: list[str]) -> ctypes.CDLL:
    """The kernels built for ``target`` (the tests build other hosts' code with it)."""
    return _declared(ctypes.CDLL(str(native_kernels.build_library(_SOURCES, target))))


def _declared(library: ctypes.CDLL) -> ctypes.CDLL:
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    for name in ("quantize_act32", "quantize_act256"):
        getattr(library, name).argtypes = [pointer, i64, i64, pointer]
        getattr(library, name).restype = None
    library.quant_matmul.argtypes = [ctypes.c_int, pointer, i64, i64, i64, pointer, i64, pointer]
    library.quant_matmul.argtypes += [i64, i64]
    library.quant_matmul.restype = ctypes.c_int
    library.quant_matmul8.argtypes = [ctypes.c_int, pointer, i64, i64, pointer, i64, pointer]
    library.quant_matmul8.argtypes += [i64, i64]
    library.quant_matmul8.restype = ctypes.c_int
    library.repack8.argtypes = [ctypes.c_int, pointer, i64, i64, pointer]
    library.repack8.restype = ctypes.c_int
    return library


def available() -> bool:
    return _library() is not None


def takes(qtype: GGMLQuantizationType, in_features: int) -> bool:
    """Whether a weight of this format and input width runs on these kernels."""
    block = ACTIVATION_BLOCK.get(qtype)
    return block is not None and in_features % block == 0 and available()


@dataclass(frozen=True)
class BlockWeight:
    """A weight [out, in] in a GGUF block format, as the kernels read it: ``data`` holds the
    file's bytes, rows interleaved by eight where ``interleaved`` (the same bytes, moved)."""

    qtype: GGMLQuantizationType
    data: torch.Tensor  # uint8
    out_features: int
    in_features: int
    interleaved: bool

    @classmethod
    def prepare(cls, qtype: GGMLQuantizationType, data: torch.Tensor, in_features: int):
        """From a file's blocks [out, bytes a row]."""
        elements, block_bytes = GGML_QUANT_SIZES[qtype]
        blocks = in_features // elements
        if data.shape[1] != blocks * block_bytes or in_features % ACTIVATION_BLOCK[qtype]:
            raise ValueError(
                f"{qtype.name} weight of {data.shape[1]} bytes a row for an input of {in_features}"
            )
        out = data.shape[0]
        data = data.contiguous()
        if qtype not in _INTERLEAVED or out % 8:
            return cls(qtype, data, out, in_features, False)
        library = _library()
        assert library is not None, "check available() first"
        repacked = torch.empty_like(data)
        library.repack8(int(qtype), data.data_ptr(), out, blocks, repacked.data_ptr())
        return cls(qtype, repacked, out, in_features, True)


def matmul(x: torch.Tensor, parts: list[BlockWeight]) -> torch.Tensor:
    """``x`` [rows, in] times weights [out, in] stacked by output rows, transposed: [rows, sum of
    outs] float32. Fused projections may mix formats (Q4_K_M files keep v in Q6_K beside q and
    k in Q4_K); the activations are quantized once for each block size the parts need."""
    library = _library()
    assert library is not None, "check available() first"
    x = x.contiguous() if x.dtype == torch.float32 else x.float().contiguous()
    rows, k = x.shape
    total = sum(part.out_features for part in parts)
    out = torch.empty(rows, total, dtype=torch.float32)
    quantized: dict[int, torch.Tensor] = {}
    column, threads = 0, torch.get_num_threads()
    for part in parts:
        if part.in_features != k:
            raise ValueError(
                f"an input of {k} for a {part.qtype.name} weight of {part.in_features}"
            )
        block = ACTIVATION_BLOCK[part.qtype]
        if block not in quantized:
            quantized[block] = torch.empty(
                rows * (k // block) * _ACTIVATION_BYTES[block], dtype=torch.uint8
            )
            quantize = library.quantize_act32 if block == 32 else library.quantize_act256
            quantize(x.data_ptr(), rows, k, quantized[block].data_ptr())
        target = out[:, column:].data_ptr()
        if part.interleaved:
            library.quant_matmul8(
                int(part.qtype), part.data.data_ptr(), part.out_features, k,
                quantized[block].data_ptr(), rows, target, total, threads,
            )  # fmt: skip
        else:
            library.quant_matmul(
                int(part.qtype), part.data.data_ptr(), part.out_features, k,
                GGML_QUANT_SIZES[part.qtype][1], quantized[block].data_ptr(), rows, target,
                total, threads,
            )  # fmt: skip
        column += part.out_features
    return out
