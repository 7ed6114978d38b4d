"""Which sequences advance, which wait, and which is preempted (the paper's macro scale).

A policy only orders: the scheduler owns the mechanics (token budget, KV blocks, preemption by
recompute) and asks the policy for an order and, when blocks run out, for a victim. Policies see
sequences through the ``Controlled`` protocol and their entropy through the step's control
record, so they can be tested without an engine.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from etinfer.control.record import Controlled, ControlRecord
from etinfer.control.registry import Registry
from etinfer.validation import check_float, check_int


@dataclass(frozen=True)
class SchedulingConfig:
    """Coefficients and scales of the entropy policy's priority (see ``EntropyPolicy``)."""

    alpha: float = 1.0  # expected irreversible entropy reduction
    beta: float = 1.0  # compute cost of the next step
    gamma: float = 8.0  # KV memory held and still needed: remaining work, the term that matters
    delta: float = 1.0  # urgency; must be positive: aging is what rules out starvation
    # E[dH] of a sequence not yet measured, nats. The median of the profile's EMA on SmolLM2-135M
    # chat generations at temperature 0.7 was 0.7 nats (10th-90th percentile 0.4-1.1).
    entropy_prior: float = 0.7
    entropy_cap: float = 2.0  # nats; E[dH] is divided by it and clipped to [0, 1]
    # Context length at which one token's attention costs as much as its weight matmuls. On two
    # CPU cores a decode row's attention grows about 4 us per context token against roughly
    # 2 ms of matmuls and sampling, so about 512 tokens.
    attention_scale: float = 512.0
    cost_scale: float = 512.0  # token-equivalents of compute at which the cost term is 1/2
    # KV token-steps still to be held at which the memory term is 1/2. Small, so that the term
    # saturates for long requests: short ones overtake, while medium and long ones are told apart
    # more by age (the measurements behind each default are in BENCHMARKS.md, scheduling).
    memory_scale: float = 4096.0
    # Aging is (age / horizon) ** aging_power, the age counted in scheduler steps, not seconds:
    # what a wait costs is relative to how fast the engine works, so one default fits a busy CPU
    # and a GPU alike. Convex, so a request that has waited long is overtaken by ever fewer later
    # arrivals, while fresh arrivals are ordered by the other terms.
    # The horizon follows the backlog, because no fixed horizon serves both a deep queue and a
    # draining one: it is `aging_backlog` times the decode steps the requests in the engine still
    # need per running sequence (how long FCFS would make a new arrival wait, whatever the
    # order), scaled by waiting / running while fewer wait than run (FCFS then admits as soon as
    # that many slots free up), clipped to [aging_steps_min, aging_steps]. In a deep queue short
    # requests overtake within the wait FCFS would impose anyway; as it drains, the long waiters
    # go first, which also keeps the batch full of long requests at the end. `aging_steps`
    # bounds the horizon, so the starvation bound holds; aging_backlog = 0 keeps it there.
    aging_steps: float = 150.0
    aging_steps_min: float = 10.0
    aging_backlog: float = 0.5
    aging_power: float = 3.0
    # One step of a request's `priority` is worth this much urgency: more than every bounded term
    # together, so priority classes are strict until aging overrides them.
    priority_weight: float = 16.0
    slo_cap: float = 2.0  # urgency from an SLO stops growing at this multiple of the SLO
    max_preemptions: int = 2  # a request preempted this often is preempted only as a last resort
    # Hysteresis, so that a preemption's recompute is not thrown away again at once: a sequence
    # that (re)entered the running set fewer than `min_run_steps` steps ago is preempted only if
    # every other candidate is protected too; and while blocks run out at zero free, admission
    # stops while the free blocks would not cover the running sequences' next
    # `admission_lookahead` tokens. 16 tokens, rather than fewer, because a preemption costs the
    # real engine a whole recompute: on it, 16 halved the preemptions under KV pressure where 4
    # did not (the simulator prices recompute lower and cannot tell them apart).
    min_run_steps: int = 8
    admission_lookahead: int = 16

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma", "priority_weight", "slo_cap"):
            check_float(name, getattr(self, name), low=0.0)
        for name in ("delta", "entropy_cap", "attention_scale", "cost_scale", "memory_scale"):
            check_float(name, getattr(self, name), low=0.0, low_open=True)
        check_float("aging_steps", self.aging_steps, low=0.0, low_open=True)
        check_float("aging_steps_min", self.aging_steps_min, low=0.0, high=self.aging_steps)
        check_float("aging_backlog", self.aging_backlog, low=0.0)
        check_float("aging_power", self.aging_power, low=1.0)
        check_float("entropy_prior", self.entropy_prior, low=0.0, high=self.entropy_cap)
        check_int("max_preemptions", self.max_preemptions, low=0)
        check_int("min_run_steps", self.min_run_steps, low=0)
        check_int("admission_lookahead", self.admission_lookahead, low=0)

    @property
    def bounded_range(self) -> float:
        """How far apart every term but aging can put two requests (each term lies in [0, 1])."""
        return self.alpha + self.beta + self.gamma + self.delta * self.slo_cap

    def starvation_bound_steps(self, priority_gap: int = 0) -> float:
        """A request outranks every request that arrived more than this many steps after it,
        whose `priority` is at most ``priority_gap`` lower (more urgent) than its own.

        The aging curve g is convex with g(0) = 0, so g(w) - g(w - d) >= g(d) for every w >= d:
        an arrival d steps younger trails by at least ``delta * g(d)`` in urgency, which beats
        the bounded terms and the priority gap once d reaches this bound. Both requests are aged
        on the same horizon at any step, and a shorter one than ``aging_steps`` only widens the
        gap, so the bound holds however the horizon follows the backlog.
        """
        gap = self.bounded_range / self.delta + priority_gap * self.priority_weight
        return self.aging_steps * gap ** (1 / self.aging_power)


class SchedulingPolicy(ABC):
    """Every policy is built from the same arguments; FCFS reads none of them."""

    def __init__(
        self,
        config: SchedulingConfig | None = None,
        *,
        chunk_tokens: int = 1024,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = config or SchedulingConfig()
        self.chunk_tokens = chunk_tokens  # the scheduler's token budget: the largest chunk
        self.clock = clock  # the clock `arrival_time` was read from
        self.record = ControlRecord.build(0, (), ())  # the step's, once the scheduler begins one
        self.step = 0  # the scheduler's step count: the clock of aging

    def begin_step(self, record: ControlRecord) -> None:
        """Called by the scheduler before it orders anything in ``record.step``."""
        self.record, self.step = record, record.step

    @abstractmethod
    def order(self, seqs: Sequence[Controlled]) -> list[Controlled]:
        """Highest priority first."""

    def victim(self, candidates: Sequence[Controlled]) -> Controlled:
        """The sequence to preempt when KV blocks run out: the lowest in the order."""
        return self.order(candidates)[-1]

    def growth_reserve(self, seqs: Sequence[Controlled], block_size: int) -> int:
        """KV blocks to leave free for ``seqs`` to grow into when admitting a request; 0 admits
        while blocks last, as vLLM does."""
        return 0


def tokens_left(seq: Controlled) -> int:
    """Output tokens the request may still generate (the policy plans for all of them)."""
    return max(0, seq.params.max_tokens - seq.num_output_tokens)


SCHEDULING_POLICIES: Registry[SchedulingPolicy] = Registry("scheduling policy")


@SCHEDULING_POLICIES.register("fcfs")
class FCFSPolicy(SchedulingPolicy):
    """First come, first served; the newest running sequence is preempted first.

    A preempted sequence keeps its arrival time, so it goes back to the head of the waiting
    queue instead of behind requests that arrived after it.
    """

    def order(self, seqs: Sequence[Controlled]) -> list[Controlled]:
        return sorted(seqs, key=lambda s: (s.arrival_time, s.arrival_index))


@SCHEDULING_POLICIES.register("entropy")
class EntropyPolicy(SchedulingPolicy):
    """``P = alpha*E[dH] - beta*C - gamma*M + delta*U``, highest first (paper section 3.1).

    Every term but U is normalised into [0, 1], so P is bounded for any bounded wait
    (Proposition 2), and U follows one unbounded, convex aging curve of the wait for every
    request alike: a request outranks every arrival more than
    ``config.starvation_bound_steps()`` steps younger, so it competes with finitely many
    requests and is served (Proposition 3, by aging rather than by the paper's entropy-variance
    assumption, which no request can be made to satisfy).

    - E: the profile's EMA of irreversible entropy reduction, plus the prior with the weight the
      EMA has not yet given to measurements (the EMA starts from 0).
    - C: compute of the next step, in token-equivalents: a prompt chunk, or one decode row whose
      attention over the context is discounted by the share that pruning kept last step.
    - M: KV memory held and still needed, integrated over the request's remaining life: it holds
      its context for each of its remaining output tokens, and grows by one token per step. A
      request near its end scores near 0, which makes the order shortest-remaining-first.
    - U: the aging curve of the steps since arrival, on a horizon that follows the backlog,
      less ``priority_weight`` per step of the
      request's ``priority`` (lower is earlier, as in vLLM); plus, with an SLO, the fraction of
      it already spent, capped.

    C and M count neither a preempted sequence's recompute nor the blocks it gave back: its
    priority is what it was while running, so it keeps its place.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.horizon = self.config.aging_steps  # of aging, in steps; follows the backlog

    def begin_step(self, record: ControlRecord) -> None:
        super().begin_step(record)
        self.horizon = self.aging_horizon(record.running, record.waiting)

    def aging_horizon(self, running: Sequence[Controlled], waiting: Sequence[Controlled]) -> float:
        """``aging_backlog`` times the decode steps left per running sequence, scaled by
        waiting / running while fewer wait than run, clipped."""
        c = self.config
        if c.aging_backlog == 0:
            return c.aging_steps
        left = sum(map(tokens_left, (*running, *waiting)))
        slots = max(1, len(running))
        backlog = left / slots * min(1.0, len(waiting) / slots)
        return min(max(c.aging_backlog * backlog, c.aging_steps_min), c.aging_steps)

    def order(self, seqs: Sequence[Controlled]) -> list[Controlled]:
        now = self.clock()
        return sorted(seqs, key=lambda s: (-self.priority(s, now), s.arrival_time, s.arrival_index))

    def victim(self, candidates: Sequence[Controlled]) -> Controlled:
        """The least computed work goes first (it is the cheapest to recompute), among requests
        not yet preempted ``max_preemptions`` times and not (re)admitted within
        ``min_run_steps`` steps; the least important ``priority`` class first; the newest last."""
        config = self.config
        return min(
            candidates,
            key=lambda s: (
                s.num_preemptions >= config.max_preemptions,
                s.steps_since_admitted < config.min_run_steps,
                -s.priority,
                s.num_computed_tokens,
                -s.arrival_time,
                -s.arrival_index,
            ),
        )

    def growth_reserve(self, seqs: Sequence[Controlled], block_size: int) -> int:
        """The blocks ``seqs`` fill in their next ``admission_lookahead`` tokens."""
        look = self.config.admission_lookahead
        reserve = 0
        for s in seqs:
            now_blocks = -(-s.num_tokens // block_size)
            later = s.num_tokens + min(look, tokens_left(s))
            reserve += -(-later // block_size) - now_blocks
        return reserve

    def priority(self, seq: Controlled, now: float) -> float:
        c = self.config
        return (
            c.alpha * self.entropy_term(seq)
            - c.beta * self.cost_term(seq)
            - c.gamma * self.memory_term(seq)
            + c.delta * self.urgency_term(seq, now)
        )

    def entropy_term(self, seq: Controlled) -> float:
        config, entry = self.config, self.record[seq]
        expected = entry.expected_reduction + entry.prior_weight * config.entropy_prior
        return min(1.0, expected / config.entropy_cap)

    def cost_term(self, seq: Controlled) -> float:
        scale = self.config.attention_scale
        prompt_left = seq.num_prompt_tokens - seq.num_computed_tokens
        if seq.num_output_tokens == 0 and prompt_left > 0:
            n = min(prompt_left, self.chunk_tokens)
            cost = n * (1 + (seq.num_computed_tokens + n / 2) / scale)
        else:
            cost = 1 + seq.num_tokens * self.record[seq].blocks_kept / scale
        return cost / (cost + self.config.cost_scale)

    def memory_term(self, seq: Controlled) -> float:
        remaining = tokens_left(seq)
        token_steps = remaining * (seq.num_tokens + remaining / 2)
        return token_steps / (token_steps + self.config.memory_scale)

    def urgency_term(self, seq: Controlled, now: float) -> float:
        c = self.config
        age = max(0, self.step - seq.arrival_step)
        urgency = (age / self.horizon) ** c.aging_power - seq.priority * c.priority_weight
        if seq.slo is not None:
            urgency += min(max(0.0, now - seq.arrival_time) / seq.slo, c.slo_cap)
        return urgency
