"""The step's control record: what every control law reads, built once per step by the engine.

The paper's loop (section 3.4), as the engine runs it:

1. the sampler measures each sampled sequence's predictive entropy, once per step, batched;
2. the engine writes it into that sequence's :class:`EntropyProfile`;
3. at the start of the next step the engine snapshots every live sequence's profile and carried
   control state into one :class:`ControlRecord`, and each law decides from it: the scheduling
   policy (which sequences advance), the block selector (each decoding sequence's block budget),
   the temperature law (the state it starts the step from) and the step shaper (what runs).

A law is thus two calls from the measurement: the engine records it, the law reads the record.
Each sequence's entry is a snapshot of its control state at the start of the step, so an observer
of the step sees what the laws saw; the sequences themselves (positions, lengths, requests'
settings) are the scheduler's, read as they are.

Predictive entropy (how sure the model is of the next token) is the only entropy here. Attention
entropy (how spread a head's reading of the context is) is a different quantity: the layers that
measure it keep it under that name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple, Protocol

from etinfer.control.entropy_profile import EntropyProfile
from etinfer.sampling_params import SamplingParams


class Controlled(Protocol):
    """A sequence as the control laws see it beside its record entry (the engine's ``Sequence``
    is one)."""

    arrival_time: float  # time.perf_counter() seconds
    arrival_step: int  # the scheduler's step count when it arrived
    arrival_index: int  # breaks ties between equal arrival times
    num_computed_tokens: int  # tokens whose keys and values are in the cache
    num_prompt_tokens: int
    num_preemptions: int
    steps_since_admitted: int  # steps scheduled since it last entered the running set
    priority: int  # lower value first, as in vLLM
    slo: float | None  # seconds from arrival within which the request wants to finish
    params: SamplingParams

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def kv_offset(self) -> int:
        """Cache entries KV compression dropped: the cache holds computed - offset."""


class Recordable(Controlled, Protocol):
    """A sequence and the control state the engine keeps on it, which the record snapshots
    (a layer's part read through the sequence's accessors: the layer's default where it is off)."""

    profile: EntropyProfile  # its predictive entropy so far
    temperature_state: float | None  # the temperature law's state: log T, or Mirostat's mu

    @property
    def block_budget(self) -> int | None:
        """Blocks decode attention kept last step (None: not pruned yet)."""

    @property
    def last_blocks_kept(self) -> float:
        """The share of the context decode attention read last step (1: all)."""

    @property
    def draft_length(self) -> int | None:
        """Tokens speculative decoding's schedule drafts next (None: the configured number)."""


class SequenceControl(NamedTuple):
    """One sequence's entry in the record: its predictive entropy and carried control state."""

    predictive_entropy: float | None  # the latest estimate, nats; None before the first
    predictive_entropy_upper: float | None  # its upper side, read by pruning decisions
    expected_reduction: float  # EMA of the irreversible entropy drops
    prior_weight: float  # the weight the EMA has not yet given to measurements
    temperature_state: float | None
    block_budget: int | None
    blocks_kept: float  # share of the context decode attention read last step (1: all)
    draft_length: int | None

    @classmethod
    def of(cls, seq: Recordable) -> SequenceControl:
        profile = seq.profile
        return cls(
            profile.predictive_entropy,
            profile.predictive_entropy_upper,
            profile.expected_reduction,
            profile.prior_weight,
            seq.temperature_state,
            seq.block_budget,
            seq.last_blocks_kept,
            seq.draft_length,
        )


@dataclass(frozen=True)
class ControlRecord:
    step: int  # the scheduler's step count, from 1
    running: tuple[Controlled, ...]
    waiting: tuple[Controlled, ...]
    seqs: Mapping[Controlled, SequenceControl]  # every running and waiting sequence

    @classmethod
    def build(
        cls, step: int, running: Iterable[Recordable], waiting: Iterable[Recordable]
    ) -> ControlRecord:
        running, waiting = tuple(running), tuple(waiting)
        seqs = {seq: SequenceControl.of(seq) for seq in (*running, *waiting)}
        return cls(step, running, waiting, MappingProxyType(seqs))

    def __getitem__(self, seq: Controlled) -> SequenceControl:
        return self.seqs[seq]


TARGET_MODEL = "target"  # the model the engine was built for; drafters get other names


@dataclass(frozen=True)
class StepShape:
    """How a step is computed (see ``shaping.py``)."""

    model: str = TARGET_MODEL  # which of the engine's models computes the step
    # Per scheduled sequence (decode rows first), how many drafted tokens it may propose for the
    # model to verify; empty: none drafts (the engine trims them to its budgets).
    draft_lengths: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepDecisions:
    """What the laws decided from one step's record; the engine applies it."""

    shape: StepShape
    # Per decoding sequence (decode rows first), the blocks its attention keeps; None when no
    # selector plans budgets (every sequence attends to its whole context).
    block_budgets: list[int] | None
    # Per sampled sequence, the state its temperature law starts the step from.
    temperature_states: list[float | None]
