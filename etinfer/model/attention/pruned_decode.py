"""Decode pruning around a backend: each layer asks the step's :class:`AttentionSelector`
which blocks to read, hands the backend that mask, and reports what was read (pruning's
telemetry) and, for the mass scorer, the attention mass each block received. An engine whose
selector reads everything never builds one."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from etinfer.model import block_kernels
from etinfer.model.attention.backend import Attended, AttentionBackend, BackendDecorator
from etinfer.model.attention.metadata import AttentionMetadata
from etinfer.model.attention.pattern import DecodePattern
from etinfer.model.attention.pattern_decode import PatternDecode
from etinfer.model.attention.torch_backend import TorchBackend
from etinfer.model.block_layout import AttentionSelector, BlockSummaries, Selection
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
        if selector.selects_tokens and not isinstance(inner, PatternDecode):
            raise ValueError(
                "a selector of single tokens needs attention that reads a list of cache rows: "
                "the C or torch decode (attention_backend 'native' or 'torch')"
            )

    def select(
        self, layer: int, q: torch.Tensor | None, cache: KVCache, meta: AttentionMetadata
    ) -> tuple[Selection | None, BlockSummaries | None]:
        """The selector's answer for ``layer`` (None: every block) and the layer's summaries.
        A sliding layer of a model that mixes windows is sparse already: it reads its window,
        and only the layers that see the whole context are pruned."""
        summaries = cache.summaries(layer) if self.selector.needs_summaries else None
        if layer in self.options.local_layers:
            return None, summaries
        return self.selector.select(layer, q, meta.decode_blocks, summaries), summaries

    def decode(
        self,
        layer: int,
        q: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
        window: int | None,
        block_mask: torch.Tensor | None = None,
    ) -> Attended:
        selection, summaries = self.select(layer, q, cache, meta)
        observing = summaries is not None and summaries.mass is not None
        observing = observing and self.selector.observes(layer)
        backend = self.weighing if observing else self.inner
        if selection is not None and selection.tokens is not None:
            attended = self.inner.decode_over(layer, q, cache, selection.tokens, selection.mask)
        else:
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

    def segments(
        self, cache: KVCache, meta: AttentionMetadata, layers: range
    ) -> Iterator[tuple[range, DecodePattern | None]]:
        """``layers`` as runs that read the same blocks, each with the pattern of what its
        whole-context layers read (None: all of it), for a selector that answers without the
        layer's query (``selects_without_query``): the native decoder runs a run in one call.
        A run ends at a layer whose mass the selector observes, since the next answer may
        read it: the caller computes a run before asking for the next."""
        assert self.selector.selects_without_query and isinstance(self.inner, PatternDecode)
        local = self.options.local_layers
        start, current, decided = layers.start, None, False  # decided: a whole-context layer
        for layer in layers:
            if layer not in local:  # a sliding layer reads its window whatever the run reads
                selection, _ = self.select(layer, None, cache, meta)
                mask = None if selection is None else selection.mask
                if decided and mask is not current:
                    yield from self._run(range(start, layer), current, cache, meta)
                    start = layer
                current, decided = mask, True
            if self.selector.observes(layer) or layer + 1 == layers.stop:
                yield from self._run(range(start, layer + 1), current, cache, meta)
                start, current, decided = layer + 1, None, False

    def _run(
        self, layers: range, mask: torch.Tensor | None, cache: KVCache, meta: AttentionMetadata
    ) -> Iterator[tuple[range, DecodePattern | None]]:
        if mask is None:
            yield layers, None
            return
        window, local = self.options.sliding_window, self.options.local_layers
        visible, pattern = self.inner.masked_pattern(meta.decode_blocks, cache, mask, window)
        if meta.telemetry is not None:
            for layer in layers:
                if layer not in local:
                    meta.telemetry.record(PrunedLayer(layer, None, visible, None, None))
        yield layers, pattern


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
    if block_kernels.observe_block_mass(mass, pattern, weights, denominators, block_size, group):
        return
    probs = weights / denominators[pattern.row_ids] / group
    ids = torch.div(pattern.cols, block_size, rounding_mode="floor").long()  # head * blocks + block
    flat = mass.view(-1)
    flat.index_fill_(0, ids, 0.0)
    flat.index_add_(0, ids, probs)
