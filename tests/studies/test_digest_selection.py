"""The mean-and-spread digest ranking of the pruning study (mechanics on a random cache)."""

import torch

from etinfer.model.block_layout import DecodeBlocks
from studies.laws.digest_selection import DigestSelector
from tests.control.test_pruning import BLOCK, DIM, GROUP, KV_HEADS, context_keys, oracle_case


def test_the_digest_is_the_keys_mean_score_plus_the_spread_of_their_scores():
    lengths, _, cache, tables, query, config, blocks = oracle_case()
    cache.keys.fill_(torch.nan)  # what memory past each row's end may hold
    for i, n in enumerate(lengths):  # ...its own keys written again
        table = tables[i].tolist()
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
        fresh = torch.randn(n, KV_HEADS, DIM, generator=torch.Generator().manual_seed(i)) * 2
        cache.keys[0, :, slots] = fresh.transpose(0, 1)
    centred = DigestSelector(config, cache, 0.0).block_scores(0, query, blocks, None, None)
    spread = DigestSelector(config, cache, 2.0).block_scores(0, query, blocks, None, None)
    for i, n in enumerate(lengths):
        keys, _ = context_keys(cache, tables[i].tolist(), n)  # [kv_heads, n, dim]
        q = query[i].view(KV_HEADS, GROUP, DIM)
        for b in range(-(-n // BLOCK)):
            block = keys[:, b * BLOCK : min((b + 1) * BLOCK, n)]
            mean, deviation = block.mean(1), block.std(1, correction=0)
            expected = (q @ mean[:, :, None]).squeeze(-1)  # [kv_heads, group]
            reach = ((q * q) @ (deviation**2)[:, :, None]).squeeze(-1).sqrt()
            assert torch.allclose(centred[i, :, b], expected.amax(1), atol=1e-4)
            assert torch.allclose(spread[i, :, b], (expected + 2 * reach).amax(1), atol=1e-4)


def test_the_digest_ranks_a_block_of_keys_along_the_query_first():
    lengths, _, cache, tables, query, config, _ = oracle_case()
    table = tables[0].tolist()
    aligned = query[0].view(KV_HEADS, GROUP, DIM)[:, 0]  # each KV head's first query head
    for offset in range(BLOCK):  # block 2 of the first row: every key along the query
        cache.keys[0, :, table[2] * BLOCK + offset] = aligned * 3
    blocks = DecodeBlocks(tables, torch.tensor(lengths), BLOCK, torch.tensor([3, 3]), 3)
    mask = DigestSelector(config, cache, 1.0).select(0, query, blocks, cache.summaries(0)).mask
    assert mask[0, :, 2].all()
