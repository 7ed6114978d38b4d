"""Blocks ranked by a mean-and-spread digest of their keys instead of per-channel min/max
bounds (a public engine scored its pages so and took needle retrieval from 2/10 to 10/10 at a
4,096-token budget).

A block's keys have, per channel, a mean ``mu`` and a standard deviation ``sigma``; a query's
scores over the block then have mean ``q.mu`` and a standard deviation of ``||q * sigma||``
where the channels are uncorrelated (at most ``sum |q_c| sigma_c`` in general), so
``q.mu + spread * ||q * sigma||`` estimates its largest score. Where a block holds one outlier
key among similar ones, min/max bounds give the whole block that outlier's reach in every
channel at once; the digest gives it what the block's keys have on average plus their spread.
Two vectors a block, as the bounds: a cache could keep the sums of keys and of their squares
as it writes them. Computed here from the cached keys (a measurement: its time is not a
kernel's).
"""

from __future__ import annotations

import torch

from etinfer.control.block_selection import EntropicSelector, PruningConfig
from etinfer.model.kv_cache import KVCache
from studies.laws.oracle_selection import block_keys


class DigestSelector(EntropicSelector):
    def __init__(self, config: PruningConfig, cache: KVCache, spread: float) -> None:
        super().__init__(config)
        self.cache = cache
        self.spread = spread

    def block_scores(self, layer, query, blocks, summaries, bounds) -> torch.Tensor:
        """Each block's estimated largest score, the most any head of its group gives it:
        [seqs, kv_heads, max_blocks]."""
        keys, inside = block_keys(self.cache, layer, blocks)
        kv_heads, seqs, _, dim = keys.shape
        width, size = blocks.block_tables.shape[1], blocks.block_size
        keys = keys.view(kv_heads, seqs, width, size, dim)
        # Slots past a row's end hold whatever the memory held (NaN too): selected out, not
        # multiplied by zero.
        outside = ~inside.view(1, seqs, width, size, 1)
        counts = (~outside).sum(3).clamp(min=1)
        keys = keys.masked_fill(outside, 0.0)
        mean = keys.sum(3) / counts  # [kv_heads, seqs, width, dim]
        variance = (keys - mean[:, :, :, None]).square().masked_fill(outside, 0.0).sum(3) / counts
        q = query.view(seqs, kv_heads, -1, dim).transpose(0, 1)
        centre = torch.einsum("ksgd,kswd->ksgw", q, mean)
        reach = torch.einsum("ksgd,kswd->ksgw", q * q, variance).sqrt()
        scores = (centre + self.spread * reach).amax(2)  # [kv_heads, seqs, width]
        return scores.transpose(0, 1)
