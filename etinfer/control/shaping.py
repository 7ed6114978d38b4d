"""Step shaping, the third depth of the control seam: how a scheduled step is computed.

Per-step laws decide which sequences advance, their temperatures and block budgets; per-layer
selectors decide what attention reads inside the forward pass. A step shaper decides the form of
the step itself, after scheduling, from the same control record: which of the engine's models
computes it (Entropy Adaptive Decoding hands confident stretches to a small model) and, with
speculative decoding, how many drafted tokens the model verifies. The plain shaper runs every
step on the model, one new token per decoding sequence; ``EngineConfig.step_shaper`` names the
shaper an engine uses.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from etinfer.control.record import Controlled, ControlRecord, StepShape
from etinfer.control.registry import Registry


class StepShaper(ABC):
    @abstractmethod
    def shape(self, record: ControlRecord, seqs: Sequence[Controlled]) -> StepShape:
        """How to compute the step that advances ``seqs`` (decode rows first)."""


STEP_SHAPERS: Registry[StepShaper] = Registry("step shaper")


@STEP_SHAPERS.register("plain")
class PlainShaper(StepShaper):
    def shape(self, record: ControlRecord, seqs: Sequence[Controlled]) -> StepShape:
        return StepShape()
