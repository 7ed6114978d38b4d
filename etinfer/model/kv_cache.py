"""Keys and values of every layer in a pool of fixed-size blocks, with per-block summaries.

**Layout.** One layer's cache is a pool of slots per KV head:
``[num_kv_heads, num_blocks * block_size, head_dim]`` for keys, and the same for values. A
sequence owns a list of blocks (its block table); its cache entry ``i`` lives in slot
``block_table[i // block_size] * block_size + i % block_size``, and entry ``i`` holds position
``i`` until KV compression rewrites the cache (then ``i = position - kv_offset`` for new tokens,
and the earlier entries hold each head's kept positions, in order). Head-major order keeps a block's
keys for one head in one contiguous run, which measured twice as fast to read scattered as
token-major order.

**Block summaries.** When a selector scores blocks, the cache also keeps, per block and KV head,
the per-channel minimum and maximum of its keys, the sums of its keys and of their squares,
the sum of its values (all updated on append), and the attention mass the block last received.
"""

from __future__ import annotations

import warnings

import torch

from etinfer.model import native_kernels
from etinfer.model.block_layout import BlockSummaries
from etinfer.model.config import ModelConfig
from etinfer.model.key_copy import copy_shape, write_codes

# index_reduce is stable in the pinned torch; the notice would only confuse.
warnings.filterwarnings("ignore", message="index_reduce\\(\\) is in beta")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., dim] in int8 with a float32 scale per row [...]: the row's largest magnitude
    over 127, each element divided by it and rounded to nearest even (the native write's
    arithmetic, operation for operation)."""
    scale = x.abs().amax(-1) / 127.0
    divisor = torch.where(scale > 0, scale, 1.0)
    return torch.round(x / divisor[..., None]).to(torch.int8), scale


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Cache bytes one token holds over all layers, keys and values, in ``dtype`` (int8 with its
    scales)."""
    scale_bytes = 4 if dtype == torch.int8 else 0
    return (
        2
        * config.num_layers
        * config.num_kv_heads
        * (config.head_dim * dtype.itemsize + scale_bytes)
    )


class KVCache:
    """Keys and values of every layer, paged in blocks of ``block_size`` slots.

    Stored in ``dtype``: float32, float16, bfloat16, or int8 with a float32 scale per token and
    KV head (``key_scales``, ``value_scales``: [layers, kv_heads, slots]), as llama.cpp's q8_0
    cache and vLLM's fp8 one keep theirs. Computed with in float32 whatever the weights' dtype
    (``compute_dtype``): softmax over long contexts wants the precision, and widening on load
    costs nothing beside the bandwidth it saves. Attention reads every key and value as stored,
    prefill's fresh ones too (``as_stored``), so a token's result does not depend on whether its
    context came from this step or the cache. With ``summaries`` it also keeps per block and KV
    head the key bounds (of the stored keys), the value sums and the last attention mass, three
    vectors a block beside the 32 of a float32 cache's keys and values at a block size of 16;
    with ``moments`` (the digest scorer's) also the sums of the stored keys and of their squares.
    """

    compute_dtype = torch.float32

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        summaries: bool = False,
        moments: bool = False,
        sketch_key_maps: torch.Tensor | None = None,
    ) -> None:
        if dtype not in native_kernels.KV_KINDS:
            raise ValueError(f"a KV cache of {dtype}: it stores {list(native_kernels.KV_KINDS)}")
        self.dtype = dtype
        shape = (num_layers, num_kv_heads, num_blocks * block_size, head_dim)
        # On the CPU, torch.empty leaves pages untouched until written: unused slots cost nothing.
        self.keys = torch.empty(shape, device=device, dtype=self.dtype)
        self.values = torch.empty(shape, device=device, dtype=self.dtype)
        # Each layer's views, [kv_heads, slots, dim] and as rows [kv_heads * slots, dim], taken
        # once: taken per layer and step they were some 300 operator calls a decode step.
        self.layer_keys, self.layer_values = self.keys.unbind(0), self.values.unbind(0)
        self.key_rows = tuple(k.view(-1, head_dim) for k in self.layer_keys)
        self.value_rows = tuple(v.view(-1, head_dim) for v in self.layer_values)
        self.key_scales = self.value_scales = None
        if dtype == torch.int8:
            self.key_scales = torch.empty(shape[:3], device=device, dtype=self.compute_dtype)
            self.value_scales = torch.empty(shape[:3], device=device, dtype=self.compute_dtype)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.native = device.type == "cpu" and native_kernels.available()
        self.key_bounds = self.mass = self.value_sums = self.key_moments = None
        if summaries:
            per_block, summary_dtype = (num_layers, num_kv_heads, num_blocks), self.compute_dtype
            # Key bounds in a 16-bit cache's own type: the extremes of its keys are values of
            # that type, so they stay exact at half the bytes pruning's scoring reads.
            bound_dtype = self.dtype if self.dtype.itemsize == 2 else summary_dtype
            self.key_bounds = torch.empty(
                (*per_block, 2, head_dim), device=device, dtype=bound_dtype
            )
            self.mass = torch.empty(per_block, device=device, dtype=summary_dtype)
            self.value_sums = torch.empty(
                (*per_block, head_dim), device=device, dtype=summary_dtype
            )
            if moments:  # the digest scorer's alone
                self.key_moments = torch.empty(
                    (*per_block, 2, head_dim), device=device, dtype=summary_dtype
                )
        # The sketch scorer's copy of every key, written with the keys (``update_sketch``).
        self.sketch_key_maps = self.key_sketch = self.sketch_scales = None
        if sketch_key_maps is not None:
            self.sketch_key_maps = sketch_key_maps.to(device, self.compute_dtype)
            per_slot = (num_layers, num_kv_heads, self.num_slots)
            rank, blocks = sketch_key_maps.shape[-1], self.num_slots // block_size
            layout = (num_layers, *copy_shape(num_kv_heads, blocks, block_size, rank))
            self.key_sketch = torch.zeros(layout, device=device, dtype=torch.int8)
            self.sketch_scales = torch.zeros(per_slot, device=device, dtype=self.compute_dtype)

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Everything the pool allocates: keys, values, their int8 scales, block summaries."""
        tensors = (self.keys, self.values, self.key_scales, self.value_scales)
        tensors += (self.key_bounds, self.mass, self.value_sums, self.key_moments)
        tensors += (self.key_sketch, self.sketch_scales)
        return [t for t in tensors if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def as_stored(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., head_dim] (float32) as the cache would store it, in float32."""
        if self.dtype == torch.int8:
            quantized, scale = quantize_rows(x)
            return quantized.to(x.dtype) * scale[..., None]
        return x if self.dtype == x.dtype else x.to(self.dtype).to(x.dtype)

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The layer's key and value scales, a row each [kv_heads * slots] (None unless int8)."""
        return tuple(None if s is None else s.view(-1) for s in self.layer_scales(layer))

    def layer_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The layer's key and value scales, [kv_heads, slots] each (None unless int8)."""
        if self.key_scales is None:
            return None, None
        return self.key_scales[layer], self.value_scales[layer]

    def read(
        self, layer: int, slots: torch.Tensor, heads: slice = slice(None)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at ``slots`` (any shape), in float32: [kv_heads, *slots.shape, dim]."""
        flat = slots.reshape(-1)
        keys = self.keys[layer, heads].index_select(1, flat).to(self.compute_dtype)
        values = self.values[layer, heads].index_select(1, flat).to(self.compute_dtype)
        if self.key_scales is not None:
            keys *= self.key_scales[layer, heads].index_select(1, flat)[..., None]
            values *= self.value_scales[layer, heads].index_select(1, flat)[..., None]
        shape = (keys.shape[0], *slots.shape, keys.shape[-1])
        return keys.view(shape), values.view(shape)

    def read_rows(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at cache rows ``kv_head * num_slots + slot`` (decode's pattern
        columns), in float32: [len(rows), dim]."""
        keys = self.keys[layer].flatten(0, 1).index_select(0, rows).to(self.compute_dtype)
        values = self.values[layer].flatten(0, 1).index_select(0, rows).to(self.compute_dtype)
        key_scales, value_scales = self.scales(layer)
        if key_scales is not None:
            keys *= key_scales.index_select(0, rows)[:, None]
            values *= value_scales.index_select(0, rows)[:, None]
        return keys, values

    def summaries(self, layer: int) -> BlockSummaries | None:
        if self.key_bounds is None:
            return None
        return BlockSummaries(
            self.key_bounds[layer],
            self.mass[layer],
            self.value_sums[layer],
            key_moments=None if self.key_moments is None else self.key_moments[layer],
            layer_masses=self.mass,
            key_sketch=None if self.key_sketch is None else self.key_sketch[layer],
            sketch_scales=None if self.sketch_scales is None else self.sketch_scales[layer],
        )

    def clear_fresh(self, fresh_blocks: torch.Tensor, layers: slice) -> None:
        """Zero the values of blocks receiving their first token, in ``layers``. Decode reads a
        kept block whole and gives its slots past the context zero weight; zero times a NaN left
        in reused memory is NaN, so a block's values start at zero."""
        per_block = (self.values.shape[1], self.num_blocks, self.block_size)
        values = self.values[layers]
        values.view(len(values), *per_block, -1).index_fill_(2, fresh_blocks, 0)
        if self.value_scales is not None:
            scales = self.value_scales[layers]
            scales.view(len(scales), *per_block).index_fill_(2, fresh_blocks, 0.0)

    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        fresh_blocks: torch.Tensor | None,
        keys: torch.Tensor,  # [rows, kv_heads, head_dim]
        values: torch.Tensor,
    ) -> None:
        if fresh_blocks is not None and fresh_blocks.numel():
            self.clear_fresh(fresh_blocks, slice(layer, layer + 1))
        key_cache, value_cache = self.layer_keys[layer], self.layer_values[layer]
        key_scales = value_scales = None
        if self.key_scales is not None:
            key_scales, value_scales = self.key_scales[layer], self.value_scales[layer]
        native = self.native and native_kernels.write_cache(
            key_cache, value_cache, keys, values, slots, key_scales, value_scales
        )
        if not native:
            for cache, rows, row_scales in (
                (key_cache, keys, key_scales),
                (value_cache, values, value_scales),
            ):
                rows = rows.transpose(0, 1)
                if row_scales is None:
                    cache.index_copy_(1, slots, rows.to(self.dtype))
                else:
                    quantized, scale = quantize_rows(rows)
                    cache.index_copy_(1, slots, quantized)
                    row_scales.index_copy_(1, slots, scale)
        if self.key_bounds is not None:
            self.update_summaries(slice(layer, layer + 1), slots, fresh_blocks)

    def update_sketch(self, layers: slice, slots: torch.Tensor) -> None:
        """The key copy of ``layers`` at ``slots`` after their keys were written, from the keys
        as stored (nothing where the cache keeps no copy). Called once for all layers after a
        step's forward pass, not as each layer writes (a dozen operations a layer were 4 ms of a
        batch-1 step): no step reads the copy of a token it writes, which its sequence keeps
        whatever it prunes (the current token, and the block that holds it)."""
        if self.key_sketch is None:
            return
        keys = self.keys[layers][:, :, slots].to(self.compute_dtype)
        if self.key_scales is not None:
            keys *= self.key_scales[layers][:, :, slots, None]
        codes, scales = quantize_rows(keys @ self.sketch_key_maps[layers])
        write_codes(self.key_sketch[layers], slots, codes)
        self.sketch_scales[layers].index_copy_(2, slots, scales)

    def update_summaries(
        self, layers: slice, slots: torch.Tensor, fresh_blocks: torch.Tensor | None
    ) -> None:
        """The block summaries of ``layers`` after their keys and values at ``slots`` were
        written, read back as stored: the layer-by-layer path calls it for a layer as it
        writes; the native decoder keeps them inside its step, with the same C."""
        if self.native and slots.dtype == torch.int64:
            for layer in range(*layers.indices(len(self.keys))):
                self._update_summaries_natively(layer, slots.contiguous(), fresh_blocks)
            return
        key_max, key_min = self.key_bounds[layers].unbind(3)
        # The keys as stored, in the bounds' type: a 16-bit cache's own (exact), with no round
        # trip through float32.
        keys = self.keys[layers][:, :, slots]
        values = self.values[layers][:, :, slots].to(self.compute_dtype)
        if self.key_scales is not None:
            keys = keys.to(self.compute_dtype) * self.key_scales[layers][:, :, slots, None]
            values *= self.value_scales[layers][:, :, slots, None]
        keys = keys.to(key_max.dtype)
        mass, value_sums = self.mass[layers], self.value_sums[layers]
        moments = None if self.key_moments is None else self.key_moments[layers]
        if fresh_blocks is not None and fresh_blocks.numel():
            # A block's first token starts its bounds afresh; its mass is unknown until it is
            # attended to, and +inf keeps it in the mass scorer's ranking until then.
            key_max.index_fill_(2, fresh_blocks, -torch.inf)
            key_min.index_fill_(2, fresh_blocks, torch.inf)
            mass.index_fill_(2, fresh_blocks, torch.inf)
            value_sums.index_fill_(2, fresh_blocks, 0.0)
            if moments is not None:
                moments.index_fill_(2, fresh_blocks, 0.0)
        blocks = torch.div(slots, self.block_size, rounding_mode="floor")
        key_max.index_reduce_(2, blocks, keys, "amax")
        key_min.index_reduce_(2, blocks, keys, "amin")
        value_sums.index_add_(2, blocks, values)
        if moments is not None:
            keys = keys.to(self.compute_dtype)
            moments.index_add_(2, blocks, torch.stack([keys, keys.square()], 3))

    def _update_summaries_natively(
        self, layer: int, slots: torch.Tensor, fresh_blocks: torch.Tensor | None
    ) -> None:
        """``update_summaries`` for one layer in one call (``native/block_summaries.c``)."""
        native = native_kernels.library()
        fresh = fresh_blocks if fresh_blocks is not None else slots[:0]
        fresh = fresh.to(torch.int64).contiguous()
        key_scales, value_scales = self.layer_scales(layer)
        moments = None if self.key_moments is None else self.key_moments[layer].data_ptr()
        native.update_block_summaries(
            self.layer_keys[layer].data_ptr(), self.layer_values[layer].data_ptr(),
            None if key_scales is None else key_scales.data_ptr(),
            None if value_scales is None else value_scales.data_ptr(),
            native_kernels.KV_KINDS[self.dtype], slots.data_ptr(), slots.shape[0],
            self.keys.shape[1], self.num_slots, self.keys.shape[-1], self.block_size,
            fresh.data_ptr(), fresh.shape[0], self.key_bounds[layer].data_ptr(),
            native_kernels.KV_KINDS[self.key_bounds.dtype], self.mass[layer].data_ptr(),
            self.value_sums[layer].data_ptr(), moments,
        )  # fmt: skip
