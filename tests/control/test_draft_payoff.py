"""Drafts only where they pay: the costs the engine measures, each sequence's rests, and the
plain steps the law asks for to time them (pure law; the engine's side in test_speculative)."""

import pytest

from etinfer.control.drafting import (
    MAX_REST,
    MAX_START_REST,
    PLAIN_REFRESH,
    DraftCosts,
    SpeculationState,
    SpeculativeConfig,
    SpeculativeShaper,
)
from etinfer.control.record import ControlRecord

ENTROPY = SpeculativeConfig()


def test_a_drafted_token_costs_what_it_adds_to_a_plain_step_of_the_same_size():
    costs = DraftCosts()
    costs.observe(step=1, rows=1, asked=4, seconds=0.020)  # no plain step to compare with yet
    assert costs.per_draft is None
    costs.observe(step=2, rows=1, asked=0, seconds=0.010)
    costs.observe(step=3, rows=2, asked=0, seconds=0.030)  # another size: its own plain time
    costs.observe(step=4, rows=1, asked=4, seconds=0.020)
    assert costs.per_draft == pytest.approx(0.25)  # 4 drafts doubled a 10 ms step
    costs.observe(step=5, rows=1, asked=2, seconds=0.010)  # free drafts: the estimate falls
    assert 0 < costs.per_draft < 0.25


def test_a_plain_step_is_timed_at_each_batch_size_and_again_when_old():
    costs = DraftCosts()
    assert costs.needs_plain(step=1, rows=1)
    costs.observe(step=1, rows=1, asked=0, seconds=0.01)
    assert not costs.needs_plain(step=2, rows=1) and costs.needs_plain(step=2, rows=2)
    assert costs.needs_plain(step=1 + PLAIN_REFRESH, rows=1)


def test_drafts_that_do_not_pay_rest_for_longer_each_time_and_resume_when_they_pay():
    state = SpeculationState()
    state.record(ENTROPY, drafted=4, accepted=0, cost=None, output_tokens=5)
    assert state.next_length(6) is not None and state.next_length(6) > 0  # cost unknown: drafts
    rests = []
    for tokens in range(10, 200, 10):
        state.record(ENTROPY, drafted=4, accepted=0, cost=0.5, output_tokens=tokens)
        rests.append(state.rest)
        assert state.next_length(tokens) == 0 and state.next_length(tokens + state.rest) > 0
    assert rests[:4] == [1, 2, 4, 8] and max(rests) == MAX_REST
    backing = []
    for tokens in range(300, 380, 10):  # a copied passage: what it drafts is accepted, cheaply
        assert state.next_length(tokens) == (1 if state.rest else state.draft_length)
        state.record(ENTROPY, drafted=1, accepted=1, cost=0.1, output_tokens=tokens)
        backing.append(state.rest)
    assert backing == [32, 16, 8, 4, 2, 1, 0, 0]  # back to its full length by halves
    assert state.payoff > 0 and state.next_length(381) == state.draft_length > 1
    even = SpeculationState()  # drafts that only break even: within the margin, they rest
    even.record(ENTROPY, drafted=4, accepted=1, cost=0.2, output_tokens=10)
    assert even.payoff == pytest.approx(0.2) and even.next_length(10) == 0


class Decoding:
    """A sequence one decode step into its output."""

    def __init__(self, speculation: SpeculationState) -> None:
        self.speculation = speculation
        self.num_computed_tokens, self.num_tokens, self.num_output_tokens = 9, 10, 3
        self.kv_offset, self.block_budget, self.last_blocks_kept = 0, None, 1.0
        self.temperature_state = None
        from etinfer.control.entropy_profile import EntropyProfile

        self.profile = EntropyProfile()

    @property
    def draft_length(self):
        return self.speculation.next_length(self.num_output_tokens)


@pytest.mark.parametrize("schedule", [True, "heuristic", False])
def test_the_law_times_a_plain_step_and_rests_a_sequence_whose_drafts_do_not_pay(schedule):
    config = SpeculativeConfig(adaptive=schedule)
    costs = DraftCosts()
    shaper = SpeculativeShaper(config, costs)
    seq = Decoding(SpeculationState())
    record = ControlRecord.build(1, (seq,), ())
    fixed = schedule is False
    # No plain step timed yet: the adaptive schedules time one first.
    assert shaper.shape(record, [seq]).draft_lengths == ((4,) if fixed else ())
    costs.observe(step=1, rows=1, asked=0, seconds=0.01)
    assert shaper.shape(ControlRecord.build(2, (seq,), ()), [seq]).draft_lengths == (4,)
    seq.speculation.record(config, drafted=4, accepted=0, cost=0.8, output_tokens=3)
    lengths = shaper.shape(ControlRecord.build(3, (seq,), ()), [seq]).draft_lengths
    assert lengths == ((4,) if fixed else (0,))  # the fixed schedule, a reference, never rests


def test_with_cost_not_weighed_the_law_never_asks_for_a_plain_step():
    config = SpeculativeConfig(weigh_cost=False)
    assert not config.weighs_cost and SpeculativeConfig().weighs_cost
    assert not SpeculativeConfig(adaptive=False).weighs_cost
    seq = Decoding(SpeculationState())
    shaper = SpeculativeShaper(config, DraftCosts())
    assert shaper.shape(ControlRecord.build(1, (seq,), ()), [seq]).draft_lengths == (4,)


def test_asking_the_drafter_costs_even_where_it_drafts_nothing():
    """An early exit that stops at its first unsure token has run its layers all the same."""
    state = SpeculationState()
    state.record(ENTROPY, drafted=0, accepted=0, cost=0.3, output_tokens=5, asked=4)
    assert state.payoff < 0 and state.next_length(5) == 0


def finished(gains: list[float], rest: int) -> SpeculationState:
    """A finished request whose weighed drafting steps gained ``gains`` and which rests ``rest``."""
    state = SpeculationState(rest=rest)
    state.gained, state.weighed_steps = sum(gains), len(gains)
    return state


def test_finished_requests_whose_drafts_did_not_pay_make_new_sequences_rest_longer():
    costs = DraftCosts()
    costs.request_finished(SpeculationState())  # never weighed: says nothing
    assert costs.start_rest == 0
    costs.request_finished(finished([0.9, -0.5, 0.1], rest=0))  # paid all told
    assert costs.start_rest == 0
    costs.request_finished(finished([-0.4] * 7, rest=MAX_REST))
    assert costs.start_rest == MAX_REST  # as long as that request came to rest
    costs.request_finished(finished([-0.4], rest=1))
    assert costs.start_rest == 2 * MAX_REST  # doubled by each such request ...
    for _ in range(10):
        costs.request_finished(finished([-0.4], rest=1))
    assert costs.start_rest == MAX_START_REST  # ... up to its bound
    costs.request_finished(finished([1.0, 2.0], rest=0))
    assert costs.start_rest == MAX_START_REST // 2  # halved by one whose drafts paid


def test_a_try_that_does_not_pay_rests_at_least_what_finished_requests_say():
    state = SpeculationState()
    state.record(ENTROPY, drafted=1, accepted=0, cost=0.4, output_tokens=3, least_rest=256)
    assert state.rest == 256 and state.next_length(3 + 255) == 0 and state.next_length(259) == 1
    copying = SpeculationState()  # a passage to copy: its one-token try pays, it drafts on
    copying.record(ENTROPY, drafted=1, accepted=1, cost=0.1, output_tokens=3, least_rest=256)
    assert copying.rest == 0 and copying.next_length(4) > 1


def test_where_finished_requests_drafts_did_not_pay_a_sequence_tries_one_token_first():
    costs = DraftCosts()
    costs.observe(step=1, rows=1, asked=0, seconds=0.01)
    shaper = SpeculativeShaper(ENTROPY, costs)
    fresh = Decoding(SpeculationState())
    assert shaper.shape(ControlRecord.build(2, (fresh,), ()), [fresh]).draft_lengths == (4,)
    costs.start_rest = 64
    assert shaper.shape(ControlRecord.build(3, (fresh,), ()), [fresh]).draft_lengths == (1,)
    unweighed = SpeculativeShaper(SpeculativeConfig(weigh_cost=False), costs)
    assert unweighed.shape(ControlRecord.build(4, (fresh,), ()), [fresh]).draft_lengths == (4,)
