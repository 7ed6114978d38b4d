"""The native single-token pattern from the low-rank key copy (``native/key_sketch.c``'s scores,
``native/token_choice.c``'s choice) against the torch form in ``control/key_sketch.py``, on
random ragged layouts: the same rows, the same tokens in the same order, the same kept shares;
padding past the context never read, a block id inside it refused."""

import pytest
import torch

from etinfer.control.key_sketch import project, sketch_token_pattern
from etinfer.model import block_kernels, native_kernels
from etinfer.model.block_layout import DecodeBlocks
from tests.builds import BUILDS, built_for
from tests.model.test_key_sketch_kernel import case as sketch_case

pytestmark = pytest.mark.skipif(
    native_kernels.compiler() is None or not native_kernels.enabled(), reason="no C compiler"
)
BLOCK, DIM = 16, 32
# Ends mid-block, a single token, exactly a block, several blocks, one past a block.
LENGTHS = [37, 1, 16, 200, 129]
# Fewer than the forced tokens, more than the context, and some in between.
BUDGETS = [5, 3, 64, 50, 100]


def case(kv_heads, group, rank, dtype, seed, lengths=LENGTHS, size=BLOCK):
    return sketch_case(kv_heads, group, rank, dtype, seed, size, lengths, DIM)


def in_torch(inputs, blocks, budgets, sink, recent, monkeypatch, scale=0.125):
    with monkeypatch.context() as patch:
        patch.setattr(block_kernels, "sketch_token_pattern", lambda *args: None)
        return sketch_token_pattern(*inputs, blocks, scale, budgets, sink, recent)


def native_of(inputs, blocks, budgets, sink, recent, scale=0.125):
    """The kernel's answer, called directly (asserting it is not the fallback), and what the
    caller gets from it."""
    projected = project(inputs[0], inputs[1])
    tables, lens, size = blocks.block_tables, blocks.context_lens, blocks.block_size
    args = (projected, *inputs[2:], tables, lens, size, scale, budgets, sink, recent)
    direct = block_kernels.sketch_token_pattern(*args)
    assert direct is not None  # the native form, not the fallback, is what is compared
    pattern, kept = sketch_token_pattern(*inputs, blocks, scale, budgets, sink, recent)
    assert pattern.crow.equal(direct[0]) and pattern.cols.equal(direct[1])
    assert kept.equal(direct[2])
    return pattern, kept


def assert_same(native, expected):
    (pattern, kept), (torch_pattern, torch_kept) = native, expected
    assert pattern.crow.dtype == pattern.cols.dtype == torch.int32
    assert pattern.crow.equal(torch_pattern.crow)
    # Each row's tokens in position order in both: the same list, not only the same set.
    assert pattern.cols.equal(torch_pattern.cols)
    assert not pattern.outside.any() and pattern.outside.shape == pattern.cols.shape
    assert kept.dtype == torch.float32 and kept.shape == torch_kept.shape
    assert kept.equal(torch_kept)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    ("kv_heads", "group", "rank"), [(3, 3, 16), (1, 4, 48), (2, 1, 5), (2, 3, 48)]
)
def test_native_tokens_are_the_torch_ones(kv_heads, group, rank, dtype, monkeypatch):
    blocks, inputs = case(kv_heads, group, rank, dtype, seed=rank * 10 + group)
    budgets = torch.tensor(BUDGETS, dtype=dtype)
    native = native_of(inputs, blocks, budgets, 4, 8)
    expected = in_torch(inputs, blocks, budgets, 4, 8, monkeypatch)
    assert_same(native, expected)
    counts = native[0].crow.diff().view(len(LENGTHS), -1)
    # 12 forced of 37; the whole 1- and 16-token contexts; the budgets of the others.
    assert counts[:, 0].tolist() == [12, 1, 16, 50, 100] and counts.eq(counts[:, :1]).all()
    assert native[1].shape == (len(LENGTHS), kv_heads, 15)


@pytest.mark.parametrize(("sink", "recent"), [(0, 1), (0, 0), (3, 0), (40, 300)])
@pytest.mark.parametrize("budget", [0, 1, 20, 1000])
def test_forced_tokens_and_budgets_at_their_limits(sink, recent, budget, monkeypatch):
    """No sink, no recent tokens, forced ones covering whole contexts; budgets of nothing, one
    token, and past every context (a context of no tokens among them)."""
    blocks, inputs = case(2, 3, 16, torch.int64, seed=budget + sink, lengths=[*LENGTHS, 0])
    budgets = torch.full((len(LENGTHS) + 1,), budget, dtype=torch.int32)
    native = native_of(inputs, blocks, budgets, sink, recent)
    assert_same(native, in_torch(inputs, blocks, budgets, sink, recent, monkeypatch))


@pytest.mark.parametrize(("size", "rank"), [(5, 16), (12, 7), (128, 16)])
def test_blocks_of_any_size(size, rank, monkeypatch):
    blocks, inputs = case(2, 3, rank, torch.int64, seed=size + rank, size=size)
    budgets = torch.tensor(BUDGETS)
    native = native_of(inputs, blocks, budgets, 4, 8)
    assert_same(native, in_torch(inputs, blocks, budgets, 4, 8, monkeypatch))


def test_long_contexts(monkeypatch):
    """Thousands of tokens to choose among: the selection narrows them by a histogram first."""
    blocks, inputs = case(2, 2, 16, torch.int64, seed=11, lengths=[3001, 1500, 2048])
    budgets = torch.tensor([700, 1500, 2047])
    native = native_of(inputs, blocks, budgets, 16, 32)
    assert_same(native, in_torch(inputs, blocks, budgets, 16, 32, monkeypatch))


def test_outlying_scores(monkeypatch):
    """A few tokens scored far above and below the rest: the others crowd into one bin of the
    selection's histogram over the whole range, and it narrows again among them."""
    blocks, inputs = case(1, 3, 16, torch.int64, seed=12, lengths=[4000, 2500])
    query, query_map, codes, code_scales = inputs
    slots = blocks.block_tables[:, :3] * BLOCK + 5  # three tokens of each context
    code_scales = code_scales.clone()
    code_scales[0, slots[:, 0]] *= 1000
    code_scales[0, slots[:, 1]] *= -1000
    code_scales[0, slots[:, 2]] *= 1e-30
    inputs = (query, query_map, codes, code_scales)
    budgets = torch.tensor([900, 2000])
    native = native_of(inputs, blocks, budgets, 0, 1)
    assert_same(native, in_torch(inputs, blocks, budgets, 0, 1, monkeypatch))


def test_tied_scores_are_taken_in_position_order(monkeypatch):
    """Every token of a context scored alike (a key copy of zeros): as many kept as torch keeps,
    the forced ones among them, and then the first others in position order."""
    blocks, inputs = case(2, 2, 16, torch.int64, seed=13, lengths=[3000, 37])
    inputs = (*inputs[:2], torch.zeros_like(inputs[2]), inputs[3])
    budgets = torch.tensor([1000, 20])
    (pattern, kept), (torch_pattern, _) = (
        native_of(inputs, blocks, budgets, 4, 8),
        in_torch(inputs, blocks, budgets, 4, 8, monkeypatch),
    )
    assert pattern.crow.equal(torch_pattern.crow)
    slots = (blocks.block_tables[:, :, None] * BLOCK + torch.arange(BLOCK)).flatten(1)
    num_slots = inputs[3].shape[1]
    for seq, (length, budget) in enumerate(zip([3000, 37], [1000, 20], strict=True)):
        positions = [*range(budget - 8), *range(length - 8, length)]
        for head in range(2):
            row = (seq * 2 + head) * 2
            cols = pattern.cols[pattern.crow[row] : pattern.crow[row + 1]]
            assert cols.tolist() == (head * num_slots + slots[seq, positions]).tolist()
            assert cols.equal(pattern.cols[pattern.crow[row + 1] : pattern.crow[row + 2]])
            share = torch.zeros(slots.shape[1])
            share[positions] = 1
            in_block = blocks.block_tokens[seq].clamp(min=1)
            assert kept[seq, head].equal(share.view(-1, BLOCK).sum(-1) / in_block)


@pytest.mark.parametrize("name", list(BUILDS))
def test_every_build_chooses_the_same_tokens(name, monkeypatch):
    """The portable forms (no AVX2: lanes' masks and the packing of the kept ones, one at a
    time) and the AVX2 ones keep the same tokens."""
    blocks, inputs = case(2, 3, 16, torch.int64, seed=21, lengths=[*LENGTHS, 1500])
    budgets = torch.tensor([*BUDGETS, 600])
    expected = in_torch(inputs, blocks, budgets, 4, 8, monkeypatch)
    library = built_for(name, native_kernels.compiled)
    monkeypatch.setattr(native_kernels, "library", lambda: library)
    assert_same(native_of(inputs, blocks, budgets, 4, 8), expected)


def test_padding_past_the_context_is_never_read(monkeypatch):
    blocks, inputs = case(2, 3, 16, torch.int32, seed=3)
    budgets = torch.tensor(BUDGETS)
    expected = in_torch(inputs, blocks, budgets, 4, 8, monkeypatch)
    tables = blocks.block_tables.clone()
    num_blocks = inputs[2].shape[1] // BLOCK
    tables[~blocks.present] = torch.tensor([-1, num_blocks, 10**6])[
        torch.arange(int((~blocks.present).sum())) % 3
    ].to(tables.dtype)
    padded = DecodeBlocks(tables, blocks.context_lens, BLOCK)
    assert_same(native_of(inputs, padded, budgets, 4, 8), expected)


@pytest.mark.parametrize("bad", [-1, 10**6])
def test_a_block_id_inside_the_context_outside_the_cache_is_refused(bad):
    blocks, inputs = case(1, 2, 16, torch.int64, seed=5)
    tables = blocks.block_tables.clone()
    tables[3, 4] = bad  # the fifth of 13 blocks of the 200-token context
    layout = DecodeBlocks(tables, blocks.context_lens, BLOCK)
    with pytest.raises(IndexError, match="sketch scores: a block id outside"):
        sketch_token_pattern(*inputs, layout, 0.125, torch.tensor(BUDGETS), 4, 8)


def test_without_the_kernels_the_tokens_are_left_to_torch(monkeypatch):
    blocks, inputs = case(1, 1, 8, torch.int64, seed=1)
    projected = torch.zeros(len(LENGTHS), 1, 1, 8)
    args = (projected, *inputs[2:], blocks.block_tables, blocks.context_lens, BLOCK, 1.0)
    args = (*args, torch.tensor(BUDGETS), 4, 8)
    assert block_kernels.sketch_token_pattern(*args) is not None
    monkeypatch.setattr(native_kernels, "library", lambda: None)
    assert block_kernels.sketch_token_pattern(*args) is None
