"""Matrix products with weights in their GGUF blocks (``native/quant_matmul.c``, and
``native/quant_interleaved.c`` for Q4_0, Q4_1 and Q8_0 with rows interleaved by eight at load),
one ctypes call a layer (``native/quant_linear.c``): Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K and Q6_K.

Threads: the kernels split their work with OpenMP, and the library links the ``libgomp`` that
torch has already loaded, so they run on torch's own threads. Kept threads of their own (an
earlier version) fought torch's for the two cores: torch's threads spin a while after each of
its parallel operations, and a decode step at batch 1 held to AVX2 took 15.3 ms against 10.8.

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
_NATIVE = Path(native_kernels.__file__).parent / "native"
_SOURCES = [
    _NATIVE / "quant_linear.c",
    _NATIVE / "quant_activations.c",
    _NATIVE / "quant_matmul.c",
    _NATIVE / "quant_interleaved.c",
    _NATIVE / "quant_float.c",
    _NATIVE / "quant_dequantize.c",
    _NATIVE / "quant_head_scores.c",
    _NATIVE / "pool.c",
]
# A band of weights decoded to float32 for the dense path holds at most this many (32 MB): a
# whole matrix of the models we run, a tenth of Llama 3 8B's MLP.
DENSE_BAND_ELEMENTS = 1 << 23
# Formats whose rows are interleaved by eight at load (native/quant_interleaved.c says why).
_INTERLEAVED = (_Q.Q4_0, _Q.Q4_1, _Q.Q8_0)
_NEEDS = {"avx2", "fma", "f16c"}


@functools.cache
def library() -> ctypes.CDLL | None:
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


class _Part(ctypes.Structure):
    """One weight of a layer, as ``block_linear`` takes it (BlockPart in native/quant.h)."""

    _fields_ = [
        ("type", ctypes.c_int64),
        ("w", ctypes.c_void_p),
        ("out", ctypes.c_int64),
        ("block_bytes", ctypes.c_int64),
        ("interleaved", ctypes.c_int64),
    ]


def _declared(library: ctypes.CDLL) -> ctypes.CDLL:
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    library.block_linear.argtypes = [pointer, i64, pointer, i64, i64, pointer, i64, i64]
    library.block_linear.restype = ctypes.c_int
    library.repack8.argtypes = [ctypes.c_int, pointer, i64, i64, pointer]
    library.repack8.restype = ctypes.c_int
    library.unpack8_rows.argtypes = [ctypes.c_int, pointer, i64, i64, pointer, i64, pointer]
    library.unpack8_rows.restype = ctypes.c_int
    library.float_linear.argtypes = [pointer, i64, pointer, i64, i64, pointer, i64]
    library.float_linear.restype = ctypes.c_int
    library.dequantize_parts.argtypes = [pointer, i64, i64, i64, i64, pointer, i64]
    library.dequantize_parts.restype = ctypes.c_int
    library.head_scores8.argtypes = [ctypes.c_int, pointer, i64, i64, pointer, i64, pointer,
                                     pointer, i64, i64] + [pointer] * 6  # fmt: skip
    library.head_scores8.restype = ctypes.c_int
    return library


def available() -> bool:
    return library() is not None


def interleaves(qtype: GGMLQuantizationType, out_features: int) -> bool:
    """Whether a weight's rows are interleaved by eight when prepared for these kernels."""
    return qtype in _INTERLEAVED and out_features % 8 == 0


def takes_float_activations(qtype: GGMLQuantizationType, out_features: int) -> bool:
    """Whether ``native/quant_float.c`` takes a weight (``gguf-a32``): interleaved Q4_0/Q4_1."""
    return qtype in (_Q.Q4_0, _Q.Q4_1) and interleaves(qtype, out_features)


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

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in the file (the plain layout's stride)."""
        return GGML_QUANT_SIZES[self.qtype][1]

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
        if not interleaves(qtype, out):
            return cls(qtype, data, out, in_features, False)
        kernels = library()
        assert kernels is not None, "check available() first"
        repacked = torch.empty_like(data)
        kernels.repack8(int(qtype), data.data_ptr(), out, blocks, repacked.data_ptr())
        return cls(qtype, repacked, out, in_features, True)

    def file_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` [n] in the file's layout [n, bytes a row], read from ``data``. A tied
        embedding and the head's refined candidates read them here: where the rows were
        interleaved, ``data`` is a copy and the file's pages were let go, which reading the
        file's rows would bring back a 64 KB fault at a time until the process held the matrix
        twice (elsewhere ``data`` is the file's mapping, which the kernel reads anyway)."""
        if not self.interleaved:
            return self.data[index]
        kernels = library()
        assert kernels is not None, "an interleaved weight was prepared by the library"
        index = index.to(torch.int64).contiguous()
        rows = torch.empty(index.shape[0], self.data.shape[1], dtype=torch.uint8)
        blocks = self.in_features // GGML_QUANT_SIZES[self.qtype][0]
        status = kernels.unpack8_rows(
            int(self.qtype), self.data.data_ptr(), self.out_features, blocks, index.data_ptr(),
            index.shape[0], rows.data_ptr(),
        )  # fmt: skip
        if status != 0:
            raise IndexError(f"rows outside the {self.out_features} of a {self.qtype.name} weight")
        return rows


class BlockProduct:
    """Weights [out, in] in block formats stacked by output rows, as one kernel call: ``x``
    [rows, in] times their transpose, [rows, sum of outs] float32. Fused projections may mix
    formats (Q4_K_M files keep v in Q6_K beside q and k in Q4_K); the activations are quantized
    once for each block size the parts need. ``precise``: each activation block as two 8-bit
    blocks, its codes and its remainder's, both multiplied in one pass over the weights.
    ``float_activations``: interleaved Q4_0/Q4_1 parts times the float32 activations as they
    are (``gguf-a32``)."""

    def __init__(
        self, parts: list[BlockWeight], precise: bool = False, float_activations: bool = False
    ) -> None:
        widths = {part.in_features for part in parts}
        if len(widths) != 1:
            raise ValueError(f"stacked weights of different input widths {sorted(widths)}")
        self.parts = tuple(parts)  # the bytes the call's pointers point at
        self.name = "+".join(part.qtype.name for part in parts)  # for errors: Q4_K+Q6_K
        self.in_features = widths.pop()
        self.precise = precise
        self.float_activations = float_activations
        self.out_features = sum(part.out_features for part in parts)
        self.table = (_Part * len(parts))(
            *(_Part(p.qtype, p.data.data_ptr(), p.out_features, p.block_bytes, p.interleaved)
              for p in parts)
        )  # fmt: skip

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        kernels = library()
        assert kernels is not None, "check available() first"
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        rows, k = x.shape
        if k != self.in_features:
            raise ValueError(f"an input of {k} for a {self.name} weight of {self.in_features}")
        out = torch.empty(rows, self.out_features, dtype=torch.float32)
        common = (self.table, len(self.table), x.data_ptr(), rows, k, out.data_ptr(),
                  torch.get_num_threads())  # fmt: skip
        if self.float_activations:
            status = kernels.float_linear(*common)
        else:
            status = kernels.block_linear(*common, self.precise)
        if status == -3:
            kept = "block sums" if self.float_activations else "quantized activations"
            raise MemoryError(f"no memory for {rows} rows of {kept}")
        if status != 0:  # BlockWeight.prepare admits only formats and layouts with a kernel
            raise RuntimeError(f"block kernel refused a {self.name} weight: {status}")
        return out

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [rows, in] times the weights decoded to float32 (``native/quant_dequantize.c``)
        a band of output rows at a time, each band in torch's float32 GEMM: for many rows
        (prefill), where decoding each weight once is cheap beside the rows' products and the
        GEMM runs at about three times the block kernels' rate. Not row-invariant: a row's
        result may differ in its last bits with the other rows of the call."""
        kernels = library()
        assert kernels is not None, "check available() first"
        x = x.float().contiguous()
        k, threads = self.in_features, torch.get_num_threads()
        band = min(self.out_features, max(8, DENSE_BAND_ELEMENTS // k))
        weights = torch.empty(band, k)
        bands = []
        for first in range(0, self.out_features, band):
            n = min(band, self.out_features - first)
            status = kernels.dequantize_parts(
                self.table, len(self.table), k, first, n, weights.data_ptr(), threads
            )
            if status != 0:  # the block kernels' formats are all decoded
                raise RuntimeError(f"no float32 decoding of a {self.name} weight: {status}")
            bands.append(x @ weights[:n].T)
        return bands[0] if len(bands) == 1 else torch.cat(bands, dim=1)
