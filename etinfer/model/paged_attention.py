"""Attention over a paged KV cache.

The cache of one layer is a pool of slots per KV head, ``[num_kv_heads, num_blocks * block_size,
head_dim]`` for keys and the same for values; a sequence owns a list of blocks (its block table)
and its token at position ``p`` lives in slot ``block_table[p // block_size] * block_size +
p % block_size``. Head-major order keeps a block's keys for one head in one contiguous run, which
measured twice as fast to read scattered as the token-major order.

Decode (one query token per sequence) reads the cache in place, with no per-step copy of the
blocks. The step's query rows (sequence, head) and the cache rows ``kv_head * num_slots + slot``
they attend to form a CSR pattern: scores are a sampled dense-dense matmul
(``torch.sparse.sampled_addmm``) on exactly those pairs, the softmax runs on the flat score vector
per row, and the weighted sum of values is ``embedding_bag`` with per-entry weights (a gathered
weighted row sum that FBGEMM vectorises; about twice as fast here as a CSR-dense matmul).
Sequences of any lengths share one call per layer, grouped-query heads read their KV head without
repeating it, and attending to fewer blocks is only a smaller pattern: the block-sparse variant
is this same code with a ``BlockSelector`` that keeps fewer blocks.

Prefill chunks (several query tokens of one sequence) go through
``scaled_dot_product_attention`` per sequence; there the work is quadratic in the chunk and
gathering the chunk's cached prefix once is cheap beside it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from etinfer.control.block_selection import BlockSelector, DecodeBlocks

# The CSR kernels used here are stable in the pinned torch; the notice would only confuse users.
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")


@dataclass
class DecodePattern:
    """Which cache rows each decode query row (sequence, head) reads, as a CSR pattern."""

    crow: torch.Tensor  # [rows + 1] int32
    cols: torch.Tensor  # [nnz] int32 cache rows: kv_head * num_slots + slot
    row_ids: torch.Tensor  # [nnz] the row of each entry, for the row-wise max
    row_lens: torch.Tensor  # [rows]
    zeros: torch.Tensor  # [nnz] placeholder values; sampled_addmm needs some

    @property
    def nnz(self) -> int:
        return self.cols.numel()


@dataclass
class PrefillChunk:
    start: int  # first row of the chunk in the step's flat batch
    length: int
    # Cache slots of positions [0, context) when the chunk follows a cached prefix, else None:
    # then the chunk's fresh keys and values are the whole context.
    context_slots: torch.Tensor | None
    mask: torch.Tensor | None  # [length, context] True where a query may attend


@dataclass
class AttentionMetadata:
    """What every layer needs to know about this step's batch; built once per step."""

    slot_mapping: torch.Tensor  # [rows] cache slot each new token's key and value go to
    num_decode: int  # decode rows come first in the batch
    decode_blocks: DecodeBlocks | None
    dense_pattern: DecodePattern | None
    prefills: list[PrefillChunk]


class KVCache:
    """Keys and values of every layer, paged in blocks of ``block_size`` slots.

    Always float32, whatever the weights' dtype: attention runs in float32 (the CPU's sparse
    kernels take no half types, and softmax over long contexts wants the precision).
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
    ) -> None:
        shape = (num_layers, num_kv_heads, num_blocks * block_size, head_dim)
        # On the CPU, torch.empty leaves pages untouched until written: unused slots cost nothing.
        self.keys = torch.empty(shape, device=device, dtype=self.dtype)
        self.values = torch.empty(shape, device=device, dtype=self.dtype)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_blocks * block_size


def build_decode_pattern(
    blocks: DecodeBlocks,
    num_kv_heads: int,
    queries_per_kv: int,
    num_slots: int,
    block_mask: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> DecodePattern:
    """CSR pattern of decode rows (sequence, head) against the cache rows they attend to.

    ``block_mask`` [seqs, kv_heads, max_blocks] keeps a subset of blocks per sequence and KV
    head; the block holding the current token is kept whatever the mask says, so no row is ever
    empty. Rows follow the query layout ``seq * num_heads + kv_head * queries_per_kv + j``.
    """
    tables, lens, bs = blocks.block_tables, blocks.context_lens, blocks.block_size
    num_seqs, max_blocks = tables.shape
    device = tables.device
    positions = torch.arange(max_blocks * bs, device=device)
    slots = (tables * bs).repeat_interleave(bs, dim=1) + positions % bs  # [seqs, positions]
    visible = positions < lens[:, None]
    if sliding_window is not None:
        visible &= positions >= lens[:, None] - sliding_window
    visible = visible[:, None, :]
    if block_mask is not None:
        current = torch.arange(max_blocks, device=device) == ((lens - 1) // bs)[:, None]
        kept = block_mask | current[:, None, :]
        visible = visible & kept.repeat_interleave(bs, dim=2)
    heads = torch.arange(num_kv_heads, device=device)
    cols = heads[None, :, None] * num_slots + slots[:, None, :]  # [seqs, kv_heads, positions]
    shape = (num_seqs, num_kv_heads, queries_per_kv, max_blocks * bs)
    visible = visible.expand(num_seqs, num_kv_heads, -1)[:, :, None, :].expand(shape)
    cols = cols[:, :, None, :].expand(shape).masked_select(visible).int()
    row_lens = visible.sum(-1).flatten()
    crow = torch.zeros(row_lens.numel() + 1, dtype=torch.int32, device=device)
    torch.cumsum(row_lens, 0, out=crow[1:])
    row_ids = torch.repeat_interleave(torch.arange(row_lens.numel(), device=device), row_lens)
    zeros = torch.zeros(cols.numel(), device=device)
    return DecodePattern(crow, cols, row_ids, row_lens, zeros)


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
        key_cache, value_cache = cache.keys[layer], cache.values[layer]
        q, k, v = q.to(cache.dtype), k.to(cache.dtype), v.to(cache.dtype)  # no-ops in float32
        key_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        value_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
        out = torch.empty_like(q)
        if meta.num_decode:
            out[: meta.num_decode] = self._decode(
                layer, q[: meta.num_decode], key_cache, value_cache, meta
            )
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.start + chunk.length)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], key_cache, value_cache, chunk)
        return out.flatten(1)

    def _decode(
        self,
        layer: int,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        blocks = meta.decode_blocks
        mask = self.selector.select(layer, q, blocks)
        pattern = meta.dense_pattern
        if mask is not None:
            pattern = build_decode_pattern(
                blocks,
                self.num_kv_heads,
                self.num_heads // self.num_kv_heads,
                key_cache.shape[1],
                mask,
                self.sliding_window,
            )
        rows = q.shape[0] * self.num_heads
        keys = key_cache.view(-1, self.head_dim)  # row kv_head * num_slots + slot
        values = value_cache.view(-1, self.head_dim)
        structure = torch.sparse_csr_tensor(
            pattern.crow, pattern.cols, pattern.zeros, (rows, keys.shape[0]), check_invariants=False
        )
        scores = torch.sparse.sampled_addmm(
            structure, q.reshape(rows, self.head_dim), keys.t(), beta=0.0, alpha=self.scale
        ).values()
        row_max = torch.full((rows,), -torch.inf, device=q.device, dtype=scores.dtype)
        row_max.scatter_reduce_(0, pattern.row_ids, scores, "amax")
        weights = scores.sub_(
            row_max.repeat_interleave(pattern.row_lens, output_size=pattern.nnz)
        ).exp_()
        denominators = torch.segment_reduce(weights, "sum", offsets=pattern.crow)
        out = F.embedding_bag(
            pattern.cols,
            values,
            pattern.crow,
            mode="sum",
            per_sample_weights=weights,
            include_last_offset=True,
        )
        return out.div_(denominators[:, None]).view(q.shape)

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
