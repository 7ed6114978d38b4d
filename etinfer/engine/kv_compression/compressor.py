"""Latent KV compression applied: keep the queries that vote, then rewrite a sequence's cache
into fewer blocks and give the rest back to the pool (the law is ``control/kv_compression.py``).

**Voting queries.** While a long prompt's last ``window`` positions and its first
``decode_queries`` generated tokens are computed, the forward pass copies their queries (after
the rotary embedding) out of every layer: one gather per layer and step for all such rows.

**Compaction.** Once they are in, each (layer, KV head) ranks the sequence's cached positions by
the attention those queries paid them and keeps ``budget`` of them. The kept keys and values are
written, in position order, into freshly allocated blocks, and the old blocks go back to the pool.
The old blocks are never rewritten, so a prefix-cache entry naming one of them stays true, and
the new blocks are never published (they hold a selection, not a prefix). From then on the
sequence's cache holds ``offset`` fewer entries than it has positions (its
``KVCompressionState``): new tokens take the next slot while their rotary position stays their
true one.

In a model whose layers differ in their window (Gemma 3) the sliding layers keep their most
recent ``budget`` positions instead of voting: their window reads what it read before.

A sequence whose context at that point is smaller than the budget is left alone; one that is
preempted recomputes its whole context (as prefill, over positions) and is compressed again once
it decodes, by the voters its recompute computed (those served from the prefix cache do not
vote; where none was computed, it stays whole).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from etinfer.control.kv_compression import KVCompressionConfig, kept_positions, observed_attention
from etinfer.engine.kv_cache.manager import KVCacheManager
from etinfer.engine.sequence import Sequence
from etinfer.model.config import ModelConfig
from etinfer.model.kv_cache import KVCache


@dataclass
class QueryCapture:
    """The rows whose queries this step keeps, and where they go."""

    rows: torch.Tensor  # [captured] rows of the step's flat batch
    queries: torch.Tensor  # [layers, captured, heads, head_dim], filled as layers run
    # (sequence, first captured row, first voter index, count)
    targets: list[tuple[Sequence, int, int, int]]


class KVCompressor:
    """Handed to the model runner, which asks it which rows' queries a step keeps
    (``plan_capture``, ``store``); the engine has it compact due sequences after each step."""

    def __init__(
        self,
        config: KVCompressionConfig,
        model: ModelConfig,
        kv: KVCacheManager,
        device: torch.device,
    ) -> None:
        # A window on every layer is refused (etinfer/compatibility.py). Where some layers
        # slide (Gemma 3), those keep their most recent positions: their window then reads the
        # same keys as before compaction, which needs a budget that holds it (the cache's last
        # entries are the last positions, in order).
        self.local_layers = model.local_layers
        if self.local_layers and config.budget < model.sliding_window:
            raise ValueError(
                f"kv_compression.budget must hold the sliding layers' window: at least "
                f"{model.sliding_window}, got {config.budget}"
            )
        self.config, self.kv, self.device = config, kv, device
        self.num_layers, self.num_heads, self.head_dim = (
            model.num_layers,
            model.num_heads,
            model.head_dim,
        )
        self.scale = model.scale

    def _voters(self, seq: Sequence) -> range | None:
        """Positions whose queries vote for ``seq``; None where it is not to be compressed."""
        prompt, config = seq.num_prompt_tokens, self.config
        if seq.kv_compression.compressed or prompt + config.decode_queries < config.budget:
            return None
        return range(max(0, prompt - config.window), prompt + config.decode_queries)

    def plan_capture(
        self, seqs: list[Sequence], starts: list[int], counts: list[int], first_rows: list[int]
    ) -> QueryCapture | None:
        rows, targets, captured = [], [], 0
        for seq, start, n, first_row in zip(seqs, starts, counts, first_rows, strict=True):
            voters = self._voters(seq)
            if voters is None:
                continue
            lo, hi = max(start, voters.start), min(start + n, voters.stop)
            if lo >= hi:
                continue
            state = seq.kv_compression
            if state.voting_queries is None or start == 0:
                shape = (self.num_layers, len(voters), self.num_heads, self.head_dim)
                state.voting_queries = torch.empty(shape, device=self.device)
                state.voted = torch.zeros(len(voters), dtype=torch.bool)
            rows.append(torch.arange(first_row + lo - start, first_row + hi - start))
            targets.append((seq, captured, lo - voters.start, hi - lo))
            captured += hi - lo
        if not targets:
            return None
        shape = (self.num_layers, captured, self.num_heads, self.head_dim)
        return QueryCapture(
            torch.cat(rows).to(self.device), torch.empty(shape, device=self.device), targets
        )

    def store(self, capture: QueryCapture | None) -> None:
        """After the forward pass: the captured queries into their sequences."""
        if capture is None:
            return
        for seq, row, voter, n in capture.targets:
            state = seq.kv_compression
            state.voting_queries[:, voter : voter + n] = capture.queries[:, row : row + n]
            state.voted[voter : voter + n] = True

    def compress_due(self, seqs: list[Sequence], cache: KVCache) -> None:
        """Compress each sequence whose voters have all been computed (after a step's commit).
        Not one still recomputing its context after a preemption (its next chunk is prefill,
        over positions), nor one the step finished."""
        for seq in seqs:
            voters = self._voters(seq)
            if (
                voters is not None
                and seq.finish_reason is None
                and seq.num_computed_tokens == seq.num_tokens - 1
                and seq.num_computed_tokens >= voters.stop
            ):
                self.compress(seq, voters, cache)

    @torch.inference_mode()
    def compress(self, seq: Sequence, voters: range, cache: KVCache) -> bool:
        """Rewrite ``seq``'s entries in ``cache`` into ``budget`` entries per (layer, KV head);
        False, changing nothing, when the pool lacks the blocks to write them into."""
        bs, budget, state = self.kv.block_size, self.config.budget, seq.kv_compression
        if state.voting_queries is None or not state.voted.any():
            # Every voter came from the prefix cache (a readmitted sequence that had published
            # them): none was computed to vote, so the sequence stays whole.
            state.compressed = True
            return False
        new_count = self.kv.blocks_needed(budget)
        if new_count > self.kv.pool.num_free_blocks:
            return False
        device = cache.keys.device
        # Voters served from the prefix cache were never computed here: only the others vote.
        voted = state.voted.to(device)
        queries = state.voting_queries[:, voted]
        context = seq.num_computed_tokens
        table = torch.tensor(seq.block_table, device=device)
        positions = torch.arange(context, device=device)
        slots = table[positions // bs] * bs + positions % bs
        new_blocks = self.kv.pool.allocate(new_count)
        new_table = torch.tensor(new_blocks, device=device)
        kept_index = torch.arange(budget, device=device)
        new_slots = new_table[kept_index // bs] * bs + kept_index % bs
        query_pos = torch.arange(voters.start, voters.stop, device=device)[voted]
        recent = positions[context - budget :].expand(cache.keys.shape[1], -1)
        for layer in range(len(cache.keys)):
            keys, values = cache.read(layer, slots)  # [kv_heads, context, dim] float32
            kept = recent
            if layer not in self.local_layers:
                attention = observed_attention(queries[layer], query_pos, keys, self.scale)
                kept = kept_positions(attention, keys, self.config)
            kept = kept[..., None].expand(-1, -1, self.head_dim)
            cache.write(
                layer,
                new_slots,
                new_table,
                keys.gather(1, kept).transpose(0, 1),
                values.gather(1, kept).transpose(0, 1),
            )
        cache.update_sketch(slice(None), new_slots)  # the moved keys' copy, where one is kept
        self.kv.pool.free(reversed(seq.block_table))
        seq.block_table = new_blocks
        state.offset, state.compressed = context - budget, True
        state.voting_queries = state.voted = None
        return True
