"""Entropic block pruning, mechanics on random caches (no model)."""

import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from etinfer.control.block_budgets import PruningConfig, block_budget, plan_budget
from etinfer.control.block_scores import key_bound_scores, value_weighted
from etinfer.control.block_selection import DenseSelector, EntropicSelector
from etinfer.model.attention.metadata import AttentionMetadata
from etinfer.model.attention.pattern import build_decode_pattern, visible_blocks
from etinfer.model.block_layout import BlockSummaries, DecodeBlocks
from etinfer.model.kv_cache import KVCache
from etinfer.model.pruning_telemetry import PruningTelemetry
from tests.conftest import rows_read
from tests.model.test_paged_attention import paged_attention

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 16, 4
GROUP = HEADS // KV_HEADS


def filled_cache(lengths, num_blocks=64, seed=0, chunk=3, dtype=torch.float32, layers=1):
    """A cache with key bounds, filled through ``KVCache.write`` in chunks of ``chunk`` tokens
    per sequence (so bounds grow across writes), with blocks previously used by other data;
    every layer holds the same entries."""
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache(
        layers, num_blocks, BLOCK, KV_HEADS, DIM, torch.device("cpu"), dtype, True, moments=True
    )
    # Stale contents from an earlier owner of every block: bounds must reset on reuse.
    cache.key_bounds[..., 0, :] = 100.0  # stale maxima
    cache.key_bounds[..., 1, :] = -100.0  # stale minima
    cache.key_moments.fill_(100.0)  # stale sums of keys and of their squares
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[order.pop() for _ in range(-(-n // BLOCK))] for n in lengths]
    for table, n in zip(tables, lengths, strict=True):
        for start in range(0, n, chunk):
            positions = torch.arange(start, min(start + chunk, n))
            slots = torch.tensor(
                [table[p // BLOCK] * BLOCK + p % BLOCK for p in positions.tolist()]
            )
            fresh = slots[slots % BLOCK == 0] // BLOCK
            keys = torch.randn(len(positions), KV_HEADS, DIM, generator=gen) * 2
            values = torch.randn(len(positions), KV_HEADS, DIM, generator=gen)
            for layer in range(layers):
                cache.write(layer, slots, fresh, keys, values)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    return cache, padded


def context_keys(cache, table, n):
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
    return cache.read(0, slots)  # [kv_heads, n, dim] each, float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=4), st.integers(0, 10_000))
def test_key_bounds_are_upper_bounds_of_every_score_in_the_block(dtype, lengths, seed):
    """Over the keys as stored: a float16 cache keeps its bounds in float16, exactly."""
    cache, tables = filled_cache(lengths, seed=seed, dtype=dtype)
    assert cache.key_bounds.dtype == dtype
    query = torch.randn(len(lengths), HEADS, DIM, generator=torch.Generator().manual_seed(seed + 1))
    bounds = key_bound_scores(query, cache.summaries(0), tables)  # [seqs, kv, group, blocks]
    for i, n in enumerate(lengths):
        keys, _ = context_keys(cache, tables[i].tolist(), n)
        q = query[i].view(KV_HEADS, GROUP, DIM)
        scores = q @ keys.transpose(1, 2)  # [kv, group, n]
        for block in range(-(-n // BLOCK)):
            inside = scores[:, :, block * BLOCK : (block + 1) * BLOCK]
            assert (inside.amax(-1) <= bounds[i, :, :, block] + 1e-4).all()


def test_budget_follows_entropy_and_respects_every_floor():
    config = PruningConfig(
        scorer="bound",
        min_blocks=8,
        budget_low=0.125,
        budget_high=0.5,
        entropy_floor=0.5,
        entropy_high=4.0,
    )
    assert block_budget(0.0, 512, None, config) == 64  # below the floor: the floor's budget
    assert block_budget(0.5, 512, None, config) == 64
    assert block_budget(2.25, 512, None, config) == math.ceil((0.125 + 0.375 * 0.5) * 512)
    assert block_budget(9.0, 512, None, config) == 256
    assert block_budget(0.0, 20, None, config) == 8  # never under the minimum budget
    assert block_budget(0.0, 5, None, config) == 5  # nor over what exists
    assert (
        block_budget(
            0.0,
            1,
            None,
            PruningConfig(
                scorer="bound", min_blocks=1, sink_blocks=0, recent_blocks=1, budget_low=0.001
            ),
        )
        == 1
    )  # never 0
    budgets = [block_budget(h, 512, None, config) for h in (0.0, 1.0, 2.0, 3.0, 4.0, 5.0)]
    assert budgets == sorted(budgets)


def test_budget_shrinks_at_a_limited_rate_and_grows_at_once():
    config = PruningConfig(scorer="bound", max_shrink=0.25)
    assert block_budget(0.0, 512, 256, config) == 192  # wanted 64: at most a quarter less
    assert block_budget(9.0, 512, 64, config) == 256  # growing is immediate
    # A small budget still shrinks by a block a step instead of rounding back to itself.
    slow = PruningConfig(scorer="bound", max_shrink=0.05, min_blocks=8)
    assert block_budget(0.0, 64, 19, slow) == 18
    assert block_budget(0.0, 64, 19, PruningConfig(scorer="bound", max_shrink=0.0)) == 19


def test_plan_budget_attends_densely_where_the_guards_say():
    config = PruningConfig(scorer="bound", min_context=100, min_blocks=3, max_shrink=0.5)
    plan = partial(plan_budget, config=config, block_size=BLOCK)
    assert plan(None, 120, None, False) == 30  # no entropy measured yet
    assert plan(0.0, 60, None, False) == 15  # a context under min_context
    assert plan(0.0, 120, 4, True) == 30  # a refresh step of the mass scorer
    # Pruning starts from the dense budget, under the rate limit: 30, then 15, then 8...
    assert plan(0.0, 120, None, False) == 15
    assert plan(0.0, 120, 15, False) == 8


@pytest.mark.parametrize(
    ("scorer", "decoding", "paying"),
    [("bound", 1, 8192), ("bound", 8, 8192), ("reused-mass", 1, 3072), ("reused-mass", 7, 3072),
     ("reused-mass", 8, 1024), ("reused-mass", 32, 1024)],
)  # fmt: skip
def test_by_default_each_scorer_prunes_from_where_it_pays_at_a_steps_batch(
    scorer, decoding, paying
):
    config = PruningConfig(scorer=scorer, max_shrink=1.0)
    in_context = paying // 16
    assert plan_budget(0.0, paying - 1, None, False, config, 16, decoding) == in_context  # dense
    assert plan_budget(0.0, paying, None, False, config, 16, decoding) < in_context


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("scorer", "oracle"),
        ("min_blocks", 0),
        ("min_blocks", 2),  # fewer than the sink and recent blocks always kept (1 + 2)
        ("budget_low", 0.0),
        ("budget_high", 1.5),
        ("entropy_high", 0.1),
    ],
)
def test_pruning_config_is_validated(field, value):
    with pytest.raises(ValueError, match=field):
        PruningConfig(**{field: value})


def select(lengths, budgets, config, layer=5, seed=0):
    cache, tables = filled_cache(lengths, seed=seed)
    blocks = DecodeBlocks(tables, torch.tensor(lengths), BLOCK, torch.tensor(budgets), max(budgets))
    query = torch.randn(len(lengths), HEADS, DIM, generator=torch.Generator().manual_seed(seed))
    selection = EntropicSelector(config).select(layer, query, blocks, cache.summaries(0))
    return (None if selection is None else selection.mask), blocks


def test_selector_keeps_sink_recent_and_budget_per_head():
    config = PruningConfig(
        scorer="bound", min_context=0, dense_layers=0, sink_blocks=1, recent_blocks=2
    )
    mask, _ = select([120, 61], [6, 4], config)  # 30 and 16 blocks
    assert mask.shape == (2, KV_HEADS, 30)
    assert mask.sum(-1).tolist() == [[6, 6], [4, 4]]
    assert mask[:, :, 0].all()  # sink
    assert mask[0, :, 28:30].all() and mask[1, :, 14:16].all()  # the two most recent blocks
    assert not mask[1, :, 16:].any()  # nothing beyond the context


def test_selector_is_dense_in_the_first_layers_and_keeps_each_sequences_budget():
    config = PruningConfig(scorer="bound", min_context=100, dense_layers=2)
    assert select([120], [4], config, layer=1)[0] is None  # a dense layer
    mask, _ = select([60, 120], [15, 4], config)
    assert mask[0].sum(-1).tolist() == [15, 15]  # a dense budget keeps all 15 blocks
    assert mask[1].sum(-1).tolist() == [4, 4]


def test_head_budgets_give_the_spread_head_more_blocks_at_the_same_total():
    config = PruningConfig(
        scorer="bound", min_context=0, head_budgets=True, head_floor=0.0, min_blocks=4
    )
    cache, tables = filled_cache([120])  # 30 blocks
    blocks = DecodeBlocks(tables, torch.tensor([120]), BLOCK, torch.tensor([10]), 10)
    # KV head 0's queries are zero (uniform attention over every block), head 1's large: its
    # estimate concentrates on the few blocks with the largest key bounds.
    query = torch.zeros(1, HEADS, DIM)
    query[0, GROUP:] = 20 * torch.randn(GROUP, DIM, generator=torch.Generator().manual_seed(1))
    mask = EntropicSelector(config).select(5, query, blocks, cache.summaries(0)).mask
    kept = mask.sum(-1)[0].tolist()
    assert kept[0] > 10 > kept[1] >= config.min_blocks
    assert abs(sum(kept) - 2 * 10) <= 1  # the same blocks read, up to rounding


def test_a_full_head_floor_gives_every_head_the_rows_budget():
    cache, tables = filled_cache([120])
    blocks = DecodeBlocks(tables, torch.tensor([120]), BLOCK, torch.tensor([10]), 10)
    query = torch.randn(1, HEADS, DIM, generator=torch.Generator().manual_seed(2))
    shared = EntropicSelector(PruningConfig(scorer="bound", min_context=0, min_blocks=4))
    floored = EntropicSelector(
        PruningConfig(
            scorer="bound", min_context=0, min_blocks=4, head_budgets=True, head_floor=1.0
        )
    )
    summaries = cache.summaries(0)
    assert torch.equal(
        shared.select(5, query, blocks, summaries).mask,
        floored.select(5, query, blocks, summaries).mask,
    )


def test_the_value_factor_prefers_the_block_whose_values_differ():
    cache, tables = filled_cache([32])  # 8 blocks
    summaries = cache.summaries(0)
    blocks = DecodeBlocks(tables, torch.tensor([32]), BLOCK)
    sums = summaries.value_sums
    sums[:, tables[0]] = 0.0
    sums[:, tables[0, 3]] = 4.0 * BLOCK  # block 3's values stand apart from the others
    logits = torch.zeros(1, KV_HEADS, 8)  # equal key bounds everywhere
    scores = value_weighted(logits, summaries, blocks)
    assert (scores[0, :, 3] > scores[0, :, [0, 1, 2, 4, 5, 6, 7]].max(-1).values).all()


def test_mass_scorer_keeps_sink_and_recent_blocks_before_unseen_ones():
    config = PruningConfig(min_context=0, scorer="mass", min_blocks=4)
    cache, tables = filled_cache([80])  # 20 blocks, none attended to yet: infinite mass
    cache.mass.fill_(torch.inf)
    blocks = DecodeBlocks(tables, torch.tensor([80]), BLOCK, torch.tensor([4]), 4)
    query = torch.randn(1, HEADS, DIM)
    mask = EntropicSelector(config).select(5, query, blocks, cache.summaries(0)).mask
    assert mask[:, :, [0, 18, 19]].all() and mask.sum(-1).tolist() == [[4, 4]]


def test_block_pattern_equals_token_level_reference():
    lengths, window = [1, 7, 33, 50], 10
    cache, tables = filled_cache(lengths)
    blocks = DecodeBlocks(tables, torch.tensor(lengths), BLOCK)
    mask = (
        torch.rand(4, KV_HEADS, tables.shape[1], generator=torch.Generator().manual_seed(4)) < 0.5
    )
    for use_window in (None, window):
        visible = visible_blocks(blocks, KV_HEADS, mask, use_window)
        pattern = build_decode_pattern(blocks, visible, GROUP, cache.num_slots, use_window)
        rows = rows_read(pattern)
        for i, n in enumerate(lengths):
            for h in range(HEADS):
                kv = h // GROUP
                row = i * HEADS + h
                got = rows[row]
                expected = [
                    kv * cache.num_slots + tables[i, p // BLOCK].item() * BLOCK + p % BLOCK
                    for p in range(n)
                    if visible[i, kv, p // BLOCK] and (use_window is None or p >= n - use_window)
                ]
                assert got == expected


def last_slots(tables: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The cache slot of each sequence's current (last) token."""
    return torch.tensor(
        [
            t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK
            for t, n in zip(tables.tolist(), lengths, strict=True)
        ]
    )


def decode_inputs(lengths: list[int], budgets: list[int], seed: int):
    """A filled cache and one decode step over it: the layout with ``budgets``, random queries,
    the current tokens' slots, keys and values, and the dense pattern."""
    cache, tables = filled_cache(lengths, seed=seed)
    blocks = DecodeBlocks(tables, torch.tensor(lengths), BLOCK, torch.tensor(budgets), max(budgets))
    generator = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(len(lengths), HEADS, DIM, generator=generator)
    last = last_slots(tables, lengths)
    keys, values = cache.keys[0][:, last].transpose(0, 1), cache.values[0][:, last].transpose(0, 1)
    dense = build_decode_pattern(blocks, visible_blocks(blocks, KV_HEADS), GROUP, cache.num_slots)
    return cache, tables, blocks, query, last, keys, values, dense


def test_dropped_mass_bound_holds_and_certifies():
    lengths = [64, 40]
    cache, tables, blocks, query, last, keys, values, dense = decode_inputs(lengths, [5, 3], 7)
    config = PruningConfig(
        scorer="bound", min_context=0, dense_layers=0, sink_blocks=1, recent_blocks=1
    )
    attention = paged_attention(EntropicSelector(config))
    visible = visible_blocks(blocks, KV_HEADS)
    telemetry = PruningTelemetry.empty(1, blocks, visible, DIM**-0.5)
    meta = AttentionMetadata(last, 2, blocks, dense, [], None, telemetry)
    attention(0, query, keys, values, cache, meta)
    mask = attention.selector.select(0, query, blocks, cache.summaries(0)).mask
    kept = visible_blocks(blocks, KV_HEADS, mask)
    for i, n in enumerate(lengths):
        context_k, _ = context_keys(cache, tables[i].tolist(), n)
        probs = (
            query[i].view(KV_HEADS, GROUP, DIM) @ context_k.transpose(1, 2) / DIM**0.5
        ).softmax(-1)
        token_kept = kept[i].repeat_interleave(BLOCK, dim=-1)[:, :n]
        actual = (probs * ~token_kept[:, None, :]).sum(-1).max()
        assert actual <= telemetry.dropped_mass[0, i] + 1e-6
        assert telemetry.kept[0, i] == kept[i].sum()
        assert telemetry.total[0, i] == visible[i].sum()


def test_keeping_every_block_equals_dense_exactly():
    cache, _, blocks, query, last, keys, values, dense = decode_inputs([64, 40], [16, 10], 3)
    everything = PruningConfig(
        scorer="bound", min_context=0, dense_layers=0, budget_low=1.0, budget_high=1.0
    )
    outs = []
    for selector in (EntropicSelector(everything), None):
        attention = paged_attention(selector or DenseSelector())
        outs.append(
            attention(0, query, keys, values, cache, AttentionMetadata(last, 2, blocks, dense, []))
        )
    assert torch.equal(outs[0], outs[1])


def test_mass_scorer_ranks_by_observed_attention():
    lengths = [80]
    cache, tables = filled_cache(lengths, seed=5)
    summaries: BlockSummaries = cache.summaries(0)
    summaries.mass.zero_()
    table = tables[0].tolist()
    summaries.mass[:, table[7]] = 0.9  # a block the heads attended to heavily last time
    config = PruningConfig(
        min_context=0, dense_layers=0, scorer="mass", sink_blocks=1, recent_blocks=1
    )
    blocks = DecodeBlocks(tables, torch.tensor(lengths), BLOCK, torch.tensor([3]), 3)
    mask = EntropicSelector(config).select(3, torch.zeros(1, HEADS, DIM), blocks, summaries).mask
    assert mask[0, :, 7].all()
    assert mask[0].sum(-1).tolist() == [3, 3]


def oracle_case():
    """Two sequences of 37 and 22 tokens keeping 5 and 3 blocks, a query, and the config."""
    lengths, budgets = [37, 22], [5, 3]
    cache, tables = filled_cache(lengths, seed=7)
    query = torch.randn(2, HEADS, DIM, generator=torch.Generator().manual_seed(8))
    config = PruningConfig(
        scorer="bound", min_context=0, dense_layers=0, sink_blocks=1, recent_blocks=1
    )
    blocks = DecodeBlocks(tables, torch.tensor(lengths), BLOCK, torch.tensor(budgets), 5)
    return lengths, budgets, cache, tables, query, config, blocks


def test_oracle_keeps_the_budget_and_the_blocks_of_largest_exact_mass():
    from studies.laws.oracle_selection import OracleSelector

    lengths, budgets, cache, tables, query, config, blocks = oracle_case()
    mask = OracleSelector(config, cache).select(0, query, blocks, cache.summaries(0)).mask
    for i, n in enumerate(lengths):
        assert mask[i].sum(-1).tolist() == [budgets[i]] * KV_HEADS
        keys, _ = context_keys(cache, tables[i].tolist(), n)
        probs = (query[i].view(KV_HEADS, GROUP, DIM) @ keys.transpose(1, 2) / DIM**0.5).softmax(-1)
        count = -(-n // BLOCK)
        padded = F.pad(probs, (0, count * BLOCK - n)).view(KV_HEADS, GROUP, count, BLOCK)
        mass = padded.sum(-1).amax(1)  # [kv, blocks]
        for head in range(KV_HEADS):
            kept = mask[i, head, :count]
            assert kept[0] and kept[count - 1]  # sink and recent
            ranked = kept.clone()
            ranked[[0, count - 1]] = False
            dropped = ~kept
            if ranked.any() and dropped.any():
                assert mass[head][ranked].min() >= mass[head][dropped].max() - 1e-6


def test_a_sketch_on_every_channel_ranks_as_the_oracle_and_on_fewer_stays_close():
    from studies.laws.oracle_selection import OracleSelector

    _, _, cache, _, query, config, blocks = oracle_case()
    exact = OracleSelector(config, cache).block_scores(0, query, blocks, None, None)
    every = OracleSelector(config, cache, DIM).block_scores(0, query, blocks, None, None)
    assert torch.allclose(every, exact, atol=1e-5)
    fixed = OracleSelector(config, cache, DIM, fixed=True)
    assert torch.allclose(fixed.block_scores(0, query, blocks, None, None), exact, atol=1e-5)
    assert fixed.chosen[0].shape == (KV_HEADS, DIM)  # chosen once for the layer
    half = OracleSelector(config, cache, DIM // 2).block_scores(0, query, blocks, None, None)
    assert not torch.allclose(half, exact, atol=1e-3)  # an approximation, not the same scores
    # ...that still follows the exact one: scores correlate far above chance.
    present = blocks.present[:, None].expand_as(exact)
    pairs = torch.stack([half[present], exact[present]])
    assert torch.corrcoef(pairs)[0, 1] > 0.8
