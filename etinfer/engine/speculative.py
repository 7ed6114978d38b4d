"""Speculative decoding, the engine's side: drafts into the scheduled batch, then the step's
sampling column by column, keeping drafts while the model draws them.

The control law (``control/drafting.py``) says how many tokens each decoding sequence may draft;
here the drafter proposes them, they are trimmed to the step's token budget, the request's
``max_tokens`` and the context length, and KV slots are allocated for them. After the forward
pass every sampled sequence has logits at its last known token and at each draft. Column ``c``
samples every sequence still verifying at its ``c``-th row, through the same sampler and with
the same control state as a plain step would (the temperature law starts from the state the
previous column left), and a sequence keeps verifying while the token drawn equals its draft.
So the emitted tokens, their entropies and temperatures are those plain decoding would produce,
one per position, and drafting changes how many steps it takes, not what comes out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

import torch

from etinfer.config import EngineConfig
from etinfer.control.drafting import SpeculativeConfig, next_draft_length
from etinfer.control.record import TARGET_MODEL, StepShape
from etinfer.engine.draft_model import DraftModelProposer
from etinfer.engine.drafter import make_proposer
from etinfer.engine.kv_cache_manager import KVCacheManager
from etinfer.engine.model_runner import ModelRunner
from etinfer.engine.sampler import SamplerOutput
from etinfer.engine.scheduler import ScheduledBatch
from etinfer.engine.sequence import Sequence
from etinfer.model.tokenizer import Tokenizer

SampleFn = Callable[[torch.Tensor, list[Sequence], list[float | None]], SamplerOutput]
TakeFn = Callable[[list[Sequence], SamplerOutput], None]


class Proposer(Protocol):
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
    ) -> None:
        """For an engine whose ``speculative`` is set; a drafter that needs fitting (an early
        exit's adapter) is fitted here, at load."""
        self.config: SpeculativeConfig = engine.speculative
        self.drafter = f"draft:{self.config.method}"  # how token_models names accepted drafts
        self.proposer: Proposer = make_proposer(engine, runner, kv.pool, tokenizer)
        self.kv = kv
        self.max_model_len = runner.max_model_len
        self.max_num_batched_tokens = engine.max_num_batched_tokens

    def draft(self, batch: ScheduledBatch, shape: StepShape) -> None:
        """Add drafts to the batch's decoding sequences, as long as ``shape`` allows."""
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.drop_finished()  # every step, drafting or not
        if not shape.draft_lengths:
            return
        budget = self.max_num_batched_tokens - sum(batch.num_tokens)
        chosen, limits = [], []
        for i in range(batch.num_decode):
            seq = batch.seqs[i]
            limit = min(
                shape.draft_lengths[i],
                budget,
                seq.params.max_tokens - seq.num_output_tokens - 1,
                self.max_model_len - seq.num_tokens - 1,
            )
            # Blocks past the drafts proposed go back when the step commits.
            if limit > 0 and not seq.forced and self.kv.allocate(seq, 1 + limit):
                chosen.append(i)
                limits.append(limit)
                budget -= limit
        if not chosen:
            return
        proposals = self.proposer.propose([batch.seqs[i] for i in chosen], limits)
        for i, drafts in zip(chosen, proposals, strict=True):
            batch.drafts[i] = drafts
            batch.num_tokens[i] += len(drafts)

    def record(self, batch: ScheduledBatch, emitted: Emitted) -> None:
        """Count each sampled sequence's drafts and acceptances; move its heuristic length."""
        for index, accepted, count in zip(
            batch.sampled, emitted.accepted, emitted.counts, strict=True
        ):
            seq, drafted = batch.seqs[index], len(batch.drafts[index])
            seq.num_draft_tokens += drafted
            seq.num_accepted_tokens += accepted
            # Who wrote each token: the drafter's accepted ones come first, then the model's.
            seq.token_models += [self.drafter] * accepted + [TARGET_MODEL] * (count - accepted)
            seq.draft_length = next_draft_length(self.config, seq.draft_length, drafted, accepted)


@dataclass
class Emitted:
    """What a step's sampling produced, column by column."""

    outputs: list[SamplerOutput]  # one per column, a row per sequence still verifying
    batch_indices: list[int]  # per emitted token, in that order: its sequence in the batch
    logits_rows: list[int]  # and its row of the step's logits
    counts: list[int]  # per sampled sequence: tokens emitted
    accepted: list[int]  # per sampled sequence: drafts accepted

    def merged(self) -> SamplerOutput | None:
        """One output over every emitted token (logprobs only when there was one column: the
        columns' top-N widths may differ, and the sequences' outputs carry them anyway)."""
        if len(self.outputs) <= 1:
            return self.outputs[0] if self.outputs else None
        lists = [[v for o in self.outputs for v in getattr(o, name)] for name in _ROW_FIELDS]
        return SamplerOutput(*lists, logprobs=None)


_ROW_FIELDS = (
    "token_ids",
    "entropies",
    "tempered_entropies",
    "temperatures",
    "predictive_entropy",
    "predictive_entropy_upper",
    "states",
)


def sample_verified(
    batch: ScheduledBatch,
    logits: torch.Tensor,
    states: list[float | None],
    sample: SampleFn,
    take: TakeFn,
) -> Emitted:
    """Sample the batch's sampled sequences (``states``: their temperature laws' states), each
    at its last known token and then at each draft while the drafts before it were drawn.
    ``take`` appends a column's tokens to their sequences (and may finish them)."""
    verified = [len(batch.drafts[i]) + 1 for i in batch.sampled]
    offsets = [0, *accumulate(verified)]
    emitted = Emitted([], [], [], [0] * len(verified), [0] * len(verified))
    alive, column = list(range(len(verified))), 0
    while alive:
        seqs = [batch.seqs[batch.sampled[a]] for a in alive]
        rows = [offsets[a] + column for a in alive]
        column_states = (
            [states[a] for a in alive] if column == 0 else [s.temperature_state for s in seqs]
        )
        out = sample(logits[rows], seqs, column_states)
        take(seqs, out)
        emitted.outputs.append(out)
        still = []
        for r, (a, seq) in enumerate(zip(alive, seqs, strict=True)):
            emitted.batch_indices.append(batch.sampled[a])
            emitted.logits_rows.append(rows[r])
            emitted.counts[a] += 1
            drafts = batch.drafts[batch.sampled[a]]
            if column < len(drafts) and out.token_ids[r] == drafts[column]:
                emitted.accepted[a] += 1
                if seq.finish_reason is None:
                    still.append(a)
        alive, column = still, column + 1
    return emitted
