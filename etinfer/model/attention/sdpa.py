"""Prefill through ``scaled_dot_product_attention``, one sequence's chunk at a time: the prefill
of the C and torch backends, and of the Triton backend where its kernel does not serve.

There the work is quadratic in the chunk, and gathering the chunk's cached prefix once is cheap
beside it. A sliding layer's long chunk goes by blocks of queries, each over the keys its window
reaches; sparse prefill's pieces read the kept positions per KV head, gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from etinfer.model.attention.backend import AttentionBackend
from etinfer.model.attention.metadata import PrefillChunk
from etinfer.model.kv_cache import KVCache
from etinfer.model.softcap import capped_attention


class SdpaPrefill(AttentionBackend):
    """A backend whose prefill is SDPA over the chunk's context, gathered from the cache; its
    decode is the subclass's."""

    def prefill(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        chunk: PrefillChunk,
        window: int | None,
    ) -> torch.Tensor:
        if chunk.context_slots is None:  # the chunk's own keys, as the cache holds them
            k, v = cache.as_stored(k).transpose(0, 1), cache.as_stored(v).transpose(0, 1)
        else:
            k, v = cache.read(layer, chunk.context_slots)
        q, k, v = q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        if window is not None and chunk.length > window:
            return self._windowed(q, k, v, window)[0].transpose(0, 1)
        return self._dense(q, k, v, chunk.mask, chunk.mask is None)[0].transpose(0, 1)

    def prefill_positions(
        self,
        layer: int,
        q: torch.Tensor,
        cache: KVCache,
        chunk: PrefillChunk,
        key_positions: torch.Tensor | None,
        end: int,
        kv_heads: slice,
        window: int | None,
    ) -> torch.Tensor:
        first = end - q.shape[0]
        if key_positions is None:
            key_positions = torch.arange(end, device=q.device)
        query_pos = torch.arange(first, end, device=q.device)
        k, v = cache.read(layer, chunk.context_slots[key_positions], kv_heads)
        mask = key_positions[None, :] <= query_pos[:, None]
        if window is not None:
            mask &= key_positions[None, :] > query_pos[:, None] - window
        scale = self.options.scale
        q, k, v = q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        return grouped_attention(q, k, v, mask, False, scale)[0].transpose(0, 1)

    def _windowed(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int
    ) -> torch.Tensor:
        """A sliding layer's chunk (its queries the context's last) by blocks of queries, each
        over the keys its window reaches: one mask over the whole context would compute every
        pair and throw most away (Gemma 3's 2K prefill spent a third of its time so)."""
        queries, context = q.shape[2], k.shape[2]
        first, block = context - queries, max(64, window // 2)
        out = torch.empty_like(q)
        for lo in range(0, queries, block):
            hi = min(lo + block, queries)
            keys = range(max(0, first + lo - window + 1), first + hi)
            query_pos = torch.arange(first + lo, first + hi, device=q.device)[:, None]
            key_pos = torch.arange(keys.start, keys.stop, device=q.device)[None, :]
            mask = (key_pos <= query_pos) & (key_pos > query_pos - window)
            span = slice(keys.start, keys.stop)
            rows = q[:, :, lo:hi]
            out[:, :, lo:hi] = self._dense(rows, k[:, :, span], v[:, :, span], mask, False)
        return out

    def _dense(
        self,
        q: torch.Tensor,  # [1, heads, queries, dim]
        k: torch.Tensor,  # [1, kv_heads, keys, dim]
        v: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        options = self.options
        if options.softcap is not None:
            return capped_attention(q, k, v, mask, causal, options.scale, options.softcap)
        return grouped_attention(q, k, v, mask, causal, options.scale)


def grouped_attention(
    q: torch.Tensor,  # [1, heads, queries, dim]
    k: torch.Tensor,  # [1, kv_heads, keys, dim]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # [queries, keys] True where a query may attend
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """SDPA over grouped query heads. On CUDA a mask with grouped heads sends torch to its math
    kernel, which materialises every score (flash attention takes no mask, the memory-efficient
    kernel no grouped heads): there the keys and values are widened to the query heads first,
    so that the memory-efficient kernel serves a chunk that follows a cached prefix."""
    grouped = k.shape[1] != q.shape[1]
    if grouped and mask is not None and q.device.type == "cuda":
        group = q.shape[1] // k.shape[1]
        k, v, grouped = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), False
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=grouped
    )
