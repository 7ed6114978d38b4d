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
from etinfer.engine.model_runner import AttentionStats, StepResult
from etinfer.engine.sampler import SamplerOutput
from etinfer.engine.scheduler import ScheduledBatch


@dataclass(frozen=True)
class StepRecord:
    step: int
    control: ControlRecord  # what the laws read
    decisions: StepDecisions  # what they decided
    request_ids: tuple[str, ...]  # the scheduled sequences, decode rows first
    starts: tuple[int, ...]  # tokens each had in the cache before the step
    num_tokens: tuple[int, ...]  # tokens each computed in the step
    num_decode: int  # decode rows (one token each) lead the batch
    preempted: tuple[str, ...]  # sequences preempted to make room, by request id
    sampled: tuple[int, ...]  # rows whose next token was sampled (indices into request_ids)
    # Per sampled row: its token, entropies (the model's, the predictive entropy the laws read
    # next step, the tempered one) and temperature; None when the step sampled nothing.
    measured: SamplerOutput | None
    attention: AttentionStats | None  # blocks decode attention read, when budgets were planned
    free_blocks: int  # free KV blocks once the batch had its blocks, before computing
    wall_time: float  # seconds in the engine's step, this one
    cpu_time: float  # CPU seconds this process spent in it
    logits: torch.Tensor | None  # [sampled rows, vocab], for observers that asked for them

    @classmethod
    def of(
        cls,
        control: ControlRecord,
        decisions: StepDecisions,
        batch: ScheduledBatch,
        starts: list[int],
        result: StepResult,
        *,
        free_blocks: int,
        since: tuple[float, float],
        logits: bool,
    ) -> StepRecord:
        """The record of a step that began at ``since`` (perf_counter, process_time)."""
        return cls(
            step=control.step,
            control=control,
            decisions=decisions,
            request_ids=tuple(seq.request_id for seq in batch.seqs),
            starts=tuple(starts),
            num_tokens=tuple(batch.num_tokens),
            num_decode=batch.num_decode,
            preempted=tuple(seq.request_id for seq in batch.preempted),
            sampled=tuple(batch.sampled),
            measured=result.output,
            attention=result.attention,
            free_blocks=free_blocks,
            wall_time=time.perf_counter() - since[0],
            cpu_time=time.process_time() - since[1],
            logits=result.logits if logits else None,
        )

    @property
    def prefill_tokens(self) -> int:
        return sum(self.num_tokens[self.num_decode :])

    @property
    def sampled_positions(self) -> list[int]:
        """Per sampled row, the position of the token it predicts: its sequence's length."""
        return [self.starts[i] + self.num_tokens[i] for i in self.sampled]


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
