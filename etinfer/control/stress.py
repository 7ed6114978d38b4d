"""A stress on the control signal, for robustness studies only (the paper's section 6.2).

It distorts the predictive entropy that the control layers read (pruning budgets, scheduling,
draft lengths, switching), never the distribution a request samples from: a study asks for it
by name, and a user who does not gets the engine unchanged (off by default).

- ``logit_scale``: the entropy is measured on ``softmax(logit_scale * z)`` (before any
  post-hoc calibration): above 1 the model looks over-confident (entropy biased low), below 1
  under-confident.
- ``entropy_bias``: nats added to the estimate and to its upper side (floored at 0): an
  estimator that is off by a constant.
"""

from __future__ import annotations

from dataclasses import dataclass

from etinfer.validation import check_float


@dataclass(frozen=True)
class StressConfig:
    logit_scale: float = 1.0
    entropy_bias: float = 0.0

    def __post_init__(self) -> None:
        # Past these the signal is no longer a distortion of the model's: one token or uniform.
        check_float("logit_scale", self.logit_scale, low=0.05, high=20.0)
        check_float("entropy_bias", self.entropy_bias, low=-10.0, high=10.0)

    @classmethod
    def parse(cls, text: str) -> StressConfig:
        """``SCALE[:BIAS]``, the command line's form (``1.5``, ``1:-0.3``)."""
        scale, _, bias = text.partition(":")
        try:
            return cls(float(scale), float(bias) if bias else 0.0)
        except ValueError as e:
            raise ValueError(f"stress must be SCALE[:BIAS] (1.5, 1:-0.3): {e}") from e

    def as_flag(self) -> str:
        return f"{self.logit_scale}:{self.entropy_bias}"
