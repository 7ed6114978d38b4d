"""The ``triton`` backend: the GPU's own kernels (``model/gpu/``), which read the cache where it
holds them. Decode rows go through the paged decode kernel, which reads the block tables itself
(no per-step pattern, so a plain decode step can be a CUDA graph) and takes a selector's blocks
as its mask. Prefill goes through the paged prefill kernel where a chunk follows a cached
prefix in a 16-bit cache, whose dots run on tensor cores (on an H200, 0.40 ms a layer against
SDPA's 2.2 for 2,048 queries after 6,144 positions; BENCHMARKS.md, "The CUDA path on an H200:
prefill on tensor cores"); over a float32 or int8 cache such a chunk keeps SDPA over the
gathered prefix (the kernel's IEEE float32 dots took 3.9), and a chunk with no prefix SDPA's
flash kernel, which needs no cache at all. Sparse prefill's pieces always take the kernel, which
reads the kept positions in place. The CUDA device's choice; elsewhere it runs in Triton's
interpreter, which its tests use."""

from __future__ import annotations

import torch

from etinfer.model import gpu
from etinfer.model.attention.backend import Attended
from etinfer.model.attention.metadata import AttentionMetadata, PrefillChunk
from etinfer.model.attention.pattern import DecodePattern, visible_blocks
from etinfer.model.attention.sdpa import SdpaPrefill
from etinfer.model.block_layout import DecodeBlocks
from etinfer.model.gpu import paged_decode as gpu_decode
from etinfer.model.gpu.paged_prefill import SIXTEEN_BIT, paged_prefill
from etinfer.model.kv_cache import KVCache


class TritonBackend(SdpaPrefill):
    reads_block_tables = True

    def refusal(self, device: torch.device) -> str | None:
        if not gpu.available():
            return "Triton is not installed"
        if device.type != "cuda" and not gpu.interpreting():
            return (
                f"its kernels run on CUDA (or in Triton's interpreter, TRITON_INTERPRET=1), "
                f"not on {device}"
            )
        return None

    def decode_metadata(
        self, blocks: DecodeBlocks, num_slots: int, window: int | None
    ) -> tuple[torch.Tensor | None, DecodePattern | None]:
        return None, None  # the kernel reads the block tables

    def decode(
        self,
        layer: int,
        q: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
        window: int | None,
        block_mask: torch.Tensor | None = None,
    ) -> Attended:
        blocks, options = meta.decode_blocks, self.options
        visible = None
        if block_mask is not None:
            visible = visible_blocks(blocks, options.num_kv_heads, block_mask, window)
        out, row_max, denominators = gpu_decode.paged_decode(
            q,
            cache.layer_keys[layer],
            cache.layer_values[layer],
            *cache.layer_scales(layer),
            blocks.block_tables,
            blocks.context_lens,
            cache.block_size,
            options.scale,
            window,
            visible,
            splits=1 if options.batch_invariant else None,
            softcap=options.softcap,
        )
        return Attended(out, row_max.flatten(), denominators.flatten(), visible)

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
        if chunk.context_slots is None or cache.dtype not in SIXTEEN_BIT:
            return super().prefill(layer, q, k, v, cache, chunk, window)
        options = self.options
        return paged_prefill(
            q, cache.layer_keys[layer], cache.layer_values[layer], None, None,
            chunk.context_slots, options.scale, window, options.softcap,
        )  # fmt: skip

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
        scales = [None if s is None else s[kv_heads] for s in cache.layer_scales(layer)]
        return paged_prefill(
            q, cache.keys[layer, kv_heads], cache.values[layer, kv_heads], *scales,
            chunk.context_slots[:end], self.options.scale, window,
            key_positions=key_positions, first=end - q.shape[0],
        )  # fmt: skip
