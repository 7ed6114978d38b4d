"""A decode step's decoder layers as one native call (``native/decoder.c``), and the elementwise
kernels the layer-by-layer path shares with it (rotation, per-head norms, the gated activation).

At batch 1 on the default model about 40 % of a decode step held to AVX2 was neither the
weights' products nor attention but the torch and ctypes calls between them, some 80 a layer
(BENCHMARKS.md, the step profile). Where every layer's projections run on the block kernels and
attention is the plain native kernel over the step's dense pattern, the model hands the step's
decode rows to ``NativeDecoder`` instead: the layers' tables (weights, norms, cache pointers) are
built once, a step passes its rows, angles, slots and pattern. Every stage is the same C the
layer-by-layer path calls, in the same order, so a token computes bit for bit the same whichever
path its step takes (tested); steps with prefill rows, sparse prefill or captured queries keep the
layer-by-layer path, and so do pruned steps of selectors that rank blocks by each layer's query.
Pruning by reused masses runs a call per run of layers reading the same blocks; single tokens
(``TokenChoice``) are chosen inside the one call, at each layer, by the C the other path calls
(``native_token_step.py``). Llama's layer and Gemma 3's (``DecoderLayer.native_roles`` names the
norms each has in the C layer's roles).
"""

from __future__ import annotations

import ctypes
import os

import torch

from etinfer.model import native_kernels, quant_kernels
from etinfer.model.attention.layer import PagedAttention
from etinfer.model.attention.metadata import AttentionMetadata
from etinfer.model.attention.options import AttentionOptions
from etinfer.model.attention.pattern import DecodePattern
from etinfer.model.block_layout import TokenChoice
from etinfer.model.config import ModelConfig
from etinfer.model.kv_cache import KVCache
from etinfer.model.linear import BlockLinear
from etinfer.model.native_token_step import TokenStep
from etinfer.model.pruning_telemetry import PrunedLayer
from etinfer.model.rotary import RotaryRows

_pointer, _i64 = ctypes.c_void_p, ctypes.c_int64


class _Product(ctypes.Structure):
    _fields_ = [("parts", _pointer), ("count", _i64), ("precise", _i64), ("floats", _i64)]


# The C layer's norms by role (``Layer`` in native/decoder.c).
NORM_ROLES = ("q_norm", "k_norm", "input_norm", "mlp_norm", "attention_out_norm", "mlp_out_norm")
# Its activations, by number.
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


class _Layer(ctypes.Structure):
    _fields_ = [
        *((name, _Product) for name in ("qkv", "o", "gate_up", "down")),
        *((name, _pointer) for name in ("qkv_bias", *NORM_ROLES)),
        *((name, _pointer) for name in ("keys", "values", "key_scales", "value_scales")),
        ("local", _i64),
        ("key_bounds", _pointer),
        *((name, _pointer) for name in ("mass", "value_sums", "key_moments")),
        ("observed", _i64),
        *((name, _pointer) for name in ("query_map", "codes", "code_scales")),
    ]


class _Shape(ctypes.Structure):
    _fields_ = [
        *((name, _i64) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate")),
        *((name, _i64) for name in ("num_slots", "kv_kind", "activation")),
        *((name, _i64) for name in ("block_size", "bound_kind", "sketch_rank")),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("block_linear", _pointer),
        ("float_linear", _pointer),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("x", _pointer),
        ("rows", _i64),
        ("slots", _pointer),
        ("threads", _i64),
        ("work", _pointer),
        # By kind of layer (whole-context, sliding).
        *((name, _pointer * 2) for name in ("cos", "sin", "crow", "cols", "outside")),
        *((name, _i64 * 2) for name in ("nnz", "attention_threads")),
        ("fresh", _pointer),
        ("num_fresh", _i64),
        # Single tokens (``TokenStep``).
        *((name, _pointer) for name in ("tables", "lens", "budgets")),
        *((name, _i64) for name in ("width", "sink", "recent")),
        *((name, _pointer) for name in ("token_crow", "token_cols", "token_outside")),
        *((name, _i64) for name in ("token_nnz", "token_threads")),
        *((name, _pointer) for name in ("kept", "projected")),
        ("kept_stride", _i64),
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


def norm_heads(qkv: torch.Tensor, heads: slice, weight: torch.Tensor, eps: float) -> None:
    """RMS-norm ``heads`` of each row of ``qkv`` [rows, all heads, head_dim] (float32,
    contiguous) in place, times ``weight`` [head_dim]."""
    native = native_kernels.library()
    assert native is not None, "check elementwise_native() first"
    rows, _, dim = qkv.shape
    first = qkv[:, heads]
    native.norm_heads(
        first.data_ptr(), rows, first.shape[1], dim, qkv.stride(0), weight.data_ptr(), eps
    )


def gated_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up of ``gate_up`` [rows, 2 * width] (float32, contiguous), [rows, width];
    ``activation`` one of ``ACTIVATIONS``."""
    native = native_kernels.library()
    assert native is not None, "check elementwise_native() first"
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, width, dtype=torch.float32)
    native.gated_activation(
        gate_up.data_ptr(), rows, width, ACTIVATIONS[activation], out.data_ptr()
    )
    return out


def norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMS norm of ``x`` [rows, hidden] (float32) times ``weight``, natively."""
    return native_kernels.residual_rms_norm(x, None, weight, eps, torch.float32)[1]


def _product(linear: BlockLinear) -> _Product:
    product = linear.product
    return _Product(
        ctypes.addressof(product.table), len(product.table), product.precise,
        product.float_activations,
    )  # fmt: skip


def _address(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class NativeDecoder:
    """The tables of ``layers`` (decoder layers whose ``native`` is true) over ``cache``, and the
    call that runs a decode-only step through them. ``observed``: the layers whose attention
    weighs the cache's blocks for a pruning selector (``AttentionSelector.observes``); inside
    the step their masses and the cache's block summaries are kept by the C the layer-by-layer
    path calls (``native/block_summaries.c``), so a pruning engine's steps take it too."""

    def __init__(
        self,
        config: ModelConfig,
        layers: list,
        cache: KVCache,
        attention: AttentionOptions,
        observed: list[int],
        choice: TokenChoice | None = None,
    ) -> None:
        native, kernels = native_kernels.library(), quant_kernels.library()
        assert native is not None and kernels is not None, "check NativeDecoder.takes() first"
        self.native, self.cache = native, cache
        bounds = cache.key_bounds
        self.choice = choice
        # The layers that choose single tokens, and their maps as the C reads them.
        self.choosing: frozenset[int] = frozenset()
        maps = None
        if choice is not None:
            assert cache.key_sketch is not None, "a cache that keeps the key copy"
            maps = choice.query_maps.to(torch.float32).contiguous()
            local = attention.local_layers
            self.choosing = frozenset(range(choice.dense_layers, len(layers))) - local
        self.shape = _Shape(
            config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
            config.intermediate_size, cache.num_slots, native_kernels.KV_KINDS[cache.dtype],
            ACTIVATIONS[layers[0].activation], cache.block_size,
            native_kernels.KV_KINDS[bounds.dtype] if bounds is not None else 0,
            0 if maps is None else maps.shape[-1],
            config.rms_norm_eps, attention.scale,
            ctypes.cast(kernels.block_linear, _pointer),
            ctypes.cast(kernels.float_linear, _pointer),
        )  # fmt: skip
        self.layers = (_Layer * len(layers))()
        summaries = (bounds, cache.mass, cache.value_sums, cache.key_moments)
        for index, layer in enumerate(layers):
            key_scales, value_scales = cache.layer_scales(index)
            roles = layer.native_roles()
            sketch = (None, None, None)
            if index in self.choosing:
                copy = (maps[index], cache.key_sketch[index], cache.sketch_scales[index])
                sketch = tuple(t.data_ptr() for t in copy)
            self.layers[index] = _Layer(
                _product(layer.qkv), _product(layer.o), _product(layer.gate_up),
                _product(layer.down), _address(layer.qkv.bias),
                *(_address(roles.get(role)) for role in NORM_ROLES),
                cache.layer_keys[index].data_ptr(), cache.layer_values[index].data_ptr(),
                _address(key_scales), _address(value_scales), index in attention.local_layers,
                *(None if t is None else _address(t[index]) for t in summaries),
                index in observed, *sketch,
            )  # fmt: skip
        self.held = (layers, maps)  # the tables point into their weights and maps

    @staticmethod
    def takes(layers: list, cache: KVCache) -> bool:
        """Whether every layer and the cache are of the kinds ``decode_layers`` computes, and
        the user left it on (``ETINFER_NATIVE_DECODER=0``: layer by layer, the same tokens, to
        measure one against the other)."""
        if os.environ.get("ETINFER_NATIVE_DECODER", "1") == "0":
            return False
        if not (cache.native and quant_kernels.available()):
            return False
        activations = {layer.activation for layer in layers}
        return all(layer.native for layer in layers) and len(activations) == 1

    def __call__(
        self,
        x: torch.Tensor,
        angles: list[RotaryRows],
        meta: AttentionMetadata,
        layers: range,
        pattern: DecodePattern | None = None,
    ) -> torch.Tensor:
        """The residual stream after ``layers`` of a decode-only step (``x`` [rows, hidden]
        float32, updated in place and returned); ``angles`` the whole-context layers' rows of
        the tables, then the sliding layers' where they have their own; ``pattern``: what the
        whole-context layers read where a selector narrowed it (None: the step's dense one)."""
        assert not meta.prefills, "a decode-only step"
        fresh = meta.fresh_blocks
        if fresh is not None and fresh.numel():
            self.cache.clear_fresh(fresh, slice(layers.start, layers.stop))
        x = x.contiguous()
        patterns = [pattern or meta.dense_pattern, (meta.local or meta).dense_pattern]
        tables = [(a.cos.contiguous(), a.sin.contiguous()) for a in (angles[0], angles[-1])]
        entries = [p.cols.shape[0] for p in patterns]
        chosen = [index for index in layers if index in self.choosing]
        tokens = TokenStep.of(self.choice, self.shape, meta, len(layers)) if chosen else None
        most = max([*entries, tokens.nnz if tokens else 0])
        floats = self.native.decoder_work_floats(ctypes.byref(self.shape), x.shape[0], most)
        work = torch.empty(floats)

        def pair(values: list, kind=_pointer):
            return (kind * 2)(*values)

        if fresh is None:
            fresh = meta.slot_mapping[:0]
        step = _Step(
            x.data_ptr(), x.shape[0], meta.slot_mapping.data_ptr(), torch.get_num_threads(),
            work.data_ptr(), pair([c.data_ptr() for c, _ in tables]),
            pair([s.data_ptr() for _, s in tables]), pair([p.crow.data_ptr() for p in patterns]),
            pair([p.cols.data_ptr() for p in patterns]),
            pair([p.outside.data_ptr() for p in patterns]), pair(entries, _i64),
            pair([native_kernels.attention_threads(n) for n in entries], _i64),
            fresh.data_ptr(), fresh.numel(), *(tokens.fields if tokens else TokenStep.NONE),
        )  # fmt: skip
        first = ctypes.byref(self.layers, layers.start * ctypes.sizeof(_Layer))
        status = self.native.decode_layers(
            ctypes.byref(self.shape), first, len(layers), ctypes.byref(step)
        )
        if status:
            raise RuntimeError(f"the native decoder failed at stage code {status}")
        if tokens is not None and meta.telemetry is not None:
            for index in chosen:
                visible = tokens.kept[index - layers.start]
                meta.telemetry.record(PrunedLayer(index, None, visible, None, None))
        return x


class NativeDecoders:
    """A model's native decoder for each step that may take it: built on first use over the
    step's cache, and again where the layers whose masses are kept (the selector's) changed."""

    def __init__(self, config: ModelConfig, layers: list, attention: PagedAttention) -> None:
        self.config, self.layers, self.attention = config, layers, attention
        self.key: tuple | None = None  # the cache and observed layers ``decoder`` was built for
        self.decoder: NativeDecoder | None = None

    def path(self, cache: KVCache) -> str:
        """How decode-only steps over ``cache`` run, in words (the start-up line's)."""
        if not (self.attention.reads_natively and NativeDecoder.takes(self.layers, cache)):
            return "layer by layer"
        selector = self.attention.selector
        if selector.reads_everything:
            return "in one native call"
        if selector.selects_without_query:
            return "in one native call, or one per run of layers reading the same blocks"
        if selector.token_choice is not None:
            return "in one native call, single tokens chosen inside it"
        return "in one native call where no layer is pruned"

    def for_step(self, cache: KVCache, meta: AttentionMetadata) -> NativeDecoder | None:
        """The native decoder over ``cache`` where this step may take it."""
        attention = self.attention
        if not attention.decodes_natively(meta):
            return None
        observed: tuple[int, ...] = ()
        if cache.mass is not None:
            selector = attention.selector
            observed = tuple(i for i in range(len(self.layers)) if selector.observes(i))
        choice = attention.selector.token_choice
        # Keyed by what the tables hold, not by the selector: a benchmark that switches between
        # selectors each step would otherwise rebuild them each step.
        key = (cache, observed, choice)
        if self.key is None or self.key[0] is not cache or self.key[1:] != key[1:]:
            self.key, self.decoder = key, None
            if NativeDecoder.takes(self.layers, cache):
                self.decoder = NativeDecoder(
                    self.config, self.layers, cache, attention.options, list(observed), choice
                )
        return self.decoder
