"""Speculative decoding, the engine's side: drafts into the scheduled batch before the forward
pass, and what the step's verification accepted after it.

The control law (``control/drafting.py``) says how many tokens each decoding sequence may draft;
here the drafter proposes them, they are trimmed to the step's token budget, the request's
``max_tokens`` and the context length, and KV slots are allocated for them. After the forward
pass every sampled sequence has logits at its last known token and at each draft; the
engine's sampling (``engine/sampling/step_sampling.py``) draws column by column and keeps each
draft the model draws. So the emitted tokens, their entropies and temperatures are those plain
decoding would produce, one per position, and drafting changes how many steps it takes, not what
comes out.
"""

from __future__ import annotations

import time
from typing import Protocol

from etinfer.config import EngineConfig
from etinfer.control.drafting import DraftCosts, SpeculativeConfig
from etinfer.control.record import TARGET_MODEL, StepShape
from etinfer.engine.kv_cache.manager import KVCacheManager
from etinfer.engine.runner.model_runner import ModelRunner
from etinfer.engine.sampling.step_sampling import Emitted
from etinfer.engine.scheduler import ScheduledBatch
from etinfer.engine.sequence import Sequence
from etinfer.engine.speculative.draft_model import DraftModelProposer
from etinfer.engine.speculative.drafter import make_proposer
from etinfer.model.tokenizer import Tokenizer


class Proposer(Protocol):
    # Whether asking it for tokens costs, proposed or not: a model's layers run for each token
    # asked of them, where a lookup that finds nothing proposes nothing and costs nothing.
    asking_costs: bool

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Up to ``limits[i]`` drafted tokens for each of ``seqs``; KV slots for that many
        are allocated (a drafter that runs model layers writes them)."""


class Speculator:
    def __init__(
        self,
        engine: EngineConfig,
        runner: ModelRunner,
        kv: KVCacheManager,
        tokenizer: Tokenizer,
        costs: DraftCosts,
    ) -> None:
        """For an engine whose ``speculative`` is set; a drafter that needs fitting (an early
        exit's adapter) is fitted here, at load. ``costs``: where it keeps what its steps
        measure drafting to cost, for the law to read."""
        self.costs = costs
        self.started = 0.0  # when the step being drafted began
        # Tokens asked of the drafter per batch index this step: what drafting cost, drafts or
        # not where asking costs (an early exit that stops at its first unsure token has run
        # its layers anyway); what it proposed where only that costs (prompt lookup).
        self.asked: dict[int, int] = {}
        self.tokens_asked = 0  # in all, what drafting has cost (in tokens asked of the drafter)
        self.config: SpeculativeConfig = engine.speculative
        self.drafter = f"draft:{self.config.method}"  # how token_models names accepted drafts
        self.proposer: Proposer = make_proposer(engine, runner, kv.pool, tokenizer)
        self.kv = kv
        self.max_model_len = runner.max_model_len
        self.max_num_batched_tokens = engine.max_num_batched_tokens

    def draft(self, batch: ScheduledBatch, shape: StepShape) -> None:
        """Add drafts to the batch's decoding sequences, as long as ``shape`` allows."""
        self.started = time.perf_counter()
        self.asked = {}
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.drop_finished()  # every step, drafting or not
        if not shape.draft_lengths:
            return
        budget = self.max_num_batched_tokens - sum(batch.num_tokens)
        chosen, limits = [], []
        for i in range(batch.num_decode):
            seq = batch.seqs[i]
            limit = min(shape.draft_lengths[i], budget, seq.draft_room(self.max_model_len))
            # Blocks past the drafts proposed go back when the step commits.
            if limit > 0 and not seq.forced and self.kv.allocate(seq, 1 + limit):
                chosen.append(i)
                limits.append(limit)
                budget -= limit
        if not chosen:
            return
        proposals = self.proposer.propose([batch.seqs[i] for i in chosen], limits)
        asked = limits if self.proposer.asking_costs else [len(p) for p in proposals]
        self.asked = dict(zip(chosen, asked, strict=True))
        self.tokens_asked += sum(asked)
        for i, drafts in zip(chosen, proposals, strict=True):
            batch.add_drafts(i, drafts)

    def record(self, step: int, batch: ScheduledBatch, emitted: Emitted) -> None:
        """Time the step (scheduler step ``step``) where only decoding sequences ran; count
        each sampled sequence's drafts and acceptances, and weigh them against their cost
        (a draft of one sequence slows the whole batch's step)."""
        rows = batch.num_decode
        if rows == len(batch.seqs):
            asked = sum(self.asked.values())
            self.costs.observe(step, rows, asked, time.perf_counter() - self.started)
        cost = None
        if self.config.weighs_cost and self.costs.per_draft is not None:
            cost = self.costs.per_draft * rows
        for index, accepted, count in zip(
            batch.sampled, emitted.accepted, emitted.counts, strict=True
        ):
            seq, drafted = batch.seqs[index], len(batch.drafts[index])
            asked = self.asked.get(index, 0)
            state = seq.speculation
            state.record(
                self.config,
                drafted,
                accepted,
                cost,
                seq.num_output_tokens,
                asked,
                least_rest=self.costs.start_rest,
            )
            if seq.finish_reason is not None:
                self.costs.request_finished(state)
            # Who wrote each token: the drafter's accepted ones come first, then the model's.
            seq.token_models += [self.drafter] * accepted + [TARGET_MODEL] * (count - accepted)
