"""Attention over a paged KV cache.

**Cache layout.** One layer's cache is a pool of slots per KV head:
``[num_kv_heads, num_blocks * block_size, head_dim]`` for keys, and the same for values. A
sequence owns a list of blocks (its block table); its token at position ``p`` lives in slot
``block_table[p // block_size] * block_size + p % block_size``. Head-major order keeps a block's
keys for one head in one contiguous run, which measured twice as fast to read scattered as
token-major order.

**Decode** (one query token per sequence) reads the cache in place, with no per-step copy of the
blocks. The step's query rows (sequence, head) and the cache rows
``kv_head * num_slots + slot`` they attend to form a CSR pattern:

- the scores are a sampled dense-dense matmul (``torch.sparse.sampled_addmm``) on exactly those
  pairs;
- the softmax runs on the flat score vector, row by row;
- the weighted sum of values is ``embedding_bag`` with per-entry weights (a gathered, weighted
  row sum that FBGEMM vectorises; about twice as fast here as a CSR-dense matmul).

Sequences of any lengths share one call per layer, and grouped-query heads read their KV head
without repeating it. Attending to fewer blocks is only a smaller pattern: a ``BlockSelector``
that keeps fewer blocks makes attention compute less.

**Block summaries.** When a selector scores blocks, the cache also keeps, per block and KV head,
the per-channel minimum and maximum of its keys (updated on append) and the attention mass the
block last received.

**Prefill chunks** (several query tokens of one sequence) go through
``scaled_dot_product_attention``, one sequence at a time: there the work is quadratic in the
chunk, and gathering the chunk's cached prefix once is cheap beside it.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from etinfer.control.block_selection import BlockSelector, BlockSummaries, DecodeBlocks

# The CSR kernels and index_reduce are stable in the pinned torch; the notices would only confuse.
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")
warnings.filterwarnings("ignore", message="index_reduce\\(\\) is in beta")


@dataclass
class DecodePattern:
    """Which cache rows each decode query row (sequence, head) reads, as a CSR pattern.

    Every kept block is read whole; ``masked`` lists the entries outside the context (past the
    current token in the last block, before the window in the first), whose scores are set to
    -inf. They are few (under two blocks' worth per row), and reading them costs less than
    making every row's length exact: that needs a compaction over all entries.
    """

    crow: torch.Tensor  # [rows + 1] int32
    cols: torch.Tensor  # [nnz] int32 cache rows: kv_head * num_slots + slot
    row_ids: torch.Tensor  # [nnz] the row of each entry, for the row-wise max
    row_lens: torch.Tensor  # [rows]
    zeros: torch.Tensor  # [nnz] placeholder values; sampled_addmm needs some
    masked: torch.Tensor  # [few] entries outside the context

    @property
    def nnz(self) -> int:
        return self.cols.numel()

    def rows_read(self) -> list[list[int]]:
        """Per row, the cache rows it attends to (the masked entries left out); for inspection."""
        inside = torch.ones(self.nnz, dtype=torch.bool, device=self.cols.device)
        inside[self.masked] = False
        bounds = self.crow.tolist()
        return [self.cols[a:b][inside[a:b]].tolist() for a, b in itertools.pairwise(bounds)]


@dataclass
class PrefillChunk:
    start: int  # first row of the chunk in the step's flat batch
    length: int
    # Cache slots of positions [0, context) when the chunk follows a cached prefix, else None:
    # then the chunk's fresh keys and values are the whole context.
    context_slots: torch.Tensor | None
    mask: torch.Tensor | None  # [length, context] True where a query may attend


@dataclass
class PruningTelemetry:
    """Per layer and decode sequence, what attention kept; filled in as layers run."""

    in_context: torch.Tensor  # [seqs, kv_heads, blocks] blocks in context (and window)
    log_tokens: torch.Tensor  # [seqs, blocks] log of each block's tokens in context
    kept: torch.Tensor  # [layers, seqs] (block, KV head) pairs attended to
    total: torch.Tensor  # [layers, seqs] (block, KV head) pairs in context
    # [layers, seqs] upper bound of the softmax mass the dropped blocks carried (max over heads)
    dropped_mass: torch.Tensor

    @classmethod
    def empty(cls, layers: int, blocks: DecodeBlocks, in_context: torch.Tensor) -> PruningTelemetry:
        """Before the step; ``in_context`` is what dense attention reads. What every layer's
        record shares is built here, once per step."""
        positions = torch.arange(blocks.block_tables.shape[1], device=in_context.device)
        tokens = blocks.context_lens[:, None] - positions * blocks.block_size
        log_tokens = tokens.clamp(0, blocks.block_size).log()
        total = in_context.sum((1, 2)).float().expand(layers, -1).clone()
        return cls(in_context, log_tokens, torch.zeros_like(total), total, torch.zeros_like(total))


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


class KVCache:
    """Keys and values of every layer, paged in blocks of ``block_size`` slots.

    Always float32, whatever the weights' dtype: attention runs in float32 (the CPU's sparse
    kernels take no half types, and softmax over long contexts wants the precision). With
    ``summaries`` it also keeps per block and KV head the key bounds and the last attention
    mass, about 1/16 of the cache's size at a block size of 16.
    """

    dtype = torch.float32

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        summaries: bool = False,
    ) -> None:
        shape = (num_layers, num_kv_heads, num_blocks * block_size, head_dim)
        # On the CPU, torch.empty leaves pages untouched until written: unused slots cost nothing.
        self.keys = torch.empty(shape, device=device, dtype=self.dtype)
        self.values = torch.empty(shape, device=device, dtype=self.dtype)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.key_bounds = self.mass = None
        if summaries:
            per_block = (num_layers, num_kv_heads, num_blocks)
            self.key_bounds = torch.empty(
                (*per_block, 2, head_dim), device=device, dtype=self.dtype
            )
            self.mass = torch.empty(per_block, device=device, dtype=self.dtype)

    def summaries(self, layer: int) -> BlockSummaries | None:
        if self.key_bounds is None:
            return None
        return BlockSummaries(self.key_bounds[layer], self.mass[layer])

    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        fresh_blocks: torch.Tensor | None,
        keys: torch.Tensor,  # [rows, kv_heads, head_dim]
        values: torch.Tensor,
    ) -> None:
        keys, values = keys.transpose(0, 1), values.transpose(0, 1)
        self.keys[layer].index_copy_(1, slots, keys)
        self.values[layer].index_copy_(1, slots, values)
        if self.key_bounds is None:
            return
        key_max, key_min = self.key_bounds[layer].unbind(2)
        if fresh_blocks is not None and fresh_blocks.numel():
            # A block's first token starts its bounds afresh; its mass is unknown until it is
            # attended to, and +inf keeps it in the mass scorer's ranking until then.
            key_max.index_fill_(1, fresh_blocks, -torch.inf)
            key_min.index_fill_(1, fresh_blocks, torch.inf)
            self.mass[layer].index_fill_(1, fresh_blocks, torch.inf)
        blocks = torch.div(slots, self.block_size, rounding_mode="floor")
        key_max.index_reduce_(1, blocks, keys, "amax")
        key_min.index_reduce_(1, blocks, keys, "amin")


def visible_blocks(
    blocks: DecodeBlocks,
    num_kv_heads: int,
    block_mask: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Which blocks each (sequence, KV head) attends to: [seqs, kv_heads, max_blocks].

    Blocks in context (and in the sliding window), restricted to ``block_mask`` when given;
    the block holding the current token is kept whatever the mask says, so no row is empty.
    """
    tables, lens, bs = blocks.block_tables, blocks.context_lens, blocks.block_size
    positions = torch.arange(tables.shape[1], device=tables.device)
    exists = positions * bs < lens[:, None]
    if sliding_window is not None:
        exists &= (positions + 1) * bs > lens[:, None] - sliding_window
    visible = exists[:, None, :].expand(-1, num_kv_heads, -1)
    if block_mask is not None:
        current = positions == torch.div(lens - 1, bs, rounding_mode="floor")[:, None]
        visible = visible & (block_mask | current[:, None, :])
    return visible


def build_decode_pattern(
    blocks: DecodeBlocks,
    visible: torch.Tensor,
    queries_per_kv: int,
    num_slots: int,
    sliding_window: int | None = None,
) -> DecodePattern:
    """CSR pattern of decode rows against the cache rows of their ``visible`` blocks.

    Built at block granularity: the kept (sequence, head, block) triples become runs of
    ``block_size`` consecutive cache rows, so the work scales with what is kept, not with the
    context, and every per-entry tensor is one broadcast of a per-block one. Rows follow the
    query layout ``seq * num_heads + kv_head * queries_per_kv + j``; a row's blocks are in
    order. Slots of a kept block outside the context are read and masked (see DecodePattern):
    they belong to the sequence's own blocks, whose cache rows only ever hold finite keys and
    values (or the zeros of untouched memory).
    """
    tables, lens, bs = blocks.block_tables, blocks.context_lens, blocks.block_size
    seqs, kv_heads, _ = visible.shape
    device = tables.device
    seq, head, block = visible.nonzero(as_tuple=True)  # in (seq, head, block) order
    start = (head * num_slots + tables[seq, block] * bs).int()  # the kernels' index type
    # Tokens of each block inside the context: [skip, end) of its bs slots.
    end = (lens[seq] - block * bs).clamp(max=bs)
    skip = torch.zeros_like(end)
    if sliding_window is not None:
        skip = (lens[seq] - sliding_window - block * bs).clamp(0, bs)
    # Repeat each (seq, head) run of blocks once per query head of the group: the runs of row r
    # are those of its segment (seq, kv head), found by their index within the segment.
    segment = seq * kv_heads + head
    per_segment = torch.bincount(segment, minlength=seqs * kv_heads)
    segment_start = torch.cumsum(per_segment, 0) - per_segment
    rows = seqs * kv_heads * queries_per_kv
    row_runs = per_segment.repeat_interleave(queries_per_kv)
    run_row = torch.repeat_interleave(torch.arange(rows, device=device), row_runs)
    run_in_row = (
        torch.arange(run_row.numel(), device=device)
        - (torch.cumsum(row_runs, 0) - row_runs)[run_row]
    )
    which = segment_start.repeat_interleave(queries_per_kv)[run_row] + run_in_row
    offsets = torch.arange(bs, device=device, dtype=torch.int32)
    cols = (start[which, None] + offsets).view(-1)
    row_ids = run_row[:, None].expand(-1, bs).reshape(-1)
    row_lens = row_runs * bs
    crow = torch.zeros(rows + 1, dtype=torch.int32, device=device)
    torch.cumsum(row_lens, 0, out=crow[1:])
    # Entries outside the context: only in the few runs whose block is cut.
    end, skip = end[which], skip[which]
    (cut,) = ((end < bs) | (skip > 0)).nonzero(as_tuple=True)
    outside = (offsets >= end[cut, None]) | (offsets < skip[cut, None])
    masked = (cut[:, None] * bs + offsets)[outside]
    return DecodePattern(
        crow, cols, row_ids, row_lens, torch.zeros(cols.numel(), device=device), masked
    )


class PagedAttention:
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        selector: BlockSelector,
        sliding_window: int | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.selector = selector
        self.sliding_window = sliding_window

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,  # [rows, num_heads, head_dim]
        k: torch.Tensor,  # [rows, num_kv_heads, head_dim]
        v: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = q.to(cache.dtype), k.to(cache.dtype), v.to(cache.dtype)  # no-ops in float32
        cache.write(layer, meta.slot_mapping, meta.fresh_blocks, k, v)
        out = torch.empty_like(q)
        if meta.num_decode:
            out[: meta.num_decode] = self._decode(layer, q[: meta.num_decode], cache, meta)
        key_cache, value_cache = cache.keys[layer], cache.values[layer]
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.start + chunk.length)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], key_cache, value_cache, chunk)
        return out.flatten(1)

    def _decode(
        self, layer: int, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        blocks = meta.decode_blocks
        summaries = cache.summaries(layer) if self.selector.needs_summaries else None
        selection = self.selector.select(layer, q, blocks, summaries)
        pattern, visible = meta.dense_pattern, None
        if selection is not None:
            visible = visible_blocks(blocks, self.num_kv_heads, selection.mask, self.sliding_window)
            pattern = build_decode_pattern(
                blocks,
                visible,
                self.num_heads // self.num_kv_heads,
                cache.num_slots,
                self.sliding_window,
            )
        rows = q.shape[0] * self.num_heads
        keys = cache.keys[layer].view(-1, self.head_dim)  # row kv_head * num_slots + slot
        structure = torch.sparse_csr_tensor(
            pattern.crow, pattern.cols, pattern.zeros, (rows, keys.shape[0]), check_invariants=False
        )
        scores = torch.sparse.sampled_addmm(
            structure, q.reshape(rows, self.head_dim), keys.t(), beta=0.0, alpha=self.scale
        ).values()
        scores.index_fill_(0, pattern.masked, -torch.inf)
        row_max = torch.full((rows,), -torch.inf, device=q.device, dtype=scores.dtype)
        row_max.scatter_reduce_(0, pattern.row_ids, scores, "amax")
        weights = scores.sub_(
            row_max.repeat_interleave(pattern.row_lens, output_size=pattern.nnz)
        ).exp_()
        denominators = torch.segment_reduce(weights, "sum", offsets=pattern.crow)
        out = F.embedding_bag(
            pattern.cols,
            cache.values[layer].view(-1, self.head_dim),
            pattern.crow,
            mode="sum",
            per_sample_weights=weights,
            include_last_offset=True,
        )
        if meta.telemetry is not None:
            self._record(layer, selection, visible, row_max, denominators, meta.telemetry)
        if summaries is not None and summaries.mass is not None and self.selector.observes_mass:
            self._observe_mass(summaries.mass, pattern, weights, denominators, cache.block_size)
        return out.div_(denominators[:, None]).view(q.shape)

    def _record(self, layer, selection, visible, row_max, denominators, telemetry) -> None:
        """Blocks kept, and an upper bound of the attention mass the dropped blocks carried.

        With ``D`` the dropped blocks' true softmax numerator sum and ``K`` the kept one (exact),
        the dropped mass is ``D / (K + D)``; each key's score is at most its block's key bound,
        so ``D <= sum_dropped tokens * exp(bound)`` bounds it from above. The attention output
        error is that mass times the gap between dropped and kept mean values.
        """
        if selection is None:
            telemetry.kept[layer] = telemetry.total[layer]
            return
        telemetry.kept[layer] = visible.sum((1, 2))
        dropped = telemetry.in_context & ~visible  # [seqs, kv_heads, blocks]
        seqs, kv_heads, group, _ = selection.bounds.shape
        # One fresh tensor, updated in place: the terms are small but there are many layers.
        relative = selection.bounds * self.scale
        relative += telemetry.log_tokens[:, None, None, :]
        relative -= row_max.view(seqs, kv_heads, group, 1)
        relative.masked_fill_(~dropped[:, :, None, :], -torch.inf)
        log_kept = denominators.log().view(seqs, kv_heads, group)
        telemetry.dropped_mass[layer] = torch.sigmoid(relative.logsumexp(-1) - log_kept).amax(
            (1, 2)
        )

    def _observe_mass(self, mass, pattern, weights, denominators, block_size) -> None:
        """Record each attended block's attention mass, averaged over the query heads that
        share its KV head (what the mass scorer ranks by, until the block is read again)."""
        group = self.num_heads // self.num_kv_heads
        probs = weights / denominators[pattern.row_ids] / group
        ids = torch.div(
            pattern.cols, block_size, rounding_mode="floor"
        ).long()  # head * blocks + block
        flat = mass.view(-1)
        flat.index_fill_(0, ids, 0.0)
        flat.index_add_(0, ids, probs)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        chunk: PrefillChunk,
    ) -> torch.Tensor:
        if chunk.context_slots is None:
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        else:
            k = key_cache.index_select(1, chunk.context_slots)
            v = value_cache.index_select(1, chunk.context_slots)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=self.scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)


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
