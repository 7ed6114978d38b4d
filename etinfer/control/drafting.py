"""Speculative decoding's control law: how many drafted tokens each decoding sequence proposes.

A drafter proposes tokens, the model verifies them all in one forward pass and keeps the longest
prefix it would have produced itself, plus one token of its own; so a step is wasted in
proportion to the drafts rejected. Where entropy enters is the length: a sequence whose latest
predictive entropy is high is about to take a token the model itself is unsure of, and a
drafter (which knows less) will rarely guess it, so it proposes nothing that step. Two
references to compare it with:

- ``fixed``: always ``num_draft_tokens`` (vLLM's default);
- ``heuristic``: transformers' schedule for assisted generation: the length grows by 2 after a
  step whose drafts were all accepted and shrinks by 1 otherwise.

The entropy law (the default) keeps the heuristic's length and adds the gate: measured side by
side, the heuristic's growth drafted long runs where text is copied (2.40x against 2.02x fixed at
batch 1) and the gate cut drafts on chat; BENCHMARKS.md has the table.

**Drafts only where they pay, measured as the engine runs** (adaptive schedules): whether a
draft pays depends on the host and the model as much as on the text (an early exit of 10 of 30
layers gained 1.33x on copying on one host and lost 0.75x on another), so the engine times its
steps (``DraftCosts``: a plain step's seconds, and what each token asked of the drafter adds to
a step, drafting and verifying it, in plain steps; an early exit that stops at its first unsure
token has run its layers all the same, where a lookup that finds nothing has cost nothing) and
each sequence weighs what its drafting steps gained (tokens accepted) against what they cost
(``SpeculationState.payoff``). A sequence whose drafts do not pay (by ``PAY_MARGIN`` tokens a
step) rests from drafting for 1, 2, 4 ... 64 steps, then drafts one token to measure again, and
comes back to its full length by halving its rest each time drafts pay; the configured ``fixed``
schedule, a reference, always drafts.

**What finished requests say of the drafter.** A sequence learns alone, and learning costs: a
first draft at full length and seven one-token tries in 128 tokens took about 5 % off an early
exit that never pays on this host (0.94-0.98x plain decoding, BENCHMARKS.md). So the engine
also keeps, from the requests that finished, whether their drafts paid all told
(``DraftCosts.request_finished``): after one that did not, new sequences try one token first
rather than their full length, and a try that does not pay rests them at least as long as that
request came to rest (``start_rest``, doubled by each such request up to ``MAX_START_REST``);
a request whose drafts paid halves it. A passage to copy is still found at its first token
(the one-token try pays and the length grows from there), where an engine-wide rest before the
first try took prompt lookup on copying from 1.99x to 1.67x.

From ``disable_batch_size`` decoding sequences on no one drafts (vLLM's
``speculative_disable_by_batch_size``): a batch already shares the weight reads that verification
would otherwise amortise, so every draft token costs nearly a token of compute (measured: at 4
sequences prompt lookup gained 1.05x on copying and lost 0.82-0.90x on chat; BENCHMARKS.md).

The law is pure: the engine asks it from the step's control record and applies its answer as the
step's shape (``StepShape.draft_lengths``). Each request carries its own
:class:`SpeculationState` (the length its schedule drafts next, and its totals), which the
engine's speculator moves after every step and the record reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from etinfer.control.record import Controlled, ControlRecord, StepShape
from etinfer.control.shaping import StepShaper
from etinfer.validation import check_choice, check_float, check_int

SPECULATIVE_METHODS = ("ngram", "draft")
DRAFT_SCHEDULES = ("entropy", "fixed", "heuristic")
MAX_DRAFT_TOKENS = 16
MEMORY = 0.3  # the weight of the latest measurement in the running estimates
MAX_REST = 64  # steps: the longest a sequence whose drafts do not pay rests before drafting again
MAX_START_REST = 1024  # ... and the longest, where finished requests' drafts did not pay either
# Tokens a drafting step must gain beyond its measured cost to count as paying: where drafts
# only break even, the noise of timing one step decides, and a wrong guess costs (BENCHMARKS.md)
PAY_MARGIN = 0.25
PLAIN_REFRESH = 64  # steps: a plain step's time older than this is measured again


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (lossless: outputs are those of the model alone, in distribution,
    and token for token when greedy).

    - method: ``ngram`` proposes what followed the latest earlier occurrence of the sequence's
      last ``ngram_max``..``ngram_min`` tokens (prompt lookup); no second model. ``draft``
      proposes the greedy tokens of the engine's ``draft_model`` (``self:N``: an early exit).
    - num_draft_tokens: tokens a sequence proposes per step (1..16); the adaptive schedules
      start from it and move it between 1 and 16.
    - adaptive: ``True`` (the entropy law above), ``False`` (fixed length) or ``"heuristic"``.
    - entropy_threshold: nats; with ``adaptive``, no drafts after a token drawn from a
      distribution with more entropy than this, and an early-exit drafter stops where its own
      distribution has more.
    - exit_adapter: an early-exit drafter maps its hidden state through the fitted adapter.
    - weigh_cost: with an adaptive schedule, a sequence whose drafts do not pay for what the
      engine measures them to cost rests from drafting (False: they are never weighed).
    - disable_batch_size: no drafts in a step with at least this many decoding sequences.
    """

    method: str = "ngram"
    num_draft_tokens: int = 4
    adaptive: bool | str = True
    entropy_threshold: float = 1.5
    disable_batch_size: int = 4
    ngram_max: int = 3
    ngram_min: int = 2
    exit_adapter: bool = True
    weigh_cost: bool = True

    def __post_init__(self) -> None:
        check_choice("speculative.method", self.method, SPECULATIVE_METHODS)
        check_int("num_draft_tokens", self.num_draft_tokens, low=1, high=MAX_DRAFT_TOKENS)
        if not isinstance(self.adaptive, bool):
            check_choice("adaptive", self.adaptive, (True, False, "heuristic"))
        check_float("entropy_threshold", self.entropy_threshold, low=0.0)
        check_int("disable_batch_size", self.disable_batch_size, low=1)
        check_int("ngram_min", self.ngram_min, low=1)
        check_int("ngram_max", self.ngram_max, low=self.ngram_min)

    @property
    def weighs_cost(self) -> bool:
        """Whether sequences rest where their drafts do not pay (the adaptive schedules)."""
        return self.weigh_cost and self.schedule != "fixed"

    @property
    def schedule(self) -> str:
        if self.adaptive is True:
            return "entropy"
        return "fixed" if self.adaptive is False else self.adaptive

    def as_flag(self) -> str:
        """The command line's form of this config (``parse`` reads it back; the n-gram sizes,
        threshold and batch size keep their defaults there)."""
        return f"{self.method}:{self.num_draft_tokens}:{self.schedule}"

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig | None:
        """The command line's form: ``none`` or ``METHOD[:TOKENS[:SCHEDULE]]``, schedule one of
        entropy, fixed, heuristic (``ngram:4:fixed``)."""
        if text == "none":
            return None
        method, *rest = text.split(":")
        try:
            tokens = int(rest[0]) if rest else cls.num_draft_tokens
        except ValueError:
            raise ValueError(
                f"speculative: draft tokens must be an integer, got {rest[0]!r}"
            ) from None
        schedule = rest[1] if len(rest) > 1 else "entropy"
        check_choice("speculative schedule", schedule, DRAFT_SCHEDULES)
        adaptive = {"entropy": True, "fixed": False}.get(schedule, schedule)
        return cls(method=method, num_draft_tokens=tokens, adaptive=adaptive)


def next_draft_length(
    config: SpeculativeConfig, length: int | None, drafted: int, accepted: int
) -> int | None:
    """The heuristic schedule's length after a step that verified ``drafted`` tokens (None
    before the first: the configured number)."""
    if config.schedule == "fixed" or not drafted:
        return length
    length = config.num_draft_tokens if length is None else length
    if accepted == drafted:
        return min(length + 2, MAX_DRAFT_TOKENS)
    return max(length - 1, 1)


def running_mean(old: float | None, new: float) -> float:
    return new if old is None else (1 - MEMORY) * old + MEMORY * new


@dataclass
class DraftCosts:
    """What drafting costs on this host and model, as the engine measures it: a decode-only
    step's seconds where the drafter was not asked for tokens, by its decoding rows (and the
    step it was last measured at), and what each token asked of it adds to a step (drafting,
    and verifying what it drafted), in plain steps."""

    plain_seconds: dict[int, float] = field(default_factory=dict)
    plain_measured: dict[int, int] = field(default_factory=dict)
    per_draft: float | None = None  # in plain steps; None until both kinds were timed
    # The least a sequence rests after a try that does not pay: 0 while finished requests'
    # drafts paid; while it is not, a sequence's first try is one token.
    start_rest: int = 0

    def observe(self, step: int, rows: int, asked: int, seconds: float) -> None:
        """A decode-only step ``step`` of ``rows`` sequences took ``seconds``, drafting
        included, with ``asked`` tokens asked of the drafter."""
        plain = self.plain_seconds.get(rows)
        if not asked:
            self.plain_seconds[rows] = running_mean(plain, seconds)
            self.plain_measured[rows] = step
        elif plain is not None:
            self.per_draft = running_mean(self.per_draft, (seconds - plain) / (asked * plain))

    def request_finished(self, state: SpeculationState) -> None:
        """Learn from a finished request's drafting steps whose cost was weighed, all told."""
        if not state.weighed_steps:
            return
        if state.gained > PAY_MARGIN * state.weighed_steps:
            self.start_rest //= 2
        else:
            self.start_rest = min(max(state.rest, 2 * self.start_rest), MAX_START_REST)

    def needs_plain(self, step: int, rows: int) -> bool:
        """Whether step ``step`` of ``rows`` decoding sequences should run without drafts, to
        time a plain step (never timed at this size, or too long ago)."""
        return step - self.plain_measured.get(rows, -PLAIN_REFRESH) >= PLAIN_REFRESH


@dataclass
class SpeculationState:
    """One request under speculative decoding: the length the adaptive schedules draft next
    (None: the configured ``num_draft_tokens``), what its drafting steps gained over their cost
    and how long it rests from drafting, and the tokens drafted and accepted so far."""

    draft_length: int | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    payoff: float | None = None  # tokens a drafting step gains beyond its cost (running mean)
    rest: int = 0  # steps it rested last: doubled after each drafting step that does not pay
    resume_at: int = 0  # the output token from which it drafts again
    gained: float = 0.0  # tokens its weighed drafting steps gained beyond their cost, in all
    weighed_steps: int = 0

    def record(
        self,
        config: SpeculativeConfig,
        drafted: int,
        accepted: int,
        cost: float | None = None,
        output_tokens: int = 0,
        asked: int | None = None,
        least_rest: int = 0,
    ) -> None:
        """A step verified ``drafted`` tokens and accepted ``accepted`` of them, after the
        drafter was asked for ``asked`` (None: ``drafted``), each costing ``cost`` tokens of
        the step (None: not measured yet); the sequence has ``output_tokens`` tokens now. A
        step that does not pay rests it at least ``least_rest`` steps (what
        ``DraftCosts.start_rest`` says)."""
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.draft_length = next_draft_length(config, self.draft_length, drafted, accepted)
        asked = drafted if asked is None else asked
        if not asked or cost is None:
            return
        gain = accepted - asked * cost
        self.gained += gain
        self.weighed_steps += 1
        # After a rest the text may have changed (a passage to copy begins): measured afresh.
        self.payoff = gain if self.rest else running_mean(self.payoff, gain)
        if self.payoff > PAY_MARGIN:
            # Back by halves: a sequence whose drafts pay now and then, at a loss in between,
            # would otherwise draft in full after every lucky one-token try.
            self.rest //= 2
            self.resume_at = 0
        else:
            self.rest = max(min(max(1, 2 * self.rest), MAX_REST), least_rest)
            self.resume_at = output_tokens + self.rest

    def next_length(self, output_tokens: int) -> int | None:
        """The length it drafts at its next step: 0 while it rests, and 1 when it tries again
        after a rest (the cheapest measure of whether drafts pay again)."""
        if output_tokens < self.resume_at:
            return 0
        return 1 if self.rest else self.draft_length


class SpeculativeShaper(StepShaper):
    """Draft lengths for the step's sequences (decode rows first; others get 0)."""

    def __init__(self, config: SpeculativeConfig, costs: DraftCosts | None = None) -> None:
        """``costs``: what the engine measures drafting to cost (adaptive schedules time a
        plain step where it has none)."""
        self.config = config
        self.costs = costs

    def shape(self, record: ControlRecord, seqs: Sequence[Controlled]) -> StepShape:
        decoding = [seq.num_computed_tokens == seq.num_tokens - 1 for seq in seqs]
        rows = sum(decoding)
        if rows >= self.config.disable_batch_size:
            return StepShape()
        timing = self.costs is not None and self.config.weighs_cost
        if timing and rows == len(seqs) and self.costs.needs_plain(record.step, rows):
            return StepShape()
        return StepShape(
            draft_lengths=tuple(
                self._length(record, seq) if decodes else 0
                for seq, decodes in zip(seqs, decoding, strict=True)
            )
        )

    def _length(self, record: ControlRecord, seq: Controlled) -> int:
        entry = record[seq]
        schedule = self.config.schedule
        entropy, threshold = entry.predictive_entropy, self.config.entropy_threshold
        if schedule == "entropy" and entropy is not None and entropy > threshold:
            return 0
        if schedule != "fixed" and entry.draft_length is not None:
            return entry.draft_length
        if self.costs is not None and self.config.weighs_cost and self.costs.start_rest:
            return 1  # its first try, where finished requests' drafts did not pay
        return self.config.num_draft_tokens
