"""Attention over a paged KV cache (the layout is in ``kv_cache.py``).

**Decode** (one query token per sequence) reads the cache in place, with no per-step copy of the
blocks, through the CSR pattern of ``decode_pattern.py``, in one call of the native kernel
(``native_kernels.py``: scores, softmax and the weighted sum of values, each row alone). Without
it the same runs as torch operations: the scores by ``torch.sparse.sampled_addmm`` on exactly the
pattern's pairs, the softmax on the flat score vector, the values by ``embedding_bag`` with
per-entry weights. Sequences of any lengths share one call per layer, and grouped-query heads
read their KV head without repeating it. Each layer asks the step's :class:`AttentionSelector`
which blocks to read. With ``batch_invariant`` prefill rows come here too (``model_runner.py``).

**Decode on CUDA** goes through the GPU kernel that reads the block tables (``gpu/``).
**Prefill chunks** (several query tokens of one sequence) take ``prefill_attention.py``'s paths.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch

from etinfer.model import gpu, native_kernels
from etinfer.model.block_layout import (
    AttentionSelector,
    DecodeBlocks,
    PrefillSelector,
    Selection,
)
from etinfer.model.decode_pattern import (
    DecodePattern,
    decode_pattern,
    observe_mass,
    pattern_attention,
    visible_blocks,
)
from etinfer.model.gpu import paged_decode as gpu_decode
from etinfer.model.kv_cache import KVCache
from etinfer.model.prefill_attention import PrefillAttention, PrefillChunk
from etinfer.model.pruning_telemetry import PrunedLayer, PruningTelemetry

# The CSR kernels are stable in the pinned torch; the notice would only confuse.
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")


@dataclass
class AttentionMetadata:
    """What every layer needs to know about this step's batch; built once per step."""

    slot_mapping: torch.Tensor  # [rows] cache slot each new token's key and value go to
    num_decode: int  # decode rows come first in the batch
    decode_blocks: DecodeBlocks | None
    dense_pattern: DecodePattern | None
    prefills: list[PrefillChunk]
    fresh_blocks: torch.Tensor | None = None  # blocks receiving their first token this step
    telemetry: PruningTelemetry | None = None
    # KV compression: rows whose queries every layer copies out into ``captured[layer]``.
    capture_rows: torch.Tensor | None = None
    captured: torch.Tensor | None = None
    # Where some layers slide and others do not (Gemma 3): the step as the sliding layers see
    # it, the same batch with the window's decode pattern and prefill masks.
    local: AttentionMetadata | None = None


class PagedAttention(PrefillAttention):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        selector: AttentionSelector,
        sliding_window: int | None = None,
        prefill_selector: PrefillSelector | None = None,
        scale: float | None = None,
        local_layers: frozenset[int] = frozenset(),
        local_window: int | None = None,
        batch_invariant: bool = False,
        softcap: float | None = None,
    ) -> None:
        """``sliding_window``: every layer's; ``local_layers``: the layers that read the step's
        ``local`` view instead (a model whose layers differ in their window), whose window is
        ``local_window``. ``batch_invariant``: a decode row's result may not depend on the
        other rows (the GPU kernel then never splits a row's context). ``softcap``: scores
        become ``softcap * tanh(s / softcap)`` (Gemma 2), on the torch forms and the GPU kernel
        (the CPU's native kernel computes plain scores)."""
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale or head_dim**-0.5
        self.selector = selector
        self.sliding_window = sliding_window
        self.prefill_selector = prefill_selector
        self.local_layers = local_layers
        self.local_window = local_window
        self.batch_invariant = batch_invariant
        self.softcap = softcap
        # Decode attention in one native call where the kernel takes these shapes (and runs on
        # the CPU, checked per call); else as torch operations.
        self.native = native_kernels.available() and native_kernels.takes(
            head_dim, num_heads // num_kv_heads
        )
        self.native = self.native and softcap is None  # the kernel computes plain scores

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
        if layer in self.local_layers:
            meta = meta.local
        if not meta.prefills:
            return self._decode(layer, q, cache, meta).flatten(1)
        out = torch.empty_like(q)
        if meta.num_decode:
            out[: meta.num_decode] = self._decode(layer, q[: meta.num_decode], cache, meta)
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.start + chunk.length)
            pieces = None
            if chunk.sparse is not None and layer not in self.local_layers:
                pieces = self.prefill_selector.select_prefill(
                    layer, q[rows], chunk.sparse, cache.summaries(layer)
                )
            if pieces is None:
                out[rows] = self._prefill(layer, q[rows], k[rows], v[rows], cache, chunk)
            else:
                out[rows] = self._sparse_prefill(layer, q[rows], cache, chunk, pieces)
        return out.flatten(1)

    def kernel_serves(self, device: torch.device) -> bool:
        """Whether decode rows on ``device`` go through the GPU kernel, which reads the block
        tables itself."""
        return gpu.serves(device)

    def _decode(
        self, layer: int, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        blocks, group = meta.decode_blocks, self.num_heads // self.num_kv_heads
        summaries = cache.summaries(layer) if self.selector.needs_summaries else None
        # A sliding layer of a model that mixes windows is sparse already: it reads its window,
        # and only the layers that see the whole context are pruned.
        selection = None
        if layer not in self.local_layers:
            selection = self.selector.select(layer, q, blocks, summaries)
        observing = summaries is not None and summaries.mass is not None
        observing = observing and self.selector.observes_mass
        if self.kernel_serves(q.device) and not observing:  # the mass scorer needs every weight
            return self._decode_gpu(layer, q, cache, meta, selection)
        pattern, visible = meta.dense_pattern, None
        if selection is not None or pattern is None:  # None: the step left it to the kernel
            visible, pattern = decode_pattern(
                blocks,
                self.num_kv_heads,
                group,
                cache.num_slots,
                None if selection is None else selection.mask,
                self.local_window if layer in self.local_layers else self.sliding_window,
            )
        rows = q.shape[0] * self.num_heads
        q = q.reshape(rows, self.head_dim)
        keys = cache.key_rows[layer]  # row kv_head * num_slots + slot
        values = cache.value_rows[layer]
        if self.native and q.device.type == "cpu":
            out, row_max, denominators, weights = native_kernels.decode_attention(
                q,
                keys,
                values,
                pattern.crow,
                pattern.cols,
                pattern.outside,
                group,
                self.scale,
                *cache.scales(layer),
            )
        elif cache.dtype == cache.compute_dtype:
            attended = pattern_attention(q, keys, values, pattern, self.scale, self.softcap)
            out, row_max, denominators, weights = attended
        else:
            # The pattern's rows widened once, in entry order (the CPU's sparse kernels take no
            # half or int8 types); the entries then read those rows one to one.
            keys, values = cache.read_rows(layer, pattern.cols)
            cols = torch.arange(pattern.nnz, dtype=pattern.cols.dtype, device=q.device)
            gathered = dataclasses.replace(pattern, cols=cols)
            attended = pattern_attention(q, keys, values, gathered, self.scale, self.softcap)
            out, row_max, denominators, weights = attended
        if meta.telemetry is not None and selection is not None:
            meta.telemetry.record(
                PrunedLayer(layer, selection.bounds, visible, row_max, denominators)
            )
        if observing:
            group = self.num_heads // self.num_kv_heads
            observe_mass(summaries.mass, pattern, weights, denominators, cache.block_size, group)
        return out.view(-1, self.num_heads, self.head_dim)

    def _decode_gpu(
        self,
        layer: int,
        q: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
        selection: Selection | None,
    ) -> torch.Tensor:
        """Decode rows through the GPU kernel: no pattern is built, the kernel reads the block
        tables, and a selection's blocks (the current one always among them) are its mask."""
        blocks = meta.decode_blocks
        local = layer in self.local_layers
        window = self.local_window if local else self.sliding_window
        visible = None
        if selection is not None:
            visible = visible_blocks(blocks, self.num_kv_heads, selection.mask, window)
        out, row_max, denominators = gpu_decode.paged_decode(
            q,
            cache.layer_keys[layer],
            cache.layer_values[layer],
            *cache.layer_scales(layer),
            blocks.block_tables,
            blocks.context_lens,
            cache.block_size,
            self.scale,
            window,
            visible,
            splits=1 if self.batch_invariant else None,
            softcap=self.softcap,
        )
        if meta.telemetry is not None and selection is not None:
            meta.telemetry.record(
                PrunedLayer(
                    layer, selection.bounds, visible, row_max.flatten(), denominators.flatten()
                )
            )
        return out
