"""A sequence's entropy history, reduced to what the control laws read (paper section 2).

Only entropy reductions count as progress: ``dH_t = max(0, H_{t-1} - H_t)``; entropic time
``tau`` is their sum, the collapse rate is ``tau`` per token, and an exponential moving average
of ``dH`` is the expected reduction of the next step (what the scheduler will rank by). A new
sequence starts from a prior for that expectation.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EntropyProfile:
    expected_reduction: float = 0.0  # EMA of dH; starts at the prior
    decay: float = 0.8  # weight of the past in the EMA: about five steps of memory
    entropic_time: float = 0.0
    steps: int = 0
    last: float | None = None

    def update(self, h: float) -> float:
        """Record one step's entropy; return its irreversible reduction."""
        reduction = 0.0 if self.last is None else max(0.0, self.last - h)
        if self.last is not None:
            self.entropic_time += reduction
            self.expected_reduction = (
                self.decay * self.expected_reduction + (1 - self.decay) * reduction
            )
        self.last = h
        self.steps += 1
        return reduction

    @property
    def collapse_rate(self) -> float:
        """Entropic time per token."""
        return self.entropic_time / self.steps if self.steps else 0.0
