"""The reused-mass scorer: selection layers attend densely and rank blocks for the layers after
them (mechanics on random caches, no model)."""

import pytest
import torch

from etinfer.control.block_budgets import PruningConfig, selection_layers
from etinfer.control.block_selection import EntropicSelector
from etinfer.model.block_layout import BlockSummaries, DecodeBlocks
from etinfer.model.pruning_telemetry import PrunedLayer, PruningTelemetry
from tests.control.test_pruning import DIM, HEADS, KV_HEADS, filled_cache

REUSED = dict(min_context=0, dense_layers=1, scorer="reused-mass", sink_blocks=1, recent_blocks=1)


def step(lengths, budgets):
    cache, tables = filled_cache(lengths, seed=3)
    blocks = DecodeBlocks(tables, torch.tensor(lengths), 4, torch.tensor(budgets), max(budgets))
    return cache, tables, blocks


def test_later_layers_keep_the_blocks_the_selection_layer_weighed_most():
    cache, tables, blocks = step([80], [4])
    selector = EntropicSelector(PruningConfig(**REUSED, selection_layers=(2,)))
    query = torch.zeros(1, HEADS, DIM)
    assert selector.select(0, query, blocks, cache.summaries(0)) is None  # a dense layer
    assert selector.select(1, query, blocks, cache.summaries(0)) is None  # before selecting
    selecting = cache.summaries(0)  # the selection layer's summaries: attention fills its mass
    assert selector.select(2, query, blocks, selecting) is None
    assert [selector.observes(layer) for layer in range(4)] == [False, False, True, False]
    table = tables[0].tolist()
    selecting.mass.zero_()
    selecting.mass[1, table[7]] = 0.6  # one KV head weighed block 7, the other block 11
    selecting.mass[0, table[11]] = 0.3
    mask = selector.select(3, query, blocks, cache.summaries(0)).mask
    kept = mask[0, 0].nonzero().flatten().tolist()
    assert kept == [0, 7, 11, 19]  # the sink, the two weighed, the most recent
    assert torch.equal(mask[0, 0], mask[0, 1])  # one choice for every KV head
    # Ranked once a step: a later layer of the same step reuses the same mask object.
    assert selector.select(4, query, blocks, cache.summaries(0)).mask is mask


def test_layers_between_selections_also_keep_what_the_next_one_weighed_a_step_before():
    cache, tables, blocks = step([80], [4])
    masses = torch.zeros(4, KV_HEADS, cache.key_bounds.shape[2])  # [layers, kv_heads, blocks]
    summaries = [
        BlockSummaries(cache.key_bounds[0], masses[layer], layer_masses=masses)
        for layer in range(4)
    ]
    selector = EntropicSelector(PruningConfig(**REUSED, selection_layers=(1, 3)))
    query = torch.zeros(1, HEADS, DIM)
    table = tables[0].tolist()
    masses[3, 0, table[5]] = 0.9  # the deep selection layer, the step before
    masses[3, 1, table[9]] = torch.inf  # written since it last ran: no say
    assert selector.select(1, query, blocks, summaries[1]) is None
    masses[1, 1, table[12]] = 0.5  # the first selection layer, this step
    kept = selector.select(2, query, blocks, summaries[2]).mask[0, 0]
    assert kept.nonzero().flatten().tolist() == [0, 5, 12, 19]
    # After the last selection layer only its own mass counts.
    assert selector.select(3, query, blocks, summaries[3]) is None
    masses[3].zero_()
    masses[3, 0, table[7]] = 0.4
    masses[3, 1, table[2]] = 0.3
    kept = selector.select(4, query, blocks, summaries[3]).mask[0, 0]
    assert kept.nonzero().flatten().tolist() == [0, 2, 7, 19]


def test_default_selection_layers_are_the_first_pruned_and_one_at_three_fifths_depth():
    config = PruningConfig(**REUSED | {"dense_layers": 2})
    assert selection_layers(config, range(30)) == (2, 18)
    # Gemma 3: of its global layers a second selection at 11 would serve only 17
    assert selection_layers(config, [5, 11, 17]) == (5,)
    assert selection_layers(config, [5, 11, 17, 23, 29]) == (5, 17)
    assert EntropicSelector(config, full_layers=range(30)).selection_layers == (2, 18)


@pytest.mark.parametrize(
    ("layers", "full", "words"),
    [
        ((3,), [5, 11, 17], "such layers are [5, 11, 17]"),
        ((4, 2), None, "ascending"),
        ((), None, "ascending"),
        ((-1,), None, "selection_layers"),
    ],
)
def test_selection_layers_are_checked_naming_the_field(layers, full, words):
    with pytest.raises(ValueError, match="selection_layers") as error:
        EntropicSelector(PruningConfig(**REUSED, selection_layers=layers), full_layers=full)
    assert words in str(error.value)


def test_an_unknown_scorer_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="reused-mass"):
        PruningConfig(scorer="quest")


def test_a_layer_pruned_without_bounds_certifies_nothing_it_dropped():
    _, _, blocks = step([40, 40], [10, 10])
    in_context = blocks.present[:, None].expand(-1, KV_HEADS, -1)
    telemetry = PruningTelemetry.empty(3, blocks, in_context, DIM**-0.5)
    everything, some = in_context.clone(), in_context.clone()
    some[1, :, 3] = False
    rows = torch.zeros(2 * HEADS)
    telemetry.record(PrunedLayer(1, None, everything, rows, rows + 1))
    telemetry.record(PrunedLayer(2, None, some, rows, rows + 1))
    assert telemetry.dropped_mass.tolist() == [[0.0, 0.0], [0.0, 0.0], [0.0, 1.0]]
    assert telemetry.kept[2].tolist() == [20.0, 18.0]


def test_the_top_p_law_keeps_the_fewest_blocks_that_carry_the_mass_within_the_cap():
    cache, tables, blocks = step([80, 80], [10, 10])
    config = PruningConfig(
        **REUSED, selection_layers=(1,), budget_law="top-p", top_p=0.9, min_blocks=3
    )
    selector = EntropicSelector(config)
    query = torch.zeros(2, HEADS, DIM)
    selecting = cache.summaries(0)
    selector.select(1, query, blocks, selecting)
    selecting.mass.fill_(0.001)
    first, second = tables[0].tolist(), tables[1].tolist()
    selecting.mass[0, first[5]] = 1.0  # row 0: one block carries almost all of the mass
    for i in range(2, 16):  # row 1: spread evenly over many
        selecting.mass[0, second[i]] = 0.5
    kept = selector.select(2, query, blocks, cache.summaries(0)).mask.sum(-1)
    assert kept[0].tolist() == [3, 3]  # the sink, block 5, the recent block
    assert kept[1].tolist() == [10, 10]  # the cap: budget_high's share (the planned budget)


def test_the_top_p_law_needs_measured_masses():
    with pytest.raises(ValueError, match=r"budget_law 'top-p'.*reused-mass"):
        PruningConfig(scorer="bound", budget_law="top-p")
    with pytest.raises(ValueError, match="budget_law must be one of 'entropy', 'fixed', 'top-p'"):
        PruningConfig(budget_law="quest")
    with pytest.raises(ValueError, match="top_p"):
        PruningConfig(scorer="reused-mass", budget_law="top-p", top_p=0.0)
