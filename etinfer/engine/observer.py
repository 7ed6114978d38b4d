"""Step observers: what happened in each engine step, for whoever measures it.

Benchmarks, the ablation's work meter and the server's metrics all watch the engine the same
way: they register a callable, and the engine calls it once per step with a :class:`StepRecord`
(what the laws read and decided, the batch, the measurement, the time spent). An observer that
needs the step's logits says so when it registers; the others cost nothing extra. An observer
that raises is logged and skipped: the step has already happened, and watching it must not lose
its outputs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from etinfer.control.record import ControlRecord, StepDecisions
from etinfer.engine.runner.attention_stats import AttentionStats
from etinfer.engine.runner.model_runner import StepResult
from etinfer.engine.sampling.sampler import SamplerOutput
from etinfer.engine.sampling.step_sampling import Emitted
from etinfer.engine.scheduler import ScheduledBatch


@dataclass(frozen=True)
class StepRecord:
    step: int
    control: ControlRecord  # what the laws read
    decisions: StepDecisions  # what they decided
    request_ids: tuple[str, ...]  # the scheduled sequences, decode rows first
    starts: tuple[int, ...]  # tokens each had in the cache before the step
    num_tokens: tuple[int, ...]  # tokens each computed in the step
    num_decode: int  # decoding sequences (their last token, then any drafts) lead the batch
    preempted: tuple[str, ...]  # sequences preempted to make room, by request id
    # Per token the step emitted, its sequence (an index into request_ids): one per sampled
    # sequence, or more where speculative decoding accepted drafts.
    sampled: tuple[int, ...]
    # Per emitted token: the token, entropies (the model's, the predictive entropy the laws
    # read next step, the tempered one) and temperature; None when the step sampled nothing.
    measured: SamplerOutput | None
    sampled_positions: tuple[int, ...]  # per emitted token, its position in its sequence
    num_draft_tokens: int  # tokens drafted for the model to verify in this step
    num_accepted_tokens: int  # of which the model accepted
    attention: AttentionStats | None  # blocks decode attention read, when budgets were planned
    free_blocks: int  # free KV blocks once the batch had its blocks, before computing
    wall_time: float  # seconds in the engine's step, this one
    cpu_time: float  # CPU seconds this process spent in it
    logits: torch.Tensor | None  # [emitted tokens, vocab], for observers that asked for them

    @classmethod
    def of(
        cls,
        control: ControlRecord,
        decisions: StepDecisions,
        batch: ScheduledBatch,
        starts: list[int],
        result: StepResult,
        emitted: Emitted | None,
        *,
        free_blocks: int,
        since: tuple[float, float],
        logits: bool,
    ) -> StepRecord:
        """The record of a step that began at ``since`` (perf_counter, process_time)."""
        sampled = () if emitted is None else tuple(emitted.batch_indices)
        known = [n - len(d) for n, d in zip(batch.num_tokens, batch.drafts, strict=True)]
        columns = [0] * len(batch.seqs)
        positions = []
        for i in sampled:  # the c-th token a sequence emits predicts position start + known + c
            positions.append(starts[i] + known[i] + columns[i])
            columns[i] += 1
        step_logits = None
        if logits and emitted is not None:
            step_logits = result.logits[emitted.logits_rows]
        return cls(
            step=control.step,
            control=control,
            decisions=decisions,
            request_ids=tuple(seq.request_id for seq in batch.seqs),
            starts=tuple(starts),
            num_tokens=tuple(batch.num_tokens),
            num_decode=batch.num_decode,
            preempted=tuple(seq.request_id for seq in batch.preempted),
            sampled=sampled,
            measured=None if emitted is None else emitted.merged(),
            sampled_positions=tuple(positions),
            num_draft_tokens=sum(len(d) for d in batch.drafts),
            num_accepted_tokens=0 if emitted is None else sum(emitted.accepted),
            attention=result.attention,
            free_blocks=free_blocks,
            wall_time=time.perf_counter() - since[0],
            cpu_time=time.process_time() - since[1],
            logits=step_logits,
        )

    @property
    def prefill_tokens(self) -> int:
        return sum(self.num_tokens[self.num_decode :])


StepObserver = Callable[[StepRecord], None]
logger = logging.getLogger("etinfer.engine")


class Observers:
    """The observers registered with one engine, and whether any wants logits."""

    def __init__(self) -> None:
        self._wants_logits: dict[StepObserver, bool] = {}

    def add(self, observer: StepObserver, *, logits: bool = False) -> None:
        self._wants_logits[observer] = logits

    def remove(self, observer: StepObserver) -> None:
        self._wants_logits.pop(observer, None)

    def __bool__(self) -> bool:
        return bool(self._wants_logits)

    @property
    def want_logits(self) -> bool:
        return any(self._wants_logits.values())

    def notify(self, record: StepRecord) -> None:
        for observer in list(self._wants_logits):
            try:
                observer(record)
            except Exception:
                logger.exception("step observer %r failed", observer)
