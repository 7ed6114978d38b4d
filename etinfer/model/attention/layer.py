"""Attention over a paged KV cache (the layout is in ``kv_cache.py``), a layer at a time.

A step's rows are decode rows first (one query token per sequence, or with ``batch_invariant``
every row), then prefill chunks (several query tokens of one sequence). The layer writes the
step's keys and values into the cache and hands both kinds of rows to the engine's backend
(``backend.py``), chosen by name when the engine is built (``registry.py``). Where decode is
pruned or prefill sparse, the backend is wrapped by the layer that narrows it
(``pruned_decode.py``, ``sparse_prefill.py``); a dense engine runs it bare.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from etinfer.model.attention.backend import AttentionBackend
from etinfer.model.attention.metadata import AttentionMetadata
from etinfer.model.attention.native_backend import NativeBackend
from etinfer.model.attention.options import AttentionOptions
from etinfer.model.attention.pattern import DecodePattern
from etinfer.model.attention.pruned_decode import PrunedDecode
from etinfer.model.attention.registry import create_backend
from etinfer.model.attention.sparse_prefill import SparsePrefill
from etinfer.model.block_layout import AttentionSelector, PrefillSelector
from etinfer.model.kv_cache import KVCache


class PagedAttention:
    def __init__(
        self,
        *,
        options: AttentionOptions,
        device: torch.device,
        selector: AttentionSelector,
        prefill_selector: PrefillSelector | None = None,
    ) -> None:
        """``options.backend`` is resolved for ``device`` (``registry.create_backend``);
        ``selector`` picks the blocks decode rows read (one that reads everything is never
        asked), ``prefill_selector`` the pieces of sparse prefill (None: prefill is dense)."""
        self.options = options
        # The backend as chosen, which the step's metadata is built for.
        self.backend: AttentionBackend = create_backend(options, device)
        self.prefill_selector = prefill_selector
        self.set_selector(selector)

    def set_selector(self, selector: AttentionSelector) -> None:
        """Decode rows ask ``selector`` from the next call on."""
        self.selector = selector
        # The backend with the selectors in force wrapped around it: what the layer calls.
        selecting = self.backend
        self.pruned: PrunedDecode | None = None
        if not selector.reads_everything:
            selecting = self.pruned = PrunedDecode(selecting, selector)
        if self.prefill_selector is not None:
            selecting = SparsePrefill(selecting, self.prefill_selector)
        self.selecting = selecting

    @property
    def reads_natively(self) -> bool:
        """Decode rows read through the C kernel (narrowed by a selector on some steps)."""
        return isinstance(self.backend, NativeBackend)

    def decodes_natively(self, meta: AttentionMetadata) -> bool:
        """Whether this step's decode rows attend as the native decoder computes them
        (``native_decoder.py``): the C kernel over the step's dense patterns (the sliding
        layers' own too); for a selector that answers without a layer's query, over the
        blocks it keeps for each run of layers (``segments``); for one of single tokens, over
        those the C chooses at each layer as the selector would (``TokenChoice``); nothing
        captured, no prefill rows."""
        views = [meta] if not self.options.local_layers else [meta, meta.local]
        selector = self.selector
        chooses = (
            selector.reads_all_of(meta.decode_blocks)
            or selector.selects_without_query
            or selector.token_choice is not None
        )
        return (
            self.reads_natively
            and chooses
            and not meta.prefills
            and all(view is not None and view.dense_pattern is not None for view in views)
            and meta.capture_rows is None
        )

    def segments(
        self, cache: KVCache, meta: AttentionMetadata, layers: range
    ) -> Iterator[tuple[range, DecodePattern | None]]:
        """A native decode step's ``layers`` as runs that read the same blocks, each with the
        pattern its whole-context layers read (None: the step's dense one); compute each run
        before asking for the next, which may read the masses it observed. Single tokens are
        chosen inside the one call, at each layer."""
        selector = self.selector
        if (
            self.pruned is None
            or selector.reads_all_of(meta.decode_blocks)
            or selector.token_choice is not None
        ):
            yield layers, None
        else:
            yield from self.pruned.segments(cache, meta, layers)

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,  # [rows, num_heads, head_dim]
        k: torch.Tensor,  # [rows, num_kv_heads, head_dim]
        v: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if q.dtype != cache.compute_dtype:  # a call per tensor even when a no-op: 30 layers add up
            dtype = cache.compute_dtype
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if meta.capture_rows is not None:
            meta.captured[layer] = q[meta.capture_rows]
        cache.write(layer, meta.slot_mapping, meta.fresh_blocks, k, v)
        window, backend = self.options.window(layer), self.selecting
        if layer in self.options.local_layers:
            meta = meta.local
        if not meta.prefills:
            return backend.decode(layer, q, cache, meta, window).out.flatten(1)
        out = torch.empty_like(q)
        if meta.num_decode:
            decode = slice(meta.num_decode)
            out[decode] = backend.decode(layer, q[decode], cache, meta, window).out
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.start + chunk.length)
            out[rows] = backend.prefill(layer, q[rows], k[rows], v[rows], cache, chunk, window)
        return out.flatten(1)
