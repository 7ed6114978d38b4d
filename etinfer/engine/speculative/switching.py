"""Entropy Adaptive Decoding, the engine's side: each step, decoding sequences whose switching
state names the small model decode through it (the first N layers and the fitted exit), all
other rows through the full model; after the step the law (``control/switching.py``) moves each
sequence's state.

The small model writes keys and values for its N layers only. A sequence's ``exit_start`` (in
its ``SwitchingState``) marks
where its small-model stretch began: the layers above N hold nothing past it, so the prefix cache
never publishes a block from there on, and when the large model takes over the sequence's
computed tokens fall back to ``exit_start``: the scheduler then gives it one prefill chunk over
the small model's tokens (all layers: the lower ones are rewritten, to prefill's rounding), whose
last row the large model samples. That chunk is the catch-up cost the paper's headline omits.
"""

from __future__ import annotations

import dataclasses

import torch

from etinfer.config import EngineConfig
from etinfer.control.record import TARGET_MODEL, StepDecisions
from etinfer.control.switching import EXIT_MODEL, SwitchingConfig, next_switch_state
from etinfer.engine.kv_cache.block_pool import BlockPool
from etinfer.engine.runner.model_runner import ModelRunner, StepResult
from etinfer.engine.scheduler import ScheduledBatch
from etinfer.engine.speculative.early_exit import build_early_exit
from etinfer.model.tokenizer import Tokenizer


class ModelSwitcher:
    def __init__(
        self, engine: EngineConfig, runner: ModelRunner, pool: BlockPool, tokenizer: Tokenizer
    ) -> None:
        """For an engine with switching on; the small model's adapter is fitted here, at load."""
        self.config: SwitchingConfig = engine.control.switching_config
        self.small = build_early_exit(
            engine.draft_model, runner, pool, tokenizer, adapter=self.config.exit_adapter
        )

    def execute(
        self, runner: ModelRunner, batch: ScheduledBatch, decisions: StepDecisions
    ) -> tuple[StepResult, set[int]]:
        """The step's result as one model would give it, and which sequences the small model
        computed (indices into the batch)."""
        # Rows that end their sequence only: a one-token chunk of a recompute that does not end
        # it is prompt work, which fills every layer.
        small = {
            i
            for i in batch.sampled
            if i < batch.num_decode and batch.seqs[i].switching.current.model == EXIT_MODEL
        }
        if not small:
            return runner.execute(batch, decisions), small
        large = [i for i in range(len(batch.seqs)) if i not in small]
        budgets = decisions.block_budgets
        if budgets is not None:
            budgets = [budgets[i] for i in large if i < batch.num_decode]
        result = StepResult(None, None)
        if large:
            sub = dataclasses.replace(decisions, block_budgets=budgets)
            result = runner.execute(batch.subset(large), sub)
        small_logits = self.small.logits(batch.subset(sorted(small)))
        # Each sampled sequence's row (no drafts here), in the batch's order.
        small_row = {i: r for r, i in enumerate(sorted(small))}
        large_sampled = [i for i in large if i in set(batch.sampled)]
        large_row = {i: r for r, i in enumerate(large_sampled)}
        rows = [
            small_logits[small_row[i]] if i in small else result.logits[large_row[i]]
            for i in batch.sampled
        ]
        return StepResult(result.attention, torch.stack(rows), result.prompt_scores), small

    def update(self, batch: ScheduledBatch, starts: list[int], small: set[int]) -> None:
        """After the step's tokens are appended and committed: note which model wrote each, move
        each sampled sequence's switching state, and start or end small-model stretches."""
        for i, seq in enumerate(batch.seqs):
            switching = seq.switching
            if switching.current.model != EXIT_MODEL:
                continue
            if i not in small:
                # A full-model chunk (a recompute after preemption) filled every layer.
                switching.exit_start = seq.num_computed_tokens
            elif seq.num_preemptions and seq.steps_since_admitted == 1:
                # Readmitted straight to its last token: what came before is from the prefix
                # cache, whole; a catch-up must not rewrite those shared blocks.
                switching.exit_start = max(switching.exit_start or 0, starts[i])
        for i in batch.sampled:
            seq = batch.seqs[i]
            switching = seq.switching
            seq.token_models.append(EXIT_MODEL if i in small else TARGET_MODEL)
            if seq.finish_reason is not None:
                continue
            state = next_switch_state(self.config, switching.current, seq.profile.estimates)
            if switching.current.model == EXIT_MODEL and state.model == TARGET_MODEL:
                seq.num_computed_tokens = switching.exit_start  # catch up from there
                switching.exit_start = None
            elif switching.current.model == TARGET_MODEL and state.model == EXIT_MODEL:
                switching.exit_start = seq.num_computed_tokens
            switching.current = state
