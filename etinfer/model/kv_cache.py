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
the per-channel minimum and maximum of its keys and the sum of its values (updated on append),
and the attention mass the block last received.
"""

from __future__ import annotations

import warnings

import torch

from etinfer.model import native_kernels
from etinfer.model.block_layout import BlockSummaries

# index_reduce is stable in the pinned torch; the notice would only confuse.
warnings.filterwarnings("ignore", message="index_reduce\\(\\) is in beta")


class KVCache:
    """Keys and values of every layer, paged in blocks of ``block_size`` slots.

    Always float32, whatever the weights' dtype: attention runs in float32 (the CPU's sparse
    kernels take no half types, and softmax over long contexts wants the precision). With
    ``summaries`` it also keeps per block and KV head the key bounds and the last attention
    mass, about 1/16 of the cache's size at a block size of 16.
    """

    dtype = torch.float32

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        summaries: bool = False,
    ) -> None:
        shape = (num_layers, num_kv_heads, num_blocks * block_size, head_dim)
        # On the CPU, torch.empty leaves pages untouched until written: unused slots cost nothing.
        self.keys = torch.empty(shape, device=device, dtype=self.dtype)
        self.values = torch.empty(shape, device=device, dtype=self.dtype)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.native = device.type == "cpu" and native_kernels.available()
        self.key_bounds = self.mass = self.value_sums = None
        if summaries:
            per_block = (num_layers, num_kv_heads, num_blocks)
            self.key_bounds = torch.empty(
                (*per_block, 2, head_dim), device=device, dtype=self.dtype
            )
            self.mass = torch.empty(per_block, device=device, dtype=self.dtype)
            self.value_sums = torch.empty((*per_block, head_dim), device=device, dtype=self.dtype)

    def summaries(self, layer: int) -> BlockSummaries | None:
        if self.key_bounds is None:
            return None
        return BlockSummaries(self.key_bounds[layer], self.mass[layer], self.value_sums[layer])

    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        fresh_blocks: torch.Tensor | None,
        keys: torch.Tensor,  # [rows, kv_heads, head_dim]
        values: torch.Tensor,
    ) -> None:
        if fresh_blocks is not None and fresh_blocks.numel():
            # Decode reads a kept block whole and gives its slots past the context zero weight;
            # zero times a NaN left in reused memory is NaN, so a block's values start at zero.
            blocks = self.values[layer].view(
                self.values.shape[1], self.num_blocks, self.block_size, -1
            )
            blocks.index_fill_(1, fresh_blocks, 0.0)
        key_cache, value_cache = self.keys[layer], self.values[layer]
        native = self.native and native_kernels.write_cache(
            key_cache, value_cache, keys, values, slots
        )
        if not native:
            key_cache.index_copy_(1, slots, keys.transpose(0, 1))
            value_cache.index_copy_(1, slots, values.transpose(0, 1))
        if self.key_bounds is None:
            return
        keys, values = keys.transpose(0, 1), values.transpose(0, 1)
        key_max, key_min = self.key_bounds[layer].unbind(2)
        if fresh_blocks is not None and fresh_blocks.numel():
            # A block's first token starts its bounds afresh; its mass is unknown until it is
            # attended to, and +inf keeps it in the mass scorer's ranking until then.
            key_max.index_fill_(1, fresh_blocks, -torch.inf)
            key_min.index_fill_(1, fresh_blocks, torch.inf)
            self.mass[layer].index_fill_(1, fresh_blocks, torch.inf)
            self.value_sums[layer].index_fill_(1, fresh_blocks, 0.0)
        blocks = torch.div(slots, self.block_size, rounding_mode="floor")
        key_max.index_reduce_(1, blocks, keys, "amax")
        key_min.index_reduce_(1, blocks, keys, "amin")
        self.value_sums[layer].index_add_(1, blocks, values)
