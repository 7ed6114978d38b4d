"""Decode over the CSR pattern of the blocks each row reads (``pattern.py``), in place in the
cache, with no per-step copy of the blocks: what the C and torch backends share. Sequences of
any lengths share one call per layer, and grouped-query heads read their KV head without
repeating it. Their prefill is SDPA's (``sdpa.py``)."""

from __future__ import annotations

from abc import abstractmethod

import torch

from etinfer.model.attention.backend import Attended
from etinfer.model.attention.metadata import AttentionMetadata
from etinfer.model.attention.pattern import DecodePattern, decode_pattern
from etinfer.model.attention.sdpa import SdpaPrefill
from etinfer.model.block_layout import DecodeBlocks
from etinfer.model.kv_cache import KVCache


class PatternDecode(SdpaPrefill):
    reports_weights = True

    def decode_metadata(
        self, blocks: DecodeBlocks, num_slots: int, window: int | None
    ) -> tuple[torch.Tensor | None, DecodePattern | None]:
        options = self.options
        return decode_pattern(
            blocks, options.num_kv_heads, options.group, num_slots, sliding_window=window
        )

    def decode(
        self,
        layer: int,
        q: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
        window: int | None,
        block_mask: torch.Tensor | None = None,
    ) -> Attended:
        pattern, visible = meta.dense_pattern, None
        if block_mask is not None or pattern is None:  # None: the step built none
            visible, pattern = self.masked_pattern(meta.decode_blocks, cache, block_mask, window)
        return self.decode_over(layer, q, cache, pattern, visible)

    def decode_over(
        self,
        layer: int,
        q: torch.Tensor,
        cache: KVCache,
        pattern: DecodePattern,
        visible: torch.Tensor | None,
    ) -> Attended:
        """Decode rows over exactly the cache rows of ``pattern`` (what ``visible`` says was
        read, for pruning's telemetry)."""
        options = self.options
        rows = q.shape[0] * options.num_heads
        attended = self.attend(layer, q.reshape(rows, options.head_dim), cache, pattern)
        out, row_max, denominators, weights = attended
        out = out.view(-1, options.num_heads, options.head_dim)
        return Attended(out, row_max, denominators, visible, pattern, weights)

    def masked_pattern(
        self,
        blocks: DecodeBlocks,
        cache: KVCache,
        block_mask: torch.Tensor | None,
        window: int | None,
    ) -> tuple[torch.Tensor, DecodePattern]:
        """The pattern of ``block_mask``: built once for consecutive layers handed the same mask
        (a selector that reuses one layer's choice), as the mask object is kept for the step."""
        key = ("pattern", window)
        last = blocks.derived.get(key)
        if block_mask is not None and last is not None and last[0] is block_mask:
            return last[1], last[2]
        options = self.options
        visible, pattern = decode_pattern(
            blocks, options.num_kv_heads, options.group, cache.num_slots, block_mask, window
        )
        if block_mask is not None:
            blocks.derived[key] = (block_mask, visible, pattern)
        return visible, pattern

    @abstractmethod
    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # [rows * num_heads, head_dim]
        cache: KVCache,
        pattern: DecodePattern,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Softmax attention of each query row over its pattern's cache rows: the output, and
        per row its largest score and softmax denominator, and the entries' unnormalised
        weights."""
        ...
