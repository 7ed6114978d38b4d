"""The digest scorer: each block's key mean and spread, kept by the cache as it writes, and the
blocks they rank first."""

from dataclasses import replace

import pytest
import torch

from etinfer.control.block_budgets import PruningConfig
from etinfer.control.block_scores import key_digest_scores
from etinfer.control.block_selection import EntropicSelector
from etinfer.model.block_layout import DecodeBlocks
from tests.control.test_pruning import BLOCK, DIM, GROUP, KV_HEADS, context_keys, oracle_case


@pytest.mark.parametrize("spread", [0.0, 2.0])
def test_the_digest_is_the_keys_mean_score_plus_the_spread_of_their_scores(spread):
    """From the sums the cache kept through chunked writes into blocks that held other keys."""
    lengths, _, cache, tables, query, _, blocks = oracle_case()
    scores = key_digest_scores(query, cache.summaries(0), blocks, spread)
    assert scores.shape == (2, KV_HEADS, GROUP, tables.shape[1])
    for i, n in enumerate(lengths):
        keys, _ = context_keys(cache, tables[i].tolist(), n)  # [kv_heads, n, dim]
        q = query[i].view(KV_HEADS, GROUP, DIM)
        for b in range(-(-n // BLOCK)):
            block = keys[:, b * BLOCK : min((b + 1) * BLOCK, n)]
            mean, deviation = block.mean(1), block.std(1, correction=0)
            centre = (q @ mean[:, :, None]).squeeze(-1)  # [kv_heads, group]
            reach = ((q * q) @ (deviation**2)[:, :, None]).squeeze(-1).sqrt()
            expected = centre + spread * reach
            torch.testing.assert_close(scores[i, :, :, b], expected, atol=2e-4, rtol=1e-4)


def test_the_digest_ranks_a_block_of_keys_along_the_query_first():
    lengths, _, cache, tables, query, _, _ = oracle_case()
    table = tables[0].tolist()
    aligned = query[0].view(KV_HEADS, GROUP, DIM)[:, 0]  # each KV head's first query head
    slots = torch.tensor([table[2] * BLOCK + offset for offset in range(BLOCK)])
    keys = (aligned * 3)[None].expand(BLOCK, -1, -1)  # block 2 of the first row: along the query
    cache.write(0, slots, slots[:1] // BLOCK, keys, torch.zeros_like(keys))
    config = PruningConfig(
        scorer="digest", min_context=0, dense_layers=0, sink_blocks=1, recent_blocks=1
    )
    blocks = DecodeBlocks(tables, torch.tensor(lengths), BLOCK, torch.tensor([3, 3]), 3)
    selection = EntropicSelector(config).select(0, query, blocks, cache.summaries(0))
    assert selection.mask[0, :, 2].all()
    assert selection.bounds is None  # estimates, not bounds: nothing dropped is certified
    assert selection.mask.sum(-1).tolist() == [[3] * KV_HEADS] * 2  # the budgets, each head


def test_one_outlier_key_does_not_lift_its_block_as_it_lifts_its_key_bounds():
    """Min/max bounds give a block one outlier's reach in every channel; the digest, a key's."""
    lengths, _, cache, tables, query, _, blocks = oracle_case()
    table = tables[0].tolist()
    q = query[0].view(KV_HEADS, GROUP, DIM)[:, 0]
    spike = torch.zeros(1, KV_HEADS, DIM)
    spike[0] = q.sign() * 50  # one key far out along the query's signs, in block 1
    cache.write(0, torch.tensor([table[1] * BLOCK]), None, spike, torch.zeros_like(spike))
    digest = key_digest_scores(query, cache.summaries(0), blocks, 2.0)[0, :, 0]
    keys, _ = context_keys(cache, table, lengths[0])
    exact = (q[:, None] @ keys.transpose(1, 2)).squeeze(1)  # [kv_heads, n]
    # The bounds reach the spike's score; the digest stays well below it (16 keys share it).
    assert (digest[:, 1] < exact[:, BLOCK : 2 * BLOCK].amax(1) * 0.8).all()


def test_a_spread_must_be_a_non_negative_number():
    with pytest.raises(ValueError, match="digest_spread"):
        replace(PruningConfig(), digest_spread=-1.0)
    with pytest.raises(ValueError, match=r"scorer.*digest"):
        PruningConfig(scorer="digests")
