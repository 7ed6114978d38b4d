"""Paged attention against a plain dense reference on random caches."""

import pytest
import torch

from etinfer.control.block_selection import BlockSelector, DenseSelector
from etinfer.model import native_kernels
from etinfer.model.attention.layer import PagedAttention
from etinfer.model.attention.metadata import AttentionMetadata, PrefillChunk, prefill_mask
from etinfer.model.attention.options import AttentionOptions
from etinfer.model.attention.pattern import build_decode_pattern, visible_blocks
from etinfer.model.block_layout import AttentionSelector, DecodeBlocks, Selection
from etinfer.model.kv_cache import KVCache
from tests.conftest import rows_read

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 16, 4


def paged_attention(
    selector: AttentionSelector, window: int | None = None, backend: str = "auto"
) -> PagedAttention:
    """The layer over this file's heads on the CPU, reading through ``backend``."""
    options = AttentionOptions(
        num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, backend=backend, sliding_window=window
    )
    return PagedAttention(options=options, device=torch.device("cpu"), selector=selector)


def reference(q, keys, values, window=None):
    """Attention of queries at the last positions of a context, dense and explicit."""
    n, context = q.shape[0], keys.shape[0]
    group = HEADS // KV_HEADS
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, context, dim]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) / DIM**0.5  # [heads, n, context]
    query_pos = torch.arange(context - n, context)[:, None]
    key_pos = torch.arange(context)[None, :]
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    scores = scores.masked_fill(~visible, -torch.inf)
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, HEADS * DIM)


CACHE_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8]


def scattered_cache(lengths, num_blocks=40, seed=0, dtype=torch.float32, device="cpu"):
    """A cache in ``dtype`` on ``device`` holding one random context per length, in shuffled
    blocks (the same values on any device)."""
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache(1, num_blocks, BLOCK, KV_HEADS, DIM, torch.device(device), dtype)
    keys, values = (
        torch.randn(cache.num_slots, KV_HEADS, DIM, generator=gen).to(device) for _ in "kv"
    )
    cache.write(0, torch.arange(cache.num_slots, device=device), None, keys, values)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for length in lengths:
        n = -(-length // BLOCK)
        tables.append([free.pop() for _ in range(n)])
    return cache, tables


def context_of(cache, table, length):
    """The context's keys and values as the cache holds them, in float32: [length, heads, dim]."""
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(length)])
    keys, values = cache.read(0, slots)
    return keys.transpose(0, 1), values.transpose(0, 1)


def decode(attention, cache, tables, lengths, q, window=None):
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    blocks = DecodeBlocks(padded, torch.tensor(lengths), BLOCK)
    visible = visible_blocks(blocks, KV_HEADS, None, window)
    pattern = build_decode_pattern(blocks, visible, HEADS // KV_HEADS, cache.num_slots, window)
    # The new tokens' keys are already in the cache, so write them back unchanged.
    last = torch.tensor(
        [
            t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK
            for t, n in zip(tables, lengths, strict=True)
        ]
    )
    meta = AttentionMetadata(last, len(lengths), blocks, pattern, [])
    keys, values = cache.read(0, last)
    return attention(0, q, keys.transpose(0, 1), values.transpose(0, 1), cache, meta)


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("window", [None, 5])
def test_decode_matches_dense_reference_for_mixed_lengths(window, backend, dtype):
    """Over the values as the cache holds them, in the native kernel and in torch."""
    if backend == "native" and not native_kernels.available():
        pytest.skip("no native kernels")
    lengths = [1, 7, 16, 33]
    cache, tables = scattered_cache(lengths, dtype=dtype)
    q = torch.randn(len(lengths), HEADS, DIM)
    attention = paged_attention(DenseSelector(), window, backend)
    out = decode(attention, cache, tables, lengths, q, window)
    for i, n in enumerate(lengths):
        keys, values = context_of(cache, tables[i], n)
        expected = reference(q[i : i + 1], keys, values, window)
        torch.testing.assert_close(out[i : i + 1], expected, rtol=1e-5, atol=1e-5)


def mask_of(query, blocks, fill: bool) -> torch.Tensor:
    shape = (query.shape[0], KV_HEADS, blocks.block_tables.shape[1])
    return torch.full(shape, fill, dtype=torch.bool)


class KeepAll(BlockSelector):
    def select(self, layer, query, blocks, summaries):
        return Selection(mask_of(query, blocks, True))


class KeepFirstBlock(BlockSelector):
    def select(self, layer, query, blocks, summaries):
        mask = mask_of(query, blocks, False)
        mask[:, :, 0] = True
        return Selection(mask)


def test_selector_keeping_every_block_equals_dense_exactly():
    lengths = [9, 30]
    cache, tables = scattered_cache(lengths)
    q = torch.randn(2, HEADS, DIM)
    dense = decode(paged_attention(DenseSelector()), cache, tables, lengths, q)
    kept = decode(paged_attention(KeepAll()), cache, tables, lengths, q)
    assert torch.equal(dense, kept)


class KeepNothing(BlockSelector):
    def select(self, layer, query, blocks, summaries):
        return Selection(mask_of(query, blocks, False))


def test_an_empty_selection_still_attends_to_the_current_block():
    lengths = [10]  # positions 8 and 9 are in the third block
    cache, tables = scattered_cache(lengths)
    q = torch.randn(1, HEADS, DIM)
    out = decode(paged_attention(KeepNothing()), cache, tables, lengths, q)
    keys, values = context_of(cache, tables[0], 10)
    group = HEADS // KV_HEADS
    k, v = keys[8:].repeat_interleave(group, 1), values[8:].repeat_interleave(group, 1)
    weights = (torch.einsum("hd,khd->hk", q[0], k) / DIM**0.5).softmax(-1)
    expected = torch.einsum("hk,khd->hd", weights, v).reshape(1, -1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_selector_mask_restricts_what_is_read():
    lengths = [12]
    cache, tables = scattered_cache(lengths)
    q = torch.randn(1, HEADS, DIM)
    out = decode(paged_attention(KeepFirstBlock()), cache, tables, lengths, q)
    keys, values = context_of(cache, tables[0], 12)
    # The first block and the current token's block (always kept) are attended to, nothing else.
    kept = torch.cat([torch.arange(0, 4), torch.arange(8, 12)])
    expected = reference(q, keys[kept], values[kept])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_pattern_rows_list_each_heads_context_slots():
    blocks = DecodeBlocks(torch.tensor([[3, 1], [2, 0]]), torch.tensor([6, 2]), BLOCK)
    num_slots = 4 * BLOCK
    visible = visible_blocks(blocks, KV_HEADS)
    pattern = build_decode_pattern(blocks, visible, HEADS // KV_HEADS, num_slots)
    rows = rows_read(pattern)
    assert [len(row) for row in rows] == [6] * HEADS + [2] * HEADS
    assert rows[0] == [12, 13, 14, 15, 4, 5]  # sequence 0, head 0 (KV head 0)
    assert rows[-1] == [num_slots + 8, num_slots + 9]  # sequence 1, the last head: KV head 1
    # Whole blocks are read (2 and 1 of them), the slots past the context masked.
    assert pattern.crow.diff().tolist() == [8] * HEADS + [4] * HEADS


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
@pytest.mark.parametrize(
    ("start", "length", "window"), [(0, 9, None), (6, 5, None), (6, 5, 4), (0, 9, 3)]
)
def test_prefill_chunk_after_a_cached_prefix(start, length, window, dtype):
    """Over the cached prefix as stored, and over the chunk's own fresh keys as they will be
    stored: a token's result is the same whether its context was cached or computed with it."""
    context = start + length
    cache, (table,) = scattered_cache([context], dtype=dtype)
    q = torch.randn(length, HEADS, DIM)
    keys, values = context_of(cache, table, context)
    if dtype != torch.float32:  # fresh keys the cache would round
        keys, values = (
            keys + 1e-3 * torch.randn_like(keys),
            values + 1e-3 * torch.randn_like(values),
        )
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(context)])
    chunk = PrefillChunk(
        0,
        length,
        slots if start else None,
        prefill_mask(start, length, window, torch.device("cpu")),
    )
    meta = AttentionMetadata(slots[start:], 0, None, None, [chunk])
    out = paged_attention(DenseSelector(), window)(0, q, keys[start:], values[start:], cache, meta)
    keys, values = context_of(cache, table, context)  # as the chunk's write left them
    torch.testing.assert_close(out, reference(q, keys, values, window), rtol=1e-5, atol=1e-5)
