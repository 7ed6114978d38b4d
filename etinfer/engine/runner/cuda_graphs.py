"""Plain decode steps replayed as CUDA graphs, one graph per batch-size bucket.

A decode step of a small model on a GPU is bound by the host: launching a few hundred kernels
costs more than running them (BENCHMARKS.md, "The CUDA path"). A captured graph launches them
all at once. Capture needs a step whose launches are a fixed sequence over fixed buffers, which
the plain decode step is once attention reads the block tables itself (``model/gpu/``): the
batch's token ids, positions, cache slots, block tables and context lengths are copied into
static buffers, padded up to the bucket, and the bucket's graph replays the forward pass and
the output head. Padding rows see no context and write their keys and values to a scratch slot
that no sequence owns (the cache holds one block more than the pool hands out).

Steps that are not plain decode (prefill chunks, drafts to verify) run eagerly, as vLLM's do
outside its captured sizes. An engine with a layer that changes what a decode step reads (block
summaries for pruning or sparse prefill, KV compression's captured queries and offsets,
batch-invariant rows) has no graphs at all (``ModelRunner``). That is also why a replayed step
leaves a block's first write unzeroed (``KVCache.write``'s ``fresh_blocks``): only readers of
whole blocks need it, the torch decode form and those layers, none of which runs beside graphs;
the kernel reads a row's context and nothing past it.
"""

from __future__ import annotations

import torch

from etinfer.engine.sequence import Sequence
from etinfer.model.attention.metadata import AttentionMetadata
from etinfer.model.block_layout import DecodeBlocks
from etinfer.model.kv_cache import KVCache
from etinfer.model.llama import LlamaModel

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class DecodeGraphs:
    """Every bucket captured when built, the largest first, all sharing one memory pool (as
    vLLM does at start-up): a step never pays for a capture, nor a benchmark's first run."""

    def __init__(
        self, model: LlamaModel, cache: KVCache, max_rows: int, max_blocks: int, scratch_slot: int
    ) -> None:
        self.model, self.cache = model, cache
        self.buckets = sorted({b for b in BUCKETS if b < max_rows} | {max_rows})
        self.max_blocks, self.scratch_slot = max_blocks, scratch_slot
        rows, device = self.buckets[-1], cache.keys.device
        # One pinned host buffer and one device buffer carry a step's inputs in one copy:
        # per row its token, position, slot and context length, then its block table.
        self.columns = 4 + max_blocks
        self.host = torch.zeros(rows, self.columns, dtype=torch.long).pin_memory()
        self.inputs = torch.zeros(rows, self.columns, dtype=torch.long, device=device)
        self.inputs[:, 2] = scratch_slot  # captured as padding rows: they write nowhere used
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.replays = 0
        self.copied: torch.cuda.Event | None = None  # the last step's inputs' copy
        for bucket in reversed(self.buckets):
            self.graphs[bucket] = self._capture(bucket)

    def takes(self, rows: int, width: int) -> bool:
        return rows <= self.buckets[-1] and width <= self.max_blocks

    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """Logits [rows, vocab] (float32) of each sequence's next token, its last known one
        computed into the cache."""
        rows, block_size = len(seqs), self.cache.block_size
        bucket = next(b for b in self.buckets if b >= rows)
        host = self.host[:bucket]
        width = max(len(seq.block_table) for seq in seqs)
        steps, tables = [], []
        for seq in seqs:  # a row per sequence, not per token (no KV offsets: no compression)
            position, table = seq.num_computed_tokens, seq.block_table
            slot = table[position // block_size] * block_size + position % block_size
            steps.append((seq.token_ids[position], position, slot, position + 1))
            tables.append(table + [0] * (width - len(table)))
        # The pinned buffer is rewritten once its last copy is done. It nearly always is: the
        # last step waited for its sampled tokens, which came after that copy. A query asks
        # without waiting (an H200's profile counted the wait as one of 3.1 syncs a step).
        if self.copied is not None and not self.copied.query():
            self.copied.synchronize()
        host[:rows, :4] = torch.tensor(steps)
        host[:rows, 4 : 4 + width] = torch.tensor(tables)
        host[rows:, :4] = torch.tensor([0, 0, self.scratch_slot, 0])  # padding rows
        self.inputs[:bucket].copy_(host, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()
        graph, logits = self.graphs[bucket]
        graph.replay()
        self.replays += 1
        # A copy: the graphs share their memory, so the next replay writes over this output.
        return logits[:rows].clone()

    def _forward(self, bucket: int) -> torch.Tensor:
        inputs = self.inputs[:bucket]
        blocks = DecodeBlocks(inputs[:, 4:], inputs[:, 3], self.cache.block_size)
        meta = AttentionMetadata(inputs[:, 2], bucket, blocks, None, [])
        meta.local = meta  # the sliding layers' window is attention's own on this path
        hidden = self.model.forward(inputs[:, 0], inputs[:, 1], self.cache, meta)
        return self.model.compute_logits(hidden)

    def _capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up off the capture (Triton compiles, cuBLAS picks its kernels) on a side stream,
        # as torch asks; the buffers hold padding rows, whose writes go to the scratch slot.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(bucket)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(bucket)
        self.pool = graph.pool()
        return graph, logits
