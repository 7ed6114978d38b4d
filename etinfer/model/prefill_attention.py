"""Prefill attention over the paged cache: the half of ``PagedAttention`` that takes chunks of
several query rows of one sequence.

Chunks go through ``scaled_dot_product_attention``, one sequence at a time: there the work is
quadratic in the chunk, and gathering the chunk's cached prefix once is cheap beside it. On CUDA
with a 16-bit cache, a chunk after a cached prefix goes through the GPU's prefill kernel
(``gpu/paged_prefill.py``) instead, which reads the prefix in place and multiplies on tensor
cores (see ``_kernel_reads_prefix``). A sliding layer's long chunk goes by blocks of queries,
each over the keys its window reaches; sparse prefill's pieces read the kept blocks per KV head
(``control/sparse_prefill.py``), on CUDA in the same kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from etinfer.model import gpu
from etinfer.model.block_layout import PrefillContext, PrefillPiece, PrefillSelector
from etinfer.model.gpu.paged_prefill import SIXTEEN_BIT, paged_prefill
from etinfer.model.kv_cache import KVCache
from etinfer.model.softcap import capped_attention


@dataclass
class PrefillChunk:
    start: int  # first row of the chunk in the step's flat batch
    length: int
    # Cache slots of positions [0, context) when the chunk follows a cached prefix, else None:
    # then the chunk's fresh keys and values are the whole context.
    context_slots: torch.Tensor | None
    mask: torch.Tensor | None  # [length, context] True where a query may attend
    # What a prefill selector needs to narrow the chunk's attention (None: dense); then
    # ``context_slots`` is always set.
    sparse: PrefillContext | None = None


class PrefillAttention:
    """Prefill's paths; ``PagedAttention`` holds the settings they read (scale, windows, the
    soft cap, the prefill selector) and dispatches a step's chunks to them."""

    scale: float
    softcap: float | None
    sliding_window: int | None
    local_window: int | None
    local_layers: frozenset[int]
    num_heads: int
    num_kv_heads: int
    prefill_selector: PrefillSelector | None

    def _prefill(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        chunk: PrefillChunk,
    ) -> torch.Tensor:
        window = self.local_window if layer in self.local_layers else self.sliding_window
        if chunk.context_slots is not None and self._kernel_reads_prefix(q.device, cache):
            return paged_prefill(
                q, cache.layer_keys[layer], cache.layer_values[layer], None, None,
                chunk.context_slots, self.scale, window, self.softcap,
            )  # fmt: skip
        if chunk.context_slots is None:  # the chunk's own keys, as the cache holds them
            k, v = cache.as_stored(k).transpose(0, 1), cache.as_stored(v).transpose(0, 1)
        else:
            k, v = cache.read(layer, chunk.context_slots)
        q, k, v = q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        if window is not None and chunk.length > window:
            return self._windowed(q, k, v, window)[0].transpose(0, 1)
        return self._dense(q, k, v, chunk.mask, chunk.mask is None)[0].transpose(0, 1)

    @staticmethod
    def _kernel_reads_prefix(device: torch.device, cache: KVCache) -> bool:
        """Whether a chunk whose context slots are listed (after a cached prefix, or sparse
        prefill's chunk left dense) goes through the GPU's prefill kernel, which reads the
        context in place, instead of SDPA over a gathered copy: with a 16-bit cache,
        whose dots run on tensor cores (on an H200, 0.40 ms a layer against SDPA's 2.2 for 2,048
        queries after 6,144 positions; BENCHMARKS.md, "The CUDA path on an H200, fifth
        session"). A float32 or int8 cache keeps SDPA: the kernel's IEEE float32 dots took 3.9."""
        return gpu.serves(device) and cache.dtype in SIXTEEN_BIT

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
        if self.softcap is not None:
            return capped_attention(q, k, v, mask, causal, self.scale, self.softcap)
        return grouped_attention(q, k, v, mask, causal, self.scale)

    def _sparse_prefill(
        self,
        layer: int,
        q: torch.Tensor,
        cache: KVCache,
        chunk: PrefillChunk,
        pieces: list[PrefillPiece],
    ) -> torch.Tensor:
        """Each piece of the chunk over its own keys: densely, or per KV head over the kept
        blocks and the local window (each head its own call: the kept sets differ in size, and
        padding them to one would compute the padding)."""
        out = torch.empty_like(q)
        group, block_size = self.num_heads // self.num_kv_heads, cache.block_size
        block = torch.arange(block_size, device=q.device)
        for piece in pieces:
            end = piece.end
            if piece.kept is None:
                out[piece.rows] = self._attend(
                    layer, q[piece.rows], None, end, cache, chunk, slice(None)
                )
                continue
            local = torch.arange(piece.local_start, end, device=q.device)
            for head, kept in enumerate(piece.kept):
                keys = torch.cat([(kept[:, None] * block_size + block).flatten(), local])
                heads = slice(head * group, (head + 1) * group)
                out[piece.rows, heads] = self._attend(
                    layer, q[piece.rows, heads], keys, end, cache, chunk, slice(head, head + 1)
                )
        return out

    def _attend(
        self,
        layer: int,
        q: torch.Tensor,  # [rows, heads, head_dim]
        key_pos: torch.Tensor | None,
        end: int,
        cache: KVCache,
        chunk: PrefillChunk,
        kv_heads: slice,
    ) -> torch.Tensor:
        """Attention of the queries at the positions before ``end`` over the keys at
        ``key_pos`` (None: every position before ``end``), causally: on CUDA in the prefill
        kernel, which reads them in place."""
        first = end - q.shape[0]
        if gpu.serves(q.device):
            scales = [None if s is None else s[kv_heads] for s in cache.layer_scales(layer)]
            return paged_prefill(
                q, cache.keys[layer, kv_heads], cache.values[layer, kv_heads], *scales,
                chunk.context_slots[:end], self.scale, self.sliding_window,
                key_positions=key_pos, first=first,
            )  # fmt: skip
        if key_pos is None:
            key_pos = torch.arange(end, device=q.device)
        query_pos = torch.arange(first, end, device=q.device)
        k, v = cache.read(layer, chunk.context_slots[key_pos], kv_heads)
        mask = key_pos[None, :] <= query_pos[:, None]
        if self.sliding_window is not None:
            mask &= key_pos[None, :] > query_pos[:, None] - self.sliding_window
        out = grouped_attention(
            q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mask, False, self.scale
        )
        return out[0].transpose(0, 1)


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


def prefill_mask(
    start: int, length: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor | None:
    """Visibility of keys [0, start + length) to the chunk's queries at positions start + i.

    None when plain causal masking over the chunk alone is exact (no prefix, no window).
    """
    context = start + length
    if start == 0 and (sliding_window is None or sliding_window >= length):
        return None
    query_pos = torch.arange(start, context, device=device)[:, None]
    key_pos = torch.arange(context, device=device)[None, :]
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    return mask
