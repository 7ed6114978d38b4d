"""Decode pruning around a backend: each layer asks the step's :class:`AttentionSelector`
which blocks to read, hands the backend that mask, and reports what was read (pruning's
telemetry) and, for the mass scorer, the attention mass each block received. An engine whose
selector reads everything never builds one."""

from __future__ import annotations

import torch

from etinfer.model.attention.backend import Attended, AttentionBackend, BackendDecorator
from etinfer.model.attention.metadata import AttentionMetadata
from etinfer.model.attention.pattern import DecodePattern
from etinfer.model.attention.torch_backend import TorchBackend
from etinfer.model.block_layout import AttentionSelector
from etinfer.model.kv_cache import KVCache
from etinfer.model.pruning_telemetry import PrunedLayer


class PrunedDecode(BackendDecorator):
    def __init__(self, inner: AttentionBackend, selector: AttentionSelector) -> None:
        super().__init__(inner)
        self.selector = selector
        # The mass scorer needs every entry's weight, which the GPU kernel does not give: its
        # layers then decode through the torch form.
        self.weighing = inner
        if selector.observes_mass and not inner.reports_weights:
            self.weighing = TorchBackend(inner.options)

    def decode(
        self,
        layer: int,
        q: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
        window: int | None,
        block_mask: torch.Tensor | None = None,
    ) -> Attended:
        selector = self.selector
        summaries = cache.summaries(layer) if selector.needs_summaries else None
        # A sliding layer of a model that mixes windows is sparse already: it reads its window,
        # and only the layers that see the whole context are pruned.
        selection = None
        if layer not in self.options.local_layers:
            selection = selector.select(layer, q, meta.decode_blocks, summaries)
        observing = summaries is not None and summaries.mass is not None
        observing = observing and selector.observes(layer)
        backend = self.weighing if observing else self.inner
        mask = None if selection is None else selection.mask
        attended = backend.decode(layer, q, cache, meta, window, mask)
        if meta.telemetry is not None and selection is not None:
            meta.telemetry.record(
                PrunedLayer(
                    layer,
                    selection.bounds,
                    attended.visible,
                    attended.row_max,
                    attended.denominators,
                )
            )
        if observing:
            observe_mass(
                summaries.mass,
                attended.pattern,
                attended.weights,
                attended.denominators,
                cache.block_size,
                self.options.group,
            )
        return attended


def observe_mass(
    mass: torch.Tensor,
    pattern: DecodePattern,
    weights: torch.Tensor,
    denominators: torch.Tensor,
    block_size: int,
    group: int,
) -> None:
    """Record each attended block's attention mass in ``mass`` [kv_heads, blocks], averaged
    over the ``group`` query heads that share its KV head (what the mass scorer ranks by, until
    the block is read again)."""
    probs = weights / denominators[pattern.row_ids] / group
    ids = torch.div(pattern.cols, block_size, rounding_mode="floor").long()  # head * blocks + block
    flat = mass.view(-1)
    flat.index_fill_(0, ids, 0.0)
    flat.index_add_(0, ids, probs)
