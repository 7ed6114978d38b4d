"""Scripted sequences, a fake clock and policies reduced to one term, for the scheduling tests."""

from __future__ import annotations

import itertools

from etinfer.control.record import ControlRecord
from etinfer.control.scheduling import EntropyPolicy, SchedulingConfig
from etinfer.engine.sequence import Sequence
from etinfer.sampling_params import SamplingParams
from studies.laws.scheduling_sim import SimClock

BLOCK = 4
_ids = itertools.count()


def make_seq(
    prompt_len: int = 8,
    max_tokens: int = 16,
    *,
    arrival: float = 0.0,
    arrival_step: int = 0,
    priority: int = 0,
    slo: float | None = None,
) -> Sequence:
    index = next(_ids)
    tokens = list(range(1000 * index, 1000 * index + prompt_len))  # no shared prefixes
    seq = Sequence(
        f"r{index}",
        index,
        tokens,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        None,
        prompt=None,
        arrival_time=arrival,
        stream=False,
        priority=priority,
        slo=slo,
    )
    seq.arrival_step = arrival_step
    return seq


def decoding(seq: Sequence, generated: int) -> Sequence:
    """As if ``seq`` had read its prompt and generated ``generated`` tokens."""
    seq.token_ids += [7] * generated
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


def seen(policy, *seqs, step: int = 0):
    """``policy`` at the start of step ``step`` with ``seqs`` waiting: the step's control record
    carries their entropy as their profiles hold it now."""
    policy.begin_step(ControlRecord.build(step, (), seqs))
    return policy


def only(term: str, clock: SimClock | None = None, **overrides) -> EntropyPolicy:
    """A policy whose priority is one term (urgency cannot be off: it keeps a tiny weight)."""
    weights = {"alpha": 0.0, "beta": 0.0, "gamma": 0.0, "delta": 1e-9} | {term: 1.0}
    return EntropyPolicy(SchedulingConfig(**weights, **overrides), clock=clock or SimClock())
