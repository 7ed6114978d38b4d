"""The native block scores from the low-rank key copy (``native/key_sketch.c``) against the torch
form in ``control/key_sketch.py``, on random ragged layouts: the same log-shares up to float
rounding, padding past the context never read, a block id inside it refused."""

import pytest
import torch

from etinfer.control.key_sketch import sketch_block_scores
from etinfer.model import block_kernels, native_kernels
from etinfer.model.block_layout import DecodeBlocks
from etinfer.model.key_copy import from_rows

pytestmark = pytest.mark.skipif(
    native_kernels.compiler() is None or not native_kernels.enabled(), reason="no C compiler"
)
BLOCK, NUM_BLOCKS, DIM = 16, 48, 32
# Ends mid-block, a single token, exactly a block, several blocks, one past a block.
LENGTHS = [37, 1, 16, 200, 129]


def case(kv_heads, group, rank, dtype, seed, size=BLOCK, lengths=LENGTHS, dim=DIM):
    """A layout of ``lengths`` in blocks of ``size`` (padding past each context holds ids
    inside the cache, which the torch form gathers) and random queries, maps and key copy."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // size) for n in lengths) + 2
    num_blocks = max(NUM_BLOCKS, width + 8)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in lengths])
    blocks = DecodeBlocks(tables.to(dtype), torch.tensor(lengths, dtype=dtype), size)
    query = torch.randn(len(lengths), kv_heads * group, dim, generator=gen)
    query_map = torch.randn(kv_heads, dim, rank, generator=gen) / dim**0.5
    codes = torch.randint(-127, 128, (kv_heads, num_blocks * size, rank), generator=gen)
    code_scales = torch.rand(kv_heads, num_blocks * size, generator=gen) / 40
    return blocks, (query, query_map, from_rows(codes.to(torch.int8), size), code_scales)


def in_torch(inputs, blocks, scale, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(block_kernels, "sketch_block_scores", lambda *args: None)
        return sketch_block_scores(*inputs, blocks, scale)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("kv_heads", "group", "rank"), [(3, 3, 16), (1, 4, 48), (2, 1, 5)])
def test_native_sketch_scores_are_the_torch_ones(kv_heads, group, rank, dtype, monkeypatch):
    blocks, inputs = case(kv_heads, group, rank, dtype, seed=rank * 10 + group)
    projected = torch.einsum(
        "skgd,kdr->skgr", inputs[0].view(len(LENGTHS), kv_heads, group, DIM), inputs[1]
    ).contiguous()
    native = block_kernels.sketch_block_scores(
        projected, *inputs[2:], blocks.block_tables, blocks.context_lens, BLOCK, 0.125
    )
    assert native is not None  # the native form, not the fallback, is what is compared
    expected = in_torch(inputs, blocks, 0.125, monkeypatch)
    assert native.shape == expected.shape == (len(LENGTHS), kv_heads, group, 15)
    assert native.dtype == torch.float32
    outside = ~blocks.present[:, None, None].expand_as(expected)
    assert torch.isneginf(native[outside]).all() and torch.isneginf(expected[outside]).all()
    torch.testing.assert_close(native[~outside], expected[~outside], rtol=0, atol=1e-5)
    # A share of the mass each: the blocks' shares add up to the whole context's.
    torch.testing.assert_close(native.exp().sum(-1), torch.ones(expected.shape[:-1]))
    assert sketch_block_scores(*inputs, blocks, 0.125).equal(native)  # what the caller gets


@pytest.mark.parametrize(("size", "rank"), [(5, 16), (12, 7), (128, 16), (128, 200)])
def test_blocks_of_any_size_are_scored(size, rank, monkeypatch):
    """Blocks of no multiple of eight tokens (their last tokens' codes read apart), odd ranks
    (a zero pair's half), long blocks and a wide copy."""
    blocks, inputs = case(2, 3, rank, torch.int64, seed=size + rank, size=size)
    native = sketch_block_scores(*inputs, blocks, 0.125)
    expected = in_torch(inputs, blocks, 0.125, monkeypatch)
    inside = blocks.present[:, None, None].expand_as(expected)
    torch.testing.assert_close(native[inside], expected[inside], rtol=0, atol=1e-5)
    assert torch.isneginf(native[~inside]).all()


def test_wide_scores_keep_far_blocks_finite(monkeypatch):
    """Logits some hundreds apart: a block far below the best keeps its own finite share (each
    block's log-sum-exp subtracts its own maximum), as in torch."""
    blocks, inputs = case(1, 3, 16, torch.int64, seed=7)
    native = sketch_block_scores(*inputs, blocks, 40.0)
    expected = in_torch(inputs, blocks, 40.0, monkeypatch)
    inside = blocks.present[:, None, None].expand_as(expected)
    assert native[inside].isfinite().all() and native[inside].min() < -200
    torch.testing.assert_close(native[inside], expected[inside], rtol=1e-6, atol=1e-4)


def test_padding_past_the_context_is_never_read(monkeypatch):
    blocks, inputs = case(2, 3, 16, torch.int32, seed=3)
    expected = in_torch(inputs, blocks, 0.125, monkeypatch)
    tables = blocks.block_tables.clone()
    tables[~blocks.present] = torch.tensor([-1, NUM_BLOCKS, 10**6])[
        torch.arange(int((~blocks.present).sum())) % 3
    ].to(tables.dtype)
    padded = DecodeBlocks(tables, blocks.context_lens, BLOCK)
    got = sketch_block_scores(*inputs, padded, 0.125)
    inside = blocks.present[:, None, None].expand_as(expected)
    torch.testing.assert_close(got[inside], expected[inside], rtol=0, atol=1e-5)
    assert torch.isneginf(got[~inside]).all()


@pytest.mark.parametrize("bad", [-1, NUM_BLOCKS])
def test_a_block_id_inside_the_context_outside_the_cache_is_refused(bad):
    blocks, inputs = case(1, 2, 16, torch.int64, seed=5)
    tables = blocks.block_tables.clone()
    tables[3, 4] = bad  # the fifth of 13 blocks of the 200-token context
    with pytest.raises(IndexError, match="outside"):
        sketch_block_scores(*inputs, DecodeBlocks(tables, blocks.context_lens, BLOCK), 0.125)


def test_without_the_kernels_the_scores_are_left_to_torch(monkeypatch):
    blocks, inputs = case(1, 1, 8, torch.int64, seed=1)
    projected = torch.zeros(len(LENGTHS), 1, 1, 8)
    args = (projected, *inputs[2:], blocks.block_tables, blocks.context_lens, BLOCK, 1.0)
    monkeypatch.setattr(native_kernels, "library", lambda: None)
    assert block_kernels.sketch_block_scores(*args) is None


@pytest.mark.parametrize(("kv_heads", "group", "rank"), [(3, 3, 24), (2, 1, 5)])
def test_native_query_projection_is_torchs(kv_heads, group, rank):
    """The projection both decode paths take (the native decoder's inside its step)."""
    _, (query, query_map, _, _) = case(kv_heads, group, rank, torch.int64, seed=rank)
    native = block_kernels.project_queries(query, query_map)
    assert native is not None
    grouped = query.view(len(LENGTHS), kv_heads, group, DIM)
    expected = torch.einsum("skgd,kdr->skgr", grouped, query_map)
    torch.testing.assert_close(native, expected, rtol=1e-5, atol=1e-5)
