"""A sequence's predictive entropy history, reduced to what the control laws read (paper
section 2).

The sampler measures the predictive entropy of every sampled row once per step (the request's
estimator on calibrated logits) together with the estimate's upper side; the profile keeps the
latest of both. Only entropy reductions count as progress: ``dH_t = max(0, H_{t-1} - H_t)``;
entropic time ``tau`` is their sum, the collapse rate is ``tau`` per token, and an exponential
moving average of ``dH`` is the expected reduction of the next step (what the scheduler ranks
by). Until it has seen reductions, a sequence is ranked by a prior for that expectation.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EntropyProfile:
    expected_reduction: float = 0.0  # EMA of dH; starts at 0, see `prior_weight`
    decay: float = 0.8  # weight of the past in the EMA: about five steps of memory
    entropic_time: float = 0.0
    steps: int = 0
    predictive_entropy: float | None = None  # the latest estimate, nats
    # Its upper side (the tail bound for top-k estimators, the value itself when exact): what
    # decisions that prune or deprioritise read, so that an underestimate never makes them
    # more aggressive.
    predictive_entropy_upper: float | None = None
    estimates: list[float] = field(default_factory=list)  # every step's, for windowed laws

    def update(self, predictive_entropy: float, upper: float | None = None) -> float:
        """Record one step's estimate (and its upper side); return its irreversible reduction."""
        last = self.predictive_entropy
        reduction = 0.0 if last is None else max(0.0, last - predictive_entropy)
        if last is not None:
            self.entropic_time += reduction
            self.expected_reduction = (
                self.decay * self.expected_reduction + (1 - self.decay) * reduction
            )
        self.predictive_entropy = predictive_entropy
        self.estimates.append(predictive_entropy)
        self.predictive_entropy_upper = predictive_entropy if upper is None else upper
        self.steps += 1
        return reduction

    @property
    def prior_weight(self) -> float:
        """The weight the EMA has not yet given to measured reductions (1 until one is seen):
        a ranking adds ``prior_weight * prior`` to ``expected_reduction``."""
        return self.decay ** max(0, self.steps - 1)

    @property
    def collapse_rate(self) -> float:
        """Entropic time per token."""
        return self.entropic_time / self.steps if self.steps else 0.0
