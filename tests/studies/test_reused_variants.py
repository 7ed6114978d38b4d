"""The pruning study's additions to reused masses (per-head roles, each layer's own key bounds)
and the calibration of roles (mechanics on a random cache, no model)."""

import pytest
import torch

from etinfer.control.block_budgets import PruningConfig
from etinfer.control.block_selection import EntropicSelector
from etinfer.model.block_layout import DecodeBlocks
from studies.laws.oracle_selection import OracleSelector
from studies.laws.reused_variants import HeadRolesSelector, MissedMass, OwnBoundsSelector
from tests.control.test_pruning import BLOCK, DIM, HEADS, KV_HEADS, filled_cache

CONFIG = PruningConfig(
    min_context=0,
    dense_layers=0,
    scorer="reused-mass",
    selection_layers=(0,),
    sink_blocks=1,
    recent_blocks=1,
)
LENGTHS, BUDGETS = [70, 40], [4, 3]


def pruned_layer_mask(selector, cache, tables, query):
    """The mask ``selector`` gives layer 1 after selection layer 0 ran, on fresh step blocks."""
    blocks = DecodeBlocks(tables, torch.tensor(LENGTHS), BLOCK, torch.tensor(BUDGETS), 4)
    selecting = cache.summaries(0)
    weighed = torch.rand(selecting.mass.shape, generator=torch.Generator().manual_seed(2))
    selecting.mass.copy_(weighed)
    assert selector.select(0, query, blocks, selecting) is None
    return selector.select(1, query, blocks, cache.summaries(1)).mask, blocks


def case():
    cache, tables = filled_cache(LENGTHS, seed=11, layers=2)
    query = torch.randn(2, HEADS, DIM, generator=torch.Generator().manual_seed(12))
    reused, blocks = pruned_layer_mask(EntropicSelector(CONFIG), cache, tables, query)
    return cache, tables, query, reused, blocks


def test_retrieval_heads_read_every_block_and_the_others_keep_the_reused_choice():
    cache, tables, query, reused, blocks = case()
    retrieval = torch.zeros(2, KV_HEADS, dtype=torch.bool)
    retrieval[1, 0] = True
    mask, _ = pruned_layer_mask(HeadRolesSelector(CONFIG, retrieval, [0, 1]), cache, tables, query)
    assert torch.equal(mask[:, 0], blocks.present)
    assert torch.equal(mask[:, 1:], reused[:, 1:])
    assert not torch.equal(reused[:, 0], blocks.present)  # the roles changed something


@pytest.mark.parametrize("spread", [None, 2.0])  # the key bounds, or the key digest
def test_own_rankings_add_each_heads_best_blocks_to_the_reused_choice(spread):
    cache, tables, query, reused, blocks = case()
    own = OwnBoundsSelector(CONFIG, 0.2, [0, 1], spread)
    some, _ = pruned_layer_mask(own, cache, tables, query)
    assert torch.equal(some & reused, reused) and (some.sum() > reused.sum())
    every, _ = pruned_layer_mask(
        OwnBoundsSelector(CONFIG, 1.0, [0, 1], spread), cache, tables, query
    )
    assert torch.equal(every, blocks.present[:, None].expand_as(every))


def test_calibration_counts_the_exact_mass_of_the_dropped_blocks_and_ranks_heads_by_it():
    cache, tables, query, _, _ = case()
    calibration = MissedMass(CONFIG, cache, 2, [0, 1])
    mask, blocks = pruned_layer_mask(calibration, cache, tables, query)
    exact = OracleSelector(CONFIG, cache, full_layers=[0, 1]).block_scores(
        1, query, blocks, None, None
    )
    assert torch.allclose(calibration.missed[1], (exact * ~mask).sum((0, 2)))
    assert (calibration.missed[0] == 0).all()  # the selection layer drops nothing
    worst = calibration.missed[1].argmax()
    roles = calibration.with_retrieval_heads(1 / KV_HEADS).retrieval
    assert roles.sum() == 1 and roles[1, worst]


@pytest.mark.parametrize("whitened", [False, True])
def test_a_low_rank_key_copy_ranks_as_the_exact_scores_where_it_loses_nothing(whitened):
    """Calibrated on the layer's own keys and queries: at full rank and 8 bits the copy's masses
    are the oracle's within the rounding; at a rank below the keys' own they are not, and its
    bytes follow rank and bits."""
    from studies.laws.low_rank_sketch import LowRankSketchSelector

    cache, tables = filled_cache(LENGTHS, seed=11, layers=2)
    query = torch.randn(2, HEADS, DIM, generator=torch.Generator().manual_seed(12))
    blocks = DecodeBlocks(tables, torch.tensor(LENGTHS), BLOCK, torch.tensor(BUDGETS), 4)
    config = PruningConfig(min_context=0, dense_layers=0, scorer="bound")
    exact = OracleSelector(config, cache).block_scores(1, query, blocks, None, None)

    def scores(rank: int, bits: int) -> torch.Tensor:
        sketch = LowRankSketchSelector(config, cache, rank, bits, whitened)
        for seed in range(8):  # calibration: exact scores, the queries and keys kept
            more = torch.randn(2, HEADS, DIM, generator=torch.Generator().manual_seed(seed))
            sketch.block_scores(1, more, blocks, None, None)
        sketch.finish_calibration()
        assert sketch.sketch_share == rank * bits / (2 * DIM * 16)
        return sketch.block_scores(1, query, blocks, None, None)

    torch.testing.assert_close(scores(DIM, 8), exact, atol=0.02, rtol=0)
    assert (scores(2, 4) - exact).abs().max() > 0.05
