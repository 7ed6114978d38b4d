"""Which sequences advance, which wait, and which is preempted (the paper's macro scale).

A policy only orders: the scheduler owns the mechanics (token budget, KV blocks, preemption by
recompute) and asks the policy for an order and, when blocks run out, for a victim. Policies see
sequences through the small protocol below, so they can be tested without an engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

from etinfer.control.registry import Registry


class Schedulable(Protocol):
    arrival_time: float
    arrival_index: int  # breaks ties between equal arrival times
    num_computed_tokens: int


class SchedulingPolicy(ABC):
    @abstractmethod
    def order(self, seqs: Sequence[Schedulable]) -> list[Schedulable]:
        """Highest priority first."""

    def victim(self, candidates: Sequence[Schedulable]) -> Schedulable:
        """The sequence to preempt when KV blocks run out: the lowest in the order."""
        return self.order(candidates)[-1]


SCHEDULING_POLICIES: Registry[SchedulingPolicy] = Registry("scheduling policy")


@SCHEDULING_POLICIES.register("fcfs")
class FCFSPolicy(SchedulingPolicy):
    """First come, first served; the newest running sequence is preempted first.

    A preempted sequence keeps its arrival time, so it goes back to the head of the waiting
    queue instead of behind requests that arrived after it.
    """

    def order(self, seqs: Sequence[Schedulable]) -> list[Schedulable]:
        return sorted(seqs, key=lambda s: (s.arrival_time, s.arrival_index))
