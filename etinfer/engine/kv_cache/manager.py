"""Per-sequence bookkeeping over the block pool: block tables, prefix-cache hits, publishing."""

from __future__ import annotations

from etinfer.engine.kv_cache.block_pool import BlockPool, block_hash
from etinfer.engine.sequence import Sequence


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.block_size = block_size
        # In tokens, as vLLM counts them: prompt tokens looked up, and those found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_at_longest(
        self, num_prompt_tokens: int, max_tokens: int, max_model_len: int | None = None
    ) -> int:
        """KV blocks of one sequence at its longest (the last generated token is never
        computed, so it needs no slot)."""
        longest = num_prompt_tokens + max_tokens
        if max_model_len is not None:
            longest = min(longest, max_model_len)
        return self.blocks_needed(longest - 1)

    def check_holds(
        self,
        num_prompt_tokens: int,
        max_tokens: int,
        max_model_len: int | None = None,
        *,
        name: str = "request",
    ) -> None:
        """Refuse a sequence the whole pool cannot hold at its longest: it would wait or be
        preempted forever."""
        needed = self.blocks_at_longest(num_prompt_tokens, max_tokens, max_model_len)
        if needed > self.pool.num_blocks:
            raise ValueError(
                f"{name} needs {needed} KV blocks ({num_prompt_tokens} prompt tokens + max_tokens "
                f"{max_tokens} - 1, {self.block_size} tokens per block) but num_kvcache_blocks "
                f"is {self.pool.num_blocks}; lower max_tokens or enlarge the pool"
            )

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of ``seq``'s tokens, in order.

        The last token is never served from the cache: its logits are needed to sample. Nor
        is any token of a prompt whose log-probabilities were asked for: each needs its row.
        """
        if not self.pool.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        blocks = []
        for index in range((seq.num_tokens - 1) // self.block_size):
            key_hash, key = self._block_key(seq, index)
            block = self.pool.lookup(key_hash, key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Give ``seq`` blocks for ``num_new_tokens`` more tokens after its computed ones, first
        taking the ``cached`` prefix blocks. False, changing nothing, if the pool is short."""
        num_computed = seq.num_computed_tokens + len(cached) * self.block_size
        needed = self.blocks_needed(num_computed - seq.kv_offset + num_new_tokens)
        new = needed - len(seq.block_table) - len(cached)
        # Sharing a cached block nobody holds takes it off the free list too.
        taken_from_free = sum(1 for block in cached if self.pool.ref_counts[block] == 0)
        if new + taken_from_free > self.pool.num_free_blocks:
            return False
        if cached:
            self.pool.share(cached)
            seq.block_table.extend(cached)
            seq.num_computed_tokens = num_computed
            seq.num_registered_blocks = len(cached)
        last = seq.block_table[-1] if seq.block_table else None
        seq.block_table.extend(self.pool.allocate(max(new, 0), after=last))
        return True

    def record_lookup(self, seq: Sequence, num_cached_tokens: int) -> None:
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += num_cached_tokens

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so they are the first reused: a prompt's head is the likelier hit.
        self.pool.free(reversed(seq.block_table))
        seq.block_table = []
        seq.num_registered_blocks = 0
        if seq.kv_compression is not None:
            seq.kv_compression.cache_freed()

    def commit(self, seq: Sequence, start: int, num_computed: int) -> None:
        """After a step computed ``num_computed`` tokens of ``seq`` from ``start`` and its
        sampled tokens were appended: count those whose keys and values hold, give back the
        blocks that held only rejected drafts (never published, so no prefix-cache entry names
        them) and publish the blocks filled."""
        # Every known token but the last is in the cache (drafts past the first rejection are
        # not known tokens); a prompt chunk that ends before the prompt does has all its own.
        seq.num_computed_tokens = min(start + num_computed, seq.num_tokens - 1)
        needed = self.blocks_needed(seq.num_tokens - seq.kv_offset)
        if len(seq.block_table) > needed:
            self.pool.free(reversed(seq.block_table[needed:]))
            del seq.block_table[needed:]
        self.publish_full_blocks(seq)

    def publish_full_blocks(self, seq: Sequence) -> None:
        """Publish the blocks that computing this step's tokens filled."""
        if not self.pool.enable_prefix_caching or seq.kv_compressed:
            return  # a compressed sequence's blocks hold a selection of positions, not a prefix
        full = seq.num_full_tokens // self.block_size
        for index in range(seq.num_registered_blocks, full):
            key_hash, key = self._block_key(seq, index)
            self.pool.publish(seq.block_table[index], key_hash, key)
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)

    def _block_key(self, seq: Sequence, index: int) -> tuple[int, tuple]:
        """Hash and key of the full block ``index``, hashing the blocks before it if needed."""
        for i in range(len(seq.block_hashes), index + 1):
            parent = seq.block_hashes[i - 1] if i else None
            seq.block_hashes.append(block_hash(parent, self._tokens(seq, i)))
        parent = seq.block_hashes[index - 1] if index else None
        return seq.block_hashes[index], (parent, self._tokens(seq, index))

    def _tokens(self, seq: Sequence, index: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])
