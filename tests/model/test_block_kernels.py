"""The native forms of block-sparse decode's bookkeeping against their torch forms, on random
layouts: the decode pattern bit for bit, the key-bound scores up to float rounding, the best
blocks exactly, the block summaries and masses the cache keeps."""

import pytest
import torch

from etinfer.control.block_scores import (
    best_of,
    key_bound_scores,
    key_digest_scores,
    signed_parts,
)
from etinfer.model import block_kernels, native_kernels
from etinfer.model.attention.pattern import build_decode_pattern, decode_pattern, visible_blocks
from etinfer.model.attention.pruned_decode import observe_mass
from etinfer.model.block_layout import BlockSummaries, DecodeBlocks
from etinfer.model.kv_cache import KVCache

pytestmark = pytest.mark.skipif(
    native_kernels.compiler() is None or not native_kernels.enabled(), reason="no C compiler"
)
BLOCK, NUM_BLOCKS = 16, 64


def layout(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // BLOCK) for n in lengths) + 2  # padding past every row's end
    tables = torch.stack([torch.randperm(NUM_BLOCKS, generator=gen)[:width] for _ in lengths])
    return DecodeBlocks(tables, torch.tensor(lengths), BLOCK), gen


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize(("kv_heads", "group"), [(3, 3), (2, 1), (1, 4)])
@pytest.mark.parametrize("keep", [None, 0.0, 0.3, 1.0])
def test_the_native_decode_pattern_is_the_torch_one_bit_for_bit(window, kv_heads, group, keep):
    blocks, gen = layout([1, 16, 17, 90, 255, 300], seed=kv_heads * 10 + group)
    mask = None
    if keep is not None:
        mask = torch.rand(6, kv_heads, blocks.block_tables.shape[1], generator=gen) < keep
    visible, pattern = decode_pattern(blocks, kv_heads, group, NUM_BLOCKS * BLOCK, mask, window)
    expected_visible = visible_blocks(blocks, kv_heads, mask, window)
    expected = build_decode_pattern(blocks, expected_visible, group, NUM_BLOCKS * BLOCK, window)
    assert torch.equal(visible, expected_visible)
    for name in ("crow", "cols", "outside", "masked"):
        assert torch.equal(getattr(pattern, name), getattr(expected, name)), name


def test_without_the_kernels_the_pattern_is_built_in_torch(monkeypatch):
    blocks, _ = layout([5, 70], seed=1)
    native = decode_pattern(blocks, 3, 3, NUM_BLOCKS * BLOCK)[1]
    monkeypatch.setattr(native_kernels, "library", lambda: None)
    assert (
        block_kernels.decode_pattern(
            blocks.block_tables, blocks.context_lens, BLOCK, 3, 3, NUM_BLOCKS, None, None
        )
        is None
    )
    fallback = decode_pattern(blocks, 3, 3, NUM_BLOCKS * BLOCK)[1]
    assert torch.equal(native.cols, fallback.cols) and torch.equal(native.crow, fallback.crow)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("kv_heads", "group", "dim"), [(3, 3, 64), (2, 4, 128), (1, 1, 8)])
def test_native_key_bounds_are_the_signed_matmul(kv_heads, group, dim, dtype):
    """In float32, or in a 16-bit cache's own type (the cache keeps its bounds so)."""
    blocks, gen = layout([40, 200, 9], seed=dim)
    keys = torch.randn(kv_heads, NUM_BLOCKS, 2, dim, generator=gen)
    bounds = torch.stack([keys.amax(2), keys.amin(2)], dim=2).to(dtype)  # maxima, then minima
    query = torch.randn(3, kv_heads * group, dim, generator=gen)
    got = key_bound_scores(query, BlockSummaries(bounds), blocks.block_tables)
    gathered = bounds[:, blocks.block_tables].flatten(-2).float()  # [kv, seqs, width, 2 * dim]
    parts = signed_parts(query).view(3, kv_heads, group, 2 * dim)
    expected = torch.einsum("skgc,kswc->skgw", parts, gathered)
    assert got.shape == (3, kv_heads, group, blocks.block_tables.shape[1])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("kv_heads", "group", "dim"), [(3, 3, 64), (1, 1, 8)])
def test_native_key_digests_are_the_torch_ones(kv_heads, group, dim, monkeypatch):
    blocks, gen = layout([40, 200, 9], seed=dim)
    keys = torch.randn(kv_heads, NUM_BLOCKS, BLOCK, dim, generator=gen) * 3 + 1
    moments = torch.stack([keys.sum(2), keys.square().sum(2)], dim=2)
    summaries = BlockSummaries(torch.empty(0), key_moments=moments)
    query = torch.randn(3, kv_heads * group, dim, generator=gen)
    native = key_digest_scores(query, summaries, blocks, 1.5)
    monkeypatch.setattr(native_kernels, "library", lambda: None)
    fallback = key_digest_scores(query, summaries, blocks, 1.5)
    torch.testing.assert_close(native, fallback, rtol=1e-4, atol=1e-3)


def test_a_block_id_outside_the_cache_is_refused():
    blocks, _ = layout([40], seed=3)
    tables = blocks.block_tables.clone()
    tables[0, 1] = NUM_BLOCKS
    with pytest.raises(IndexError, match="outside"):
        block_kernels.decode_pattern(
            tables, blocks.context_lens, BLOCK, 1, 1, NUM_BLOCKS, None, None
        )
    bounds = torch.zeros(1, NUM_BLOCKS, 2, 8)
    with pytest.raises(IndexError, match="outside"):
        block_kernels.key_bound_scores(torch.zeros(1, 1, 8), bounds, tables)


@pytest.mark.parametrize("width", [1, 7, 500])
def test_native_keep_largest_is_the_top_k_mask(width, monkeypatch):
    gen = torch.Generator().manual_seed(width)
    scores = torch.randn(4, 3, width, generator=gen)
    scores[0, 0, 0] = torch.inf  # forced blocks rank first, missing ones last
    scores[1, :, -1] = -torch.inf
    budgets = torch.randint(0, width + 1, (4, 3), generator=gen)
    got = best_of(scores, budgets, None)
    monkeypatch.setattr(native_kernels, "library", lambda: None)
    expected = best_of(scores, budgets, None)
    assert torch.equal(got, expected)
    assert torch.equal(got.sum(-1), budgets)


def test_keep_largest_takes_exactly_the_budget_through_ties_and_nan():
    scores = torch.tensor([[1.0, 2.0, 2.0, 2.0, float("nan"), 0.0]])
    got = block_kernels.keep_largest(scores, torch.tensor([3]))
    assert got.tolist() == [[False, True, True, True, False, False]]
    got = block_kernels.keep_largest(scores, torch.tensor([2]))
    assert got.tolist() == [[False, True, True, False, False, False]]  # ties in index order
    got = block_kernels.keep_largest(scores, torch.tensor([6]))
    assert got.all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
def test_native_block_summaries_are_the_torch_ones(dtype):
    """Three steps of writes (blocks starting fresh, several rows into one block, a block
    written again) keep the same key bounds (exactly: they are stored keys), value sums, key
    moments and masses in C as in torch."""
    caches = [
        KVCache(2, 8, 4, 3, 16, torch.device("cpu"), dtype, summaries=True, moments=True)
        for _ in range(2)
    ]
    caches[1].native = False  # the torch form
    gen = torch.Generator().manual_seed(5)
    for cache in caches:
        for tensor in cache.tensors:
            tensor.zero_()
    for slots, fresh in (([0, 1, 2, 8], [0, 2]), ([3, 9, 10], []), ([4, 5, 11], [1])):
        keys, values = torch.randn(2, len(slots), 3, 16, generator=gen) * 3
        for cache in caches:
            for layer in range(2):
                cache.write(layer, torch.tensor(slots), torch.tensor(fresh), keys, values)
    native, torch_form = caches
    assert torch.equal(native.key_bounds, torch_form.key_bounds)
    assert torch.equal(native.mass, torch_form.mass)  # +inf at every block begun, else 0
    torch.testing.assert_close(native.value_sums, torch_form.value_sums, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(native.key_moments, torch_form.key_moments, rtol=1e-6, atol=1e-5)


def test_native_block_mass_is_the_torch_one():
    blocks, gen = layout([5, 40, 300], seed=3)
    kv_heads, group = 2, 3
    _, pattern = decode_pattern(blocks, kv_heads, group, NUM_BLOCKS * BLOCK)
    weights = torch.rand(pattern.nnz, generator=gen)
    denominators = torch.rand(pattern.crow.numel() - 1, generator=gen) + 1
    masses = [torch.full((kv_heads, NUM_BLOCKS), 7.0) for _ in range(2)]
    observe_mass(masses[0], pattern, weights, denominators, BLOCK, group)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(block_kernels, "observe_block_mass", lambda *args: False)
        observe_mass(masses[1], pattern, weights, denominators, BLOCK, group)
    torch.testing.assert_close(masses[0], masses[1], rtol=1e-6, atol=1e-7)
    assert (masses[0] == 7.0).sum() > 0 and (masses[0] != 7.0).sum() > 0  # only blocks read
