"""A decode step's Llama decoder layers as one native call (``native/decoder.c``), and the two
elementwise kernels the layer-by-layer path shares with it (rotation, the gated activation).

At batch 1 on the default model about 40 % of a decode step held to AVX2 was neither the
weights' products nor attention but the torch and ctypes calls between them, some 80 a layer
(BENCHMARKS.md, the step profile). Where every layer's projections run on the block kernels and
attention is the plain native kernel over the step's dense pattern, the model hands the step's
decode rows to ``NativeDecoder`` instead: the layers' tables (weights, norms, cache pointers) are
built once, a step passes its rows, angles, slots and pattern. Every stage is the same C the
layer-by-layer path calls, in the same order, so a token computes bit for bit the same whichever
path its step takes (tested); steps with prefill rows, pruned or sparse attention, captured
queries or windows keep the layer-by-layer path.
"""

from __future__ import annotations

import ctypes

import torch

from etinfer.model import native_kernels, quant_kernels
from etinfer.model.attention.metadata import AttentionMetadata
from etinfer.model.config import ModelConfig
from etinfer.model.kv_cache import KVCache
from etinfer.model.linear import BlockLinear
from etinfer.model.rotary import RotaryRows

_pointer, _i64 = ctypes.c_void_p, ctypes.c_int64


class _Product(ctypes.Structure):
    _fields_ = [("parts", _pointer), ("count", _i64), ("precise", _i64), ("floats", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [
        *((name, _Product) for name in ("qkv", "o", "gate_up", "down")),
        *((name, _pointer) for name in ("qkv_bias", "input_norm", "post_attention_norm")),
        *((name, _pointer) for name in ("keys", "values", "key_scales", "value_scales")),
    ]


class _Shape(ctypes.Structure):
    _fields_ = [
        *((name, _i64) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate")),
        ("num_slots", _i64),
        ("kv_kind", _i64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("block_linear", _pointer),
        ("float_linear", _pointer),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("x", _pointer),
        ("rows", _i64),
        *((name, _pointer) for name in ("cos", "sin", "slots", "crow", "cols", "outside")),
        *((name, _i64) for name in ("nnz", "threads", "attention_threads")),
        ("work", _pointer),
    ]


def elementwise_native(*linears: object, width: int) -> bool:
    """Whether a layer whose projections are ``linears`` rotates and gates natively: on the
    block kernels (float32 in and out) with the native library built, and an MLP ``width`` the
    activation takes (a multiple of 8)."""
    blocks = all(isinstance(linear, BlockLinear) for linear in linears)
    return blocks and width % 8 == 0 and native_kernels.available()


def rotate_heads(qkv: torch.Tensor, heads: int, rows: RotaryRows) -> None:
    """Rotate the first ``heads`` heads of each row of ``qkv`` [rows, all heads, head_dim]
    (float32, contiguous) in place."""
    native = native_kernels.library()
    assert native is not None, "check elementwise_native() first"
    count, _, dim = qkv.shape
    cos, sin = rows.cos.contiguous(), rows.sin.contiguous()
    native.rotate_heads(
        qkv.data_ptr(), count, heads, dim, qkv.stride(0), cos.data_ptr(), sin.data_ptr()
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of ``gate_up`` [rows, 2 * width] (float32, contiguous), [rows, width]."""
    native = native_kernels.library()
    assert native is not None, "check elementwise_native() first"
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, width, dtype=torch.float32)
    native.silu_mul(gate_up.data_ptr(), rows, width, out.data_ptr())
    return out


def _product(linear: BlockLinear) -> _Product:
    product = linear.product
    return _Product(
        ctypes.addressof(product.table), len(product.table), product.precise,
        product.float_activations,
    )  # fmt: skip


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class NativeDecoder:
    """The tables of ``layers`` (Llama decoder layers whose ``fusable`` is true) over ``cache``,
    and the call that runs a decode-only step through them."""

    def __init__(self, config: ModelConfig, layers: list, cache: KVCache, scale: float) -> None:
        native, kernels = native_kernels.library(), quant_kernels.library()
        assert native is not None and kernels is not None, "check NativeDecoder.takes() first"
        self.native, self.cache = native, cache
        self.shape = _Shape(
            config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
            config.intermediate_size, cache.num_slots, native_kernels.KV_KINDS[cache.dtype],
            config.rms_norm_eps, scale, ctypes.cast(kernels.block_linear, _pointer),
            ctypes.cast(kernels.float_linear, _pointer),
        )  # fmt: skip
        self.layers = (_Layer * len(layers))()
        for index, layer in enumerate(layers):
            key_scales, value_scales = cache.layer_scales(index)
            self.layers[index] = _Layer(
                _product(layer.qkv), _product(layer.o), _product(layer.gate_up),
                _product(layer.down), _address(layer.qkv.bias),
                _address(layer.input_norm.weight), _address(layer.post_attention_norm.weight),
                cache.layer_keys[index].data_ptr(), cache.layer_values[index].data_ptr(),
                _address(key_scales), _address(value_scales),
            )  # fmt: skip
        self.held = layers  # the tables point into their weights

    @staticmethod
    def takes(layers: list, cache: KVCache) -> bool:
        """Whether every layer and the cache are of the kinds ``decode_layers`` computes."""
        if not (cache.native and quant_kernels.available()):
            return False
        return cache.key_bounds is None and all(layer.fusable for layer in layers)

    def __call__(
        self, x: torch.Tensor, rows: RotaryRows, meta: AttentionMetadata, layers: range
    ) -> torch.Tensor:
        """The residual stream after ``layers`` of a decode-only step (``x`` [rows, hidden]
        float32, updated in place and returned)."""
        pattern = meta.dense_pattern
        assert pattern is not None and not meta.prefills, "a decode-only step with its pattern"
        if meta.fresh_blocks is not None and meta.fresh_blocks.numel():
            self.cache.clear_fresh(meta.fresh_blocks, slice(layers.start, layers.stop))
        x = x.contiguous()
        count, entries = x.shape[0], pattern.cols.shape[0]
        cos, sin = rows.cos.contiguous(), rows.sin.contiguous()
        slots = meta.slot_mapping
        floats = self.native.decoder_work_floats(ctypes.byref(self.shape), count, entries)
        work = torch.empty(floats)
        step = _Step(
            x.data_ptr(), count, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
            pattern.crow.data_ptr(), pattern.cols.data_ptr(), pattern.outside.data_ptr(),
            entries, torch.get_num_threads(), native_kernels.attention_threads(entries),
            work.data_ptr(),
        )  # fmt: skip
        first = ctypes.byref(self.layers, layers.start * ctypes.sizeof(_Layer))
        status = self.native.decode_layers(
            ctypes.byref(self.shape), first, len(layers), ctypes.byref(step)
        )
        if status:
            raise RuntimeError(f"the native decoder failed at stage code {status}")
        return x
