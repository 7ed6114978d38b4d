import pytest

from etinfer.engine.kv_cache import block_pool
from etinfer.engine.kv_cache.block_pool import BlockPool, block_hash


def key(tokens, parent=None):
    tokens = tuple(tokens)
    return block_hash(parent, tokens), (parent, tokens)


def test_allocate_and_free_track_reference_counts():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)
    pool.share(blocks[:1])
    pool.free(blocks)
    assert pool.num_free_blocks == 3  # the shared block is still held once
    pool.free(blocks[:1])
    assert pool.num_free_blocks == 4
    assert pool.ref_counts == [0, 0, 0, 0]


def test_over_allocation_is_refused():
    pool = BlockPool(2)
    pool.allocate(2)
    with pytest.raises(RuntimeError, match="asked for 1 KV blocks with 0 free"):
        pool.allocate(1)


def test_freed_block_keeps_its_hash_until_reused():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    h, k = key(range(4))
    pool.publish(block, h, k)
    pool.free([block])
    assert pool.lookup(h, k) == block  # still findable while it sits on the free list
    pool.share([block])
    assert pool.num_free_blocks == 1 and pool.ref_counts[block] == 1
    pool.free([block])
    # Reuse: the other block was freed earlier, so it goes first; then this one is evicted.
    pool.allocate(1)
    assert pool.lookup(h, k) == block
    pool.allocate(1)
    assert pool.lookup(h, k) is None


def test_least_recently_freed_block_is_reused_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.free([b])
    pool.free([a])
    pool.free([c])
    assert [pool.allocate(1) for _ in range(3)] == [[b], [a], [c]]


def test_lookup_compares_keys_so_a_hash_collision_is_a_miss(monkeypatch):
    monkeypatch.setattr(block_pool, "block_hash", lambda parent, tokens: 42)
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.publish(block, 42, (None, (1, 2)))
    assert pool.lookup(42, (None, (1, 2))) == block
    assert pool.lookup(42, (None, (3, 4))) is None


def test_first_published_block_wins_and_caching_can_be_off():
    pool = BlockPool(3)
    a, b, _ = pool.allocate(3)
    h, k = key([7, 7])
    pool.publish(a, h, k)
    pool.publish(b, h, k)
    assert pool.lookup(h, k) == a
    off = BlockPool(1, enable_prefix_caching=False)
    (block,) = off.allocate(1)
    off.publish(block, h, k)
    assert off.lookup(h, k) is None


def test_hash_chains_through_the_parent():
    first, _ = key([1, 2])
    assert key([3, 4], parent=first)[0] != key([3, 4], parent=None)[0]


def test_a_growing_sequence_takes_the_next_block_when_free():
    pool = BlockPool(8)
    a, b, c, d = pool.allocate(4)
    pool.free([c, a, b])  # free list, oldest first: the never-used 4..7, then c, a, b
    assert pool.allocate(2, after=a) == [b, c]  # contiguous after a, not the LRU head (4)
    assert pool.allocate(1, after=d) == [4]
    assert pool.allocate(1, after=7) == [5]  # no block after the last one: the LRU head
    assert pool.allocate(3, after=c) == [6, 7, a]  # d is taken: LRU head, then onward from it


def test_a_growing_sequence_never_evicts_a_cached_block_to_stay_contiguous():
    pool = BlockPool(6)
    head, second, _ = pool.allocate(3)
    pool.publish(second, *key(range(16)))  # another prompt's second block, now free
    pool.free([second])
    assert pool.allocate(1, after=head) == [3]  # not `second`: its content stays findable
    assert pool.lookup(*key(range(16))) == second


def test_prompts_with_a_shared_opening_find_all_their_blocks_when_sent_again(tiny_model):
    """Issue 39: prompts that open with the same instruction, then distinct documents; sent
    together and then again, the second time each finds every full block it left."""
    import random

    from etinfer import LLM, SamplingParams

    llm = LLM(tiny_model, quantization="none", num_kvcache_blocks=1200, max_model_len=4096)
    rng = random.Random(0)
    opening = [rng.randrange(100, 40000) for _ in range(25)]
    prompts = [opening + [rng.randrange(100, 40000) for _ in range(1975)] for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=4)
    llm.generate(prompts, params)
    again = llm.generate(prompts, params)
    assert [o.num_cached_tokens for o in again] == [1984] * 4
