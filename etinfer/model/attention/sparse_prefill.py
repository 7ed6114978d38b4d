"""Sparse prefill around a backend: each layer asks the :class:`PrefillSelector` how to cut a
chunk into pieces and which blocks each piece reads per KV head
(``control/sparse_prefill.py``), and runs the pieces through the backend's
``prefill_positions``. Built only where sparse prefill is on."""

from __future__ import annotations

import torch

from etinfer.model.attention.backend import AttentionBackend, BackendDecorator
from etinfer.model.attention.metadata import PrefillChunk
from etinfer.model.block_layout import PrefillPiece, PrefillSelector
from etinfer.model.kv_cache import KVCache


class SparsePrefill(BackendDecorator):
    def __init__(self, inner: AttentionBackend, selector: PrefillSelector) -> None:
        super().__init__(inner)
        self.selector = selector

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
        pieces = None
        # The sliding layers of a model that mixes windows read their window densely.
        if chunk.sparse is not None and layer not in self.options.local_layers:
            pieces = self.selector.select_prefill(layer, q, chunk.sparse, cache.summaries(layer))
        if pieces is None:
            return self.inner.prefill(layer, q, k, v, cache, chunk, window)
        return self.pieces(layer, q, cache, chunk, pieces, window)

    def pieces(
        self,
        layer: int,
        q: torch.Tensor,
        cache: KVCache,
        chunk: PrefillChunk,
        pieces: list[PrefillPiece],
        window: int | None,
    ) -> torch.Tensor:
        """Each piece of the chunk over its own keys: densely, or per KV head over the kept
        blocks and the local window (each head its own call: the kept sets differ in size, and
        padding them to one would compute the padding)."""
        out = torch.empty_like(q)
        group, block_size = self.options.group, cache.block_size
        block = torch.arange(block_size, device=q.device)
        attend = self.inner.prefill_positions
        for piece in pieces:
            end = piece.end
            if piece.kept is None:
                out[piece.rows] = attend(
                    layer, q[piece.rows], cache, chunk, None, end, slice(None), window
                )
                continue
            local = torch.arange(piece.local_start, end, device=q.device)
            for head, kept in enumerate(piece.kept):
                keys = torch.cat([(kept[:, None] * block_size + block).flatten(), local])
                heads = slice(head * group, (head + 1) * group)
                out[piece.rows, heads] = attend(
                    layer, q[piece.rows, heads], cache, chunk, keys, end, slice(head, head + 1),
                    window,
                )  # fmt: skip
        return out
