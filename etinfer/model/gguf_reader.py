"""A GGUF file's metadata and tensor index, read directly, its tensor data memory-mapped.

The ``gguf`` package's reader makes a numpy view for every part of every field: 9 s for Gemma
3's 262,144-entry vocabulary arrays (three of them) before a weight is touched. This reads the
same little-endian format (versions 2 and 3) in one pass over the header, decoding numeric
arrays with one ``frombuffer`` each and strings from the mapped bytes: a fraction of a second.
Tensor data is not read here: each tensor is a view of the mapping, checked to lie within it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from etinfer.model import native_kernels

_MAGIC = b"GGUF"
_SCALARS = {  # GGUF value type -> struct format
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?"}
_NUMPY |= {10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")  # a string's length before its bytes
_DEFAULT_ALIGNMENT = 32
# Arrays of at least this many strings are walked by the native kernels (fewer: not worth a call).
_NATIVE_STRINGS = 1024


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # as the file lists it: fastest-varying dimension first
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # float32/float16 elements, or the blocks' bytes (uint8)


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        self.data = np.memmap(path, mode="r")
        self._buffer = memoryview(self.data)
        self._at = 0
        if bytes(self._buffer[:4]) != _MAGIC:
            raise ValueError("not a GGUF file (no GGUF magic)")
        self._at = 4
        version = self._scalar(4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3, little-endian)")
        num_tensors, num_fields = self._scalar(10), self._scalar(10)
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            self.fields[key] = self._value(self._scalar(4))
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = int(self.fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-self._at // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _tensor(
        self, start: int, name: str, shape: tuple[int, ...], kind: int, offset: int
    ) -> GGUFTensor:
        qtype = GGMLQuantizationType(kind)
        elements, size = GGML_QUANT_SIZES[qtype]
        count = int(np.prod(shape))
        need, begin = count * size // elements, start + offset
        if begin + need > len(self.data):
            raise ValueError(
                f"tensor {name!r} ({qtype.name}) is truncated: the file holds "
                f"{max(0, len(self.data) - begin)} of its {need} bytes"
            )
        raw = self.data[begin : begin + need]
        if qtype is GGMLQuantizationType.F32:
            data = raw.view("<f4")
        elif qtype is GGMLQuantizationType.F16:
            data = raw.view("<f2")
        else:
            data = raw
        return GGUFTensor(name, shape, qtype, data)

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = tuple(self._scalar(10) for _ in range(self._scalar(4)))
        return name, dims, self._scalar(4), self._scalar(10)

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._scalar(4), self._scalar(10)
            if item in _NUMPY:
                dtype = np.dtype(_NUMPY[item])
                values = np.frombuffer(self._buffer, dtype, count, self._at)
                self._at += count * dtype.itemsize
                return values.tolist()
            if item == _STRING:
                return self._strings(count)
            return [self._value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"GGUF value type {kind} is not a known type")
        return self._scalar(kind)

    def _scalar(self, kind: int) -> Any:
        fmt = _SCALARS[kind]
        (value,) = struct.unpack_from(fmt, self._buffer, self._at)
        self._at += struct.calcsize(fmt)
        return value

    def _strings(self, count: int) -> list[str]:
        """``count`` strings in a row: a vocabulary (Gemma 3's has 262,144), found and copied
        out by the native kernels and decoded in one call (0.24 s in a Python loop, a tenth of
        that here); in a Python loop where they do not run or a string holds a zero byte."""
        native = native_kernels.library() if count >= _NATIVE_STRINGS else None
        if native is not None:
            address = self.data.ctypes.data
            end = native.gguf_strings_end(address, len(self.data), self._at, count)
            if end < 0:
                raise ValueError(f"an array of {count} strings runs past the end of the file")
            joined = np.empty(end - self._at - 7 * count, np.uint8)
            if native.gguf_strings_join(address, self._at, count, joined.ctypes.data) == 0:
                self._at = end
                return str(memoryview(joined), "utf-8", errors="replace").split("\0")[:-1]
        buffer, at, texts = self._buffer, self._at, []
        for _ in range(count):
            (length,) = _LENGTH.unpack_from(buffer, at)
            texts.append(str(buffer[at + 8 : at + 8 + length], "utf-8", errors="replace"))
            at += 8 + length
        self._at = at
        return texts

    def _string(self) -> str:
        length = self._scalar(10)
        text = str(self._buffer[self._at : self._at + length], "utf-8", errors="replace")
        self._at += length
        return text
