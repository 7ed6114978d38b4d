"""What an attention implementation offers the paged-attention layer (``layer.py``), and the
base of the backends that wrap another one.

A backend computes attention over the paged cache (``kv_cache.py``) in four calls:

- ``decode_metadata``: what its decode rows need built once a step, before any layer runs
  (the blocks each row sees and their CSR pattern for the C and torch forms; nothing for the
  Triton kernel, which reads the block tables itself);
- ``decode``: one query row per decode token, over its sequence's blocks, all of them or those
  a mask keeps;
- ``prefill``: a chunk of several query rows of one sequence, causally over its context;
- ``prefill_positions``: queries of a chunk over listed positions of its context (the pieces
  sparse prefill cuts a chunk into).

Implementations are registered by name (``registry.py``); an engine's is chosen once, when it
is built. The layers that choose which blocks attention reads (decode pruning, sparse prefill)
are backends too, each wrapping the one chosen (``BackendDecorator``): an engine without them
runs the chosen backend bare.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

from etinfer.model.attention.metadata import AttentionMetadata, PrefillChunk
from etinfer.model.attention.options import AttentionOptions
from etinfer.model.attention.pattern import DecodePattern
from etinfer.model.block_layout import DecodeBlocks
from etinfer.model.kv_cache import KVCache


class Attended(NamedTuple):
    """Decode attention's output and what pruning's telemetry and the mass scorer read of it."""

    out: torch.Tensor  # [rows, num_heads, head_dim]
    row_max: torch.Tensor  # per query row (row * num_heads + head): its largest score
    denominators: torch.Tensor  # per query row: its softmax denominator
    # [seqs, kv_heads, blocks] the blocks read, where a mask narrowed them (else None)
    visible: torch.Tensor | None = None
    # The entries read and their unnormalised weights, where the backend ran on a pattern.
    pattern: DecodePattern | None = None
    weights: torch.Tensor | None = None


class AttentionBackend(ABC):
    """Decode and prefill attention over the paged cache, for the layers ``options`` describes."""

    # Decode rows need no per-step pattern: the kernel reads the block tables (then a plain
    # decode step's launches are fixed, and it can be replayed as a CUDA graph).
    reads_block_tables = False
    # Decode returns each pattern entry's weight (what the mass scorer observes).
    reports_weights = False

    def __init__(self, options: AttentionOptions) -> None:
        self.options = options

    def refusal(self, device: torch.device) -> str | None:
        """Why this backend cannot run on ``device`` for these layers; None where it can."""
        return None

    @abstractmethod
    def decode_metadata(
        self, blocks: DecodeBlocks, num_slots: int, window: int | None
    ) -> tuple[torch.Tensor | None, DecodePattern | None]:
        """For a step's decode rows (``blocks``) seeing the last ``window`` positions (None: all):
        the blocks each (row, KV head) sees and the rows' pattern over the cache's
        ``num_slots`` slots, or (None, None) where decode needs neither."""
        ...

    @abstractmethod
    def decode(
        self,
        layer: int,
        q: torch.Tensor,  # [rows, num_heads, head_dim] float32
        cache: KVCache,
        meta: AttentionMetadata,
        window: int | None,
        block_mask: torch.Tensor | None = None,
    ) -> Attended:
        """Decode rows over their context (its last ``window`` positions), restricted to the
        blocks of ``block_mask`` [seqs, kv_heads, blocks] when given: the block holding the
        current token is read whatever the mask says, so no row is empty."""
        ...

    @abstractmethod
    def prefill(
        self,
        layer: int,
        q: torch.Tensor,  # [chunk, num_heads, head_dim] float32
        k: torch.Tensor,  # [chunk, num_kv_heads, head_dim] the chunk's own, as computed
        v: torch.Tensor,
        cache: KVCache,
        chunk: PrefillChunk,
        window: int | None,
    ) -> torch.Tensor:
        """A chunk's rows over its context, causally: [chunk, num_heads, head_dim]."""
        ...

    @abstractmethod
    def prefill_positions(
        self,
        layer: int,
        q: torch.Tensor,  # [rows, heads, head_dim]: some of a chunk's queries and heads
        cache: KVCache,
        chunk: PrefillChunk,
        key_positions: torch.Tensor | None,
        end: int,
        kv_heads: slice,
        window: int | None,
    ) -> torch.Tensor:
        """The queries at the positions before ``end`` over the keys of ``kv_heads`` at
        ``key_positions`` (None: every position before ``end``), causally."""
        ...


class BackendDecorator(AttentionBackend):
    """A backend wrapping ``inner``: each call goes to it unless the wrapper changes that call."""

    def __init__(self, inner: AttentionBackend) -> None:
        super().__init__(inner.options)
        self.inner = inner
        self.reads_block_tables = inner.reads_block_tables
        self.reports_weights = inner.reports_weights

    def refusal(self, device: torch.device) -> str | None:
        return self.inner.refusal(device)

    def decode_metadata(
        self, blocks: DecodeBlocks, num_slots: int, window: int | None
    ) -> tuple[torch.Tensor | None, DecodePattern | None]:
        return self.inner.decode_metadata(blocks, num_slots, window)

    def decode(
        self,
        layer: int,
        q: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
        window: int | None,
        block_mask: torch.Tensor | None = None,
    ) -> Attended:
        return self.inner.decode(layer, q, cache, meta, window, block_mask)

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
        return self.inner.prefill(layer, q, k, v, cache, chunk, window)

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
        return self.inner.prefill_positions(
            layer, q, cache, chunk, key_positions, end, kv_heads, window
        )
