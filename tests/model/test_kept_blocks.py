"""A pruned step's kept blocks in fixed shapes (``attention/kept_blocks.py``), the form a step
replayed from a CUDA graph reads: its attention equals the eager pattern's; the selection behind
it, with the budgets a device tensor and no largest budget known on the host, is the eager
selection bit for bit; and selection and compaction trace as one graph, no break, no shape
that depends on a value (what capture needs: no host sync, no host-built index)."""

import pytest
import torch

from etinfer.control.block_budgets import PruningConfig
from etinfer.control.block_selection import EntropicSelector
from etinfer.model import native_kernels
from etinfer.model.attention.kept_blocks import attend_kept, kept_blocks
from etinfer.model.attention.pattern import build_decode_pattern, visible_blocks
from etinfer.model.attention.torch_backend import pattern_attention
from etinfer.model.block_layout import BlockSummaries, DecodeBlocks

KV_HEADS, GROUP, BLOCK, NUM_BLOCKS, DIM = 2, 3, 4, 64, 16


def layout(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // BLOCK) for n in lengths)
    tables = torch.stack([torch.randperm(NUM_BLOCKS, generator=gen)[:width] for _ in lengths])
    return DecodeBlocks(tables, torch.tensor(lengths), BLOCK), gen


@pytest.mark.parametrize("keep", [0.0, 0.3, 1.0])
def test_attention_over_kept_tables_equals_the_eager_pattern(keep):
    blocks, gen = layout([37, 5, 61, 16])
    rows, width = blocks.block_tables.shape
    keys = torch.randn(KV_HEADS, NUM_BLOCKS * BLOCK, DIM, generator=gen)
    values = torch.randn(KV_HEADS, NUM_BLOCKS * BLOCK, DIM, generator=gen)
    q = torch.randn(rows, KV_HEADS * GROUP, DIM, generator=gen)
    mask = torch.rand(rows, KV_HEADS, width, generator=gen) < keep
    visible = visible_blocks(blocks, KV_HEADS, mask, None)
    pattern = build_decode_pattern(blocks, visible, GROUP, NUM_BLOCKS * BLOCK)
    expected = pattern_attention(
        q.flatten(0, 1), keys.flatten(0, 1), values.flatten(0, 1), pattern, DIM**-0.5
    )[0]
    kept = kept_blocks(mask, blocks.block_tables, blocks.block_tokens)
    assert torch.equal(kept.counts, (visible & blocks.present[:, None]).sum(-1))
    got = attend_kept(q, keys, values, kept, BLOCK, DIM**-0.5)
    torch.testing.assert_close(got.flatten(0, 1), expected, rtol=1e-5, atol=1e-6)


def selection_case(scorer, seed=1):
    blocks, gen = layout([200, 64, 137], seed)
    rows = blocks.block_tables.shape[0]
    bounds = torch.randn(KV_HEADS, NUM_BLOCKS, 2, DIM, generator=gen)
    bounds = torch.stack([bounds.amax(2), bounds.amin(2)], 2)
    mass = torch.rand(KV_HEADS, NUM_BLOCKS, generator=gen)
    mass[:, :3] = mass[:, 5:6]  # ties
    summaries = BlockSummaries(bounds, mass=mass, layer_masses={0: mass, 18: mass.flip(1)})
    query = torch.randn(rows, KV_HEADS * GROUP, DIM, generator=gen)
    config = PruningConfig(scorer=scorer, dense_layers=0, sink_blocks=1, recent_blocks=2)
    selector = EntropicSelector(config, full_layers=range(30))  # reused-mass: layers 0 and 18
    return selector, blocks, summaries, query


def select(selector, blocks, summaries, query, budgets, max_budget):
    """The selection of layer 2 (after reused-mass's selection layer 0), on a fresh layout."""
    fresh = DecodeBlocks(blocks.block_tables, blocks.context_lens, BLOCK, budgets, max_budget)
    if selector.selects_without_query:
        selector.select(0, query, fresh, summaries)
    return selector.select(2, query, fresh, summaries).mask


@pytest.mark.parametrize("scorer", ["bound", "digest", "reused-mass"])
def test_the_selection_with_device_budgets_is_the_eager_one(scorer, monkeypatch):
    monkeypatch.setattr(native_kernels, "library", lambda: None)  # torch's top-k, as on a GPU
    selector, blocks, summaries, query = selection_case(scorer)
    if scorer == "digest":
        summaries.key_moments = torch.rand(KV_HEADS, NUM_BLOCKS, 2, DIM) + 1
    budgets = torch.tensor([9, 4, 20])
    eager = select(selector, blocks, summaries, query, budgets, int(budgets.max()))
    static = select(selector, blocks, summaries, query, budgets, 0)
    assert torch.equal(eager, static)
    assert (static.sum(-1) <= budgets[:, None]).all()


@pytest.mark.parametrize("scorer", ["reused-mass", "digest"])
def test_selection_and_compaction_trace_as_one_graph(scorer, monkeypatch):
    """torch.compile with fullgraph=True refuses a graph break: a .item(), a tensor read on the
    host or a shape that follows a value would each be one. (The bounds' torch form builds a
    sparse CSR structure for its sampled matmul, which the compiler refuses: a graph would
    score them by a gathered matmul instead.)"""
    monkeypatch.setattr(native_kernels, "library", lambda: None)
    selector, blocks, summaries, query = selection_case(scorer)
    if scorer == "digest":
        summaries.key_moments = torch.rand(KV_HEADS, NUM_BLOCKS, 2, DIM) + 1

    def step(fresh: DecodeBlocks) -> tuple[torch.Tensor, torch.Tensor]:
        if selector.selects_without_query:
            selector.select(0, query, fresh, summaries)
        mask = selector.select(2, query, fresh, summaries).mask
        kept = kept_blocks(mask, fresh.block_tables, fresh.block_tokens)
        return kept.tables, kept.counts

    def layout_with(budgets: torch.Tensor) -> DecodeBlocks:
        """The step's layout, its budgets a tensor and no largest budget known on the host
        (the layout's own derived tensors made first: Python 3.11's cached_property takes a
        lock, which the compiler does not enter)."""
        fresh = DecodeBlocks(blocks.block_tables, blocks.context_lens, BLOCK, budgets, 0)
        fresh.present  # noqa: B018
        return fresh

    traced = torch.compile(step, backend="eager", fullgraph=True, dynamic=False)
    for budgets in (torch.tensor([9, 4, 20]), torch.tensor([3, 16, 5])):
        tables, counts = traced(layout_with(budgets))
        expected_tables, expected_counts = step(layout_with(budgets))
        assert torch.equal(tables, expected_tables) and torch.equal(counts, expected_counts)
        assert (counts <= budgets[:, None] + 1).all()  # the current block besides the budget
