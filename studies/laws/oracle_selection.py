"""The best any block scorer could do: blocks ranked by the attention mass they carry this step.

A measurement tool, not a serving path: finding each block's exact mass costs a full dense
attention over the context (more than attending to every block). It keeps exactly the blocks,
and as many, as the entropic selector would (the same budgets, sink and recent blocks first),
ranking the rest by ``max over the group's heads of sum_{i in b} softmax(q.k)_i``. Fidelity at
a budget under this oracle is the ceiling for every scorer that picks whole blocks at that
budget; the gap to the key-bound scorer is what a better cheap score could still win.
"""

from __future__ import annotations

import torch

from etinfer.control.block_selection import EntropicSelector, PruningConfig
from etinfer.model.kv_cache import KVCache


class OracleSelector(EntropicSelector):
    def __init__(self, config: PruningConfig, cache: KVCache) -> None:
        super().__init__(config)
        self.cache = cache

    def block_scores(self, layer, query, blocks, summaries, bounds) -> torch.Tensor:
        """Each block's exact attention mass this step, the most any head of its group gives
        it: [seqs, kv_heads, max_blocks]."""
        seqs, heads, dim = query.shape
        tables, bs = blocks.block_tables, blocks.block_size
        kv_heads = self.cache.keys.shape[1]
        width = tables.shape[1]
        slots = (tables[:, :, None] * bs + torch.arange(bs, device=tables.device)).view(seqs, -1)
        keys = self.cache.read(layer, slots)[0]  # [kv_heads, seqs, width * bs, dim]
        q = query.view(seqs, kv_heads, heads // kv_heads, dim).transpose(0, 1)
        logits = torch.einsum("ksgd,kstd->ksgt", q, keys) * dim**-0.5
        inside = torch.arange(width * bs, device=tables.device) < blocks.context_lens[:, None]
        logits.masked_fill_(~inside[None, :, None, :], -torch.inf)
        mass = logits.softmax(-1).view(kv_heads, seqs, -1, width, bs).sum(-1)
        return mass.amax(2).transpose(0, 1)  # [seqs, kv_heads, width]

    def head_mass(self, logits, scores, blocks) -> torch.Tensor:
        """Per-head budgets from the exact masses too: the ceiling of that allocation."""
        return scores
