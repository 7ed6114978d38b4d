"""Entropy Adaptive Decoding (seed 004): which model writes a sequence's next token.

Generate with the small model while the rolling entropy of the predictions stays low, hand over
to the large model when it rises, hand back when it falls again. Lossy by design: the small
model's tokens are its own, not checked by the large model. The law reads the predictive entropy
of the tokens written so far (the control signal pruning, scheduling and drafting read too: the
request's estimator on calibrated logits, each measured on the distribution of the model that
wrote it) and the sequence's current stretch; it is pure, and the engine applies its answer
after each token.

The paper's abstract (all of it we hold) gives no window or threshold values; ours are chosen
from the measured curve of large-model share against quality (``python -m studies switching``,
BENCHMARKS.md): with the first 22 of SmolLM2's 30 layers as the small model, a threshold of
0.5 nats was the only one to keep 95 % of the large model's quality, handing it 6 % of the
tokens; 1.0 handed 11 % at 80 %.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from etinfer.control.record import TARGET_MODEL
from etinfer.validation import check_float, check_int

EXIT_MODEL = "exit"  # the small model: the target's first N layers and a fitted exit


@dataclass(frozen=True)
class SwitchingConfig:
    """- window: tokens whose mean entropy is the rolling entropy.
    - threshold: nats; the small model hands over when the rolling entropy exceeds it.
    - hysteresis: nats; the large model hands back below ``threshold - hysteresis``.
    - min_stretch: tokens a model writes before another switch may happen.
    - exit_adapter: the small model reads through the fitted exit adapter (else the bare exit).
    """

    window: int = 4
    threshold: float = 0.5
    hysteresis: float = 0.25
    min_stretch: int = 4
    exit_adapter: bool = True

    def __post_init__(self) -> None:
        check_int("switching.window", self.window, low=1, high=1024)
        check_float("switching.threshold", self.threshold, low=0.0)
        check_float("switching.hysteresis", self.hysteresis, low=0.0, high=self.threshold)
        check_int("switching.min_stretch", self.min_stretch, low=1)


@dataclass(frozen=True)
class SwitchState:
    model: str  # which model writes the next token
    stretch: int  # tokens the current model has written since the last switch

    @classmethod
    def initial(cls, config: SwitchingConfig) -> SwitchState:
        """The prompt and its first token belong to the large model; free to hand over."""
        return cls(TARGET_MODEL, config.min_stretch)


@dataclass
class SwitchingState:
    """One request under switching: the law's state (``current``), and where the small model's
    current stretch began (``exit_start``): the layers above its exit hold nothing from there
    on, so the prefix cache publishes no block past it and the large model, taking over,
    catches up from it. None while every layer holds every computed token."""

    current: SwitchState
    exit_start: int | None = None


def next_switch_state(
    config: SwitchingConfig, state: SwitchState, entropies: Sequence[float]
) -> SwitchState:
    """The state after one more token, given the entropies of every token written so far."""
    stretch = state.stretch + 1
    recent = entropies[-config.window :]
    if stretch >= config.min_stretch and recent:
        rolling = sum(recent) / len(recent)
        if state.model == EXIT_MODEL and rolling > config.threshold:
            return SwitchState(TARGET_MODEL, 0)
        if state.model == TARGET_MODEL and rolling < config.threshold - config.hysteresis:
            return SwitchState(EXIT_MODEL, 0)
    return SwitchState(state.model, stretch)
