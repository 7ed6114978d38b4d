"""Rankings that read the keys themselves, to measure what a block scorer could reach.

``OracleSelector`` is the best any block scorer could do: blocks ranked by the attention mass
they carry this step. Finding each block's exact mass costs a full dense attention over the
context (more than attending to every block), so it is a measurement tool, not a serving path.
It keeps exactly the blocks, and as many, as the entropic selector would (the same budgets, sink
and recent blocks first), ranking the rest by ``max over the group's heads of sum_{i in b}
softmax(q.k)_i``. Fidelity at a budget under this oracle is the ceiling for every scorer that
picks whole blocks at that budget.

With ``channels`` it is a token-level sketch instead (after SparQ): each query head's
``channels`` largest query components, against the same components of every key, give
approximate scores (the softmax's temperature corrected by the share of the query's L1 norm they
carry), aggregated per block as above. It reads ``channels / head_dim`` of the keys, a fraction
``channels / (2 * head_dim)`` of the KV bytes more in every pruned layer: whether that is worth
reading is what it measures (in torch here: its time is not a kernel's). With ``fixed`` the
channels are chosen once per layer and KV head instead, those where the first sequence's keys
are largest on average (after Double Sparsity's offline "label" channels): what a cache could
keep as a compact copy of every key, written as the keys are.
"""

from __future__ import annotations

import torch

from etinfer.control.block_selection import EntropicSelector, PruningConfig
from etinfer.model.block_layout import DecodeBlocks
from etinfer.model.kv_cache import KVCache


def block_keys(
    cache: KVCache, layer: int, blocks: DecodeBlocks
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every slot of each row's blocks in ``layer``: the keys [kv_heads, seqs, width * block
    size, head_dim] and which of them are in the row's context [seqs, width * block size]."""
    tables, size = blocks.block_tables, blocks.block_size
    offsets = torch.arange(size, device=tables.device)
    slots = (tables[:, :, None] * size + offsets).view(tables.shape[0], -1)
    inside = torch.arange(slots.shape[1], device=tables.device) < blocks.context_lens[:, None]
    return cache.read(layer, slots)[0], inside


class OracleSelector(EntropicSelector):
    def __init__(
        self,
        config: PruningConfig,
        cache: KVCache,
        channels: int | None = None,
        fixed: bool = False,
        full_layers: list[int] | None = None,
    ) -> None:
        super().__init__(config, full_layers=full_layers)
        self.cache = cache
        self.channels = channels
        self.fixed = fixed
        self.chosen: dict[int, torch.Tensor] = {}  # with ``fixed``: [kv_heads, channels] a layer

    def block_scores(self, layer, query, blocks, summaries, bounds) -> torch.Tensor:
        """Each block's attention mass this step (exact, or by the sketch), the most any head
        of its group gives it: [seqs, kv_heads, max_blocks]."""
        keys, inside = block_keys(self.cache, layer, blocks)
        kv_heads, seqs, _, dim = keys.shape
        q = query.view(seqs, kv_heads, -1, dim).transpose(0, 1)
        logits = self.logits(layer, q, keys, blocks)
        logits.masked_fill_(~inside[None, :, None, :], -torch.inf)
        width = blocks.block_tables.shape[1]
        mass = logits.softmax(-1).view(kv_heads, seqs, -1, width, blocks.block_size).sum(-1)
        return mass.amax(2).transpose(0, 1)  # [seqs, kv_heads, width]

    @property
    def sketch_share(self) -> float:
        """The share of the KV bytes of every key in context it reads in each pruned layer,
        besides the blocks it keeps (a 16-bit cache)."""
        return 0.0 if self.channels is None else self.channels / (2 * self.cache.keys.shape[-1])

    def logits(self, layer: int, q: torch.Tensor, keys: torch.Tensor, blocks) -> torch.Tensor:
        """``q`` [kv_heads, seqs, group, dim] against ``keys`` [kv_heads, seqs, tokens, dim]:
        exact, or by the sketch. [kv_heads, seqs, group, tokens]."""
        if self.channels is None:
            return torch.einsum("ksgd,kstd->ksgt", q, keys) * keys.shape[-1] ** -0.5
        return self.sketched_logits(q, keys, self.fixed_channels(layer, keys, blocks))

    def fixed_channels(self, layer: int, keys: torch.Tensor, blocks) -> torch.Tensor | None:
        """With ``fixed``, the layer's channels [kv_heads, channels], chosen at its first step
        from the first sequence's keys in context; None otherwise."""
        if not self.fixed:
            return None
        if layer not in self.chosen:
            seen = keys[:, 0, : int(blocks.context_lens[0])]  # [kv_heads, tokens, dim]
            self.chosen[layer] = seen.abs().mean(1).topk(self.channels, dim=-1).indices
        return self.chosen[layer]

    def sketched_logits(
        self, q: torch.Tensor, keys: torch.Tensor, fixed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``q`` [kv_heads, seqs, group, dim] against ``keys`` [kv_heads, seqs, tokens, dim] on
        each query's largest components only (or the ``fixed`` ones, [kv_heads, channels]):
        [kv_heads, seqs, group, tokens]."""
        dim = q.shape[-1]
        if fixed is None:
            top = q.abs().topk(self.channels, dim=-1).indices  # [kv, seqs, group, channels]
        else:
            top = fixed[:, None, None].expand(-1, *q.shape[1:3], -1)
        picked = q.gather(-1, top)
        tokens = keys.shape[2]
        expanded = keys[:, :, None].expand(-1, -1, q.shape[2], -1, -1)
        index = top[:, :, :, None, :].expand(-1, -1, -1, tokens, -1)
        sketch = expanded.gather(-1, index)  # [kv, seqs, group, tokens, channels]
        share = picked.abs().sum(-1, keepdim=True) / q.abs().sum(-1, keepdim=True).clamp(min=1e-9)
        scores = torch.einsum("ksgc,ksgtc->ksgt", picked, sketch)
        return scores / (dim * share).sqrt()

    def head_mass(self, logits, scores, blocks) -> torch.Tensor:
        """Per-head budgets from the same masses too: the ceiling of that allocation."""
        return scores
