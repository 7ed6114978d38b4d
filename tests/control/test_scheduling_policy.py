"""The entropy scheduling policy on scripted sequences and a fake clock: no model runs here."""

from __future__ import annotations

import pytest

from etinfer.config import EngineConfig
from etinfer.control.config import ControlConfig
from etinfer.control.pruning_state import PruningState
from etinfer.control.record import ControlRecord
from etinfer.control.scheduling import EntropyPolicy, SchedulingConfig
from tests.engine.scheduling_helpers import SimClock, decoding, make_seq, only, seen

# -- ordering by each term ---------------------------------------------------------------------


def test_higher_expected_entropy_reduction_goes_first():
    settled, unsettled = make_seq(), make_seq()
    for h in (3.0, 2.9, 2.9, 2.8):  # small reductions
        settled.profile.update(h)
    for h in (3.0, 1.5, 3.0, 1.0):  # large ones
        unsettled.profile.update(h)
    policy = seen(only("alpha"), settled, unsettled)
    assert policy.order([settled, unsettled]) == [unsettled, settled]


def test_a_new_sequence_starts_from_the_prior_and_measurements_replace_it():
    config = SchedulingConfig(entropy_prior=0.8, entropy_cap=2.0)
    policy = EntropyPolicy(config)
    seq = make_seq()
    assert seen(policy, seq).entropy_term(seq) == pytest.approx(0.4)
    seq.profile.update(1.0)  # a first entropy measures no reduction yet
    assert seen(policy, seq).entropy_term(seq) == pytest.approx(0.4)
    for _ in range(60):  # a steady reduction of 1.2 nats per step
        seq.profile.update(2.2)
        seq.profile.update(1.0)
    # EMA of ...0, 1.2: 2/3
    assert seen(policy, seq).entropy_term(seq) == pytest.approx(1 / 3, abs=0.01)


def test_the_policy_reads_entropy_from_the_record_not_the_sequence():
    """What a step's laws decide follows the record built at its start: a measurement that
    lands later in the step is read the next step."""
    policy = only("alpha")
    steady, dropping = make_seq(), make_seq()
    for h in (3.0, 2.9, 2.8):
        steady.profile.update(h)
        dropping.profile.update(h)
    seen(policy, steady, dropping)
    for h in (0.5, 3.0, 0.5):
        dropping.profile.update(h)  # large reductions, after the record was built
    assert policy.entropy_term(dropping) == policy.entropy_term(steady)
    seen(policy, steady, dropping)
    assert policy.order([steady, dropping]) == [dropping, steady]


def test_cheaper_next_step_goes_first():
    policy = only("beta")
    long_prompt, short_prompt = make_seq(prompt_len=900), make_seq(prompt_len=30)
    decode = decoding(make_seq(prompt_len=900), 5)
    seen(policy, long_prompt, short_prompt, decode)
    assert policy.order([long_prompt, short_prompt, decode]) == [decode, short_prompt, long_prompt]


def test_pruning_discounts_the_attention_of_a_decode_step():
    policy = only("beta")
    dense, pruned = decoding(make_seq(4000), 3), decoding(make_seq(4000), 3)
    pruned.pruning = PruningState(blocks_kept=[0.9, 0.25])  # the latest step counts
    seen(policy, dense, pruned)
    assert policy.cost_term(pruned) < policy.cost_term(dense)
    assert policy.order([dense, pruned]) == [pruned, dense]


def test_prefill_chunks_cost_what_the_token_budget_lets_through():
    policy = EntropyPolicy(chunk_tokens=256)
    assert policy.cost_term(make_seq(prompt_len=4000)) == policy.cost_term(make_seq(256))


def test_less_remaining_memory_time_goes_first():
    policy = only("gamma")
    nearly_done = decoding(make_seq(prompt_len=100, max_tokens=100), 95)
    fresh_short, fresh_long = make_seq(max_tokens=50), make_seq(max_tokens=500)
    small_context = decoding(make_seq(prompt_len=10, max_tokens=100), 50)
    big_context = decoding(make_seq(prompt_len=900, max_tokens=100), 50)
    seen(policy, fresh_long, big_context, small_context, fresh_short, nearly_done)
    order = policy.order([fresh_long, big_context, small_context, fresh_short, nearly_done])
    assert order == [nearly_done, fresh_short, small_context, big_context, fresh_long]


def test_longer_wait_lower_priority_value_and_tighter_slo_go_first():
    clock = SimClock()
    policy = only("delta", clock, aging_backlog=0.0)  # aging on a fixed horizon of 150 steps
    clock.now = 10.0  # ages count steps; SLOs count seconds
    old, new = make_seq(arrival_step=10), make_seq(arrival_step=90)
    urgent, relaxed = make_seq(arrival=5.0, slo=10.0), make_seq(arrival=5.0)
    important, ordinary = make_seq(arrival_step=90, priority=-1), make_seq(arrival_step=10)
    seen(policy, old, new, urgent, relaxed, important, ordinary, step=100)
    assert policy.order([new, old]) == [old, new]
    assert policy.order([relaxed, urgent]) == [urgent, relaxed]
    assert policy.order([ordinary, important]) == [important, ordinary]


def test_aging_is_convex_in_the_steps_waited():
    policy = only("delta", aging_steps=10, aging_steps_min=10, aging_power=3)
    seq = make_seq(arrival_step=0)
    ages = [policy.urgency_term(seq, 0.0) for policy.step in (0, 10, 20, 30)]
    assert ages == pytest.approx([0, 1, 8, 27])


def running_and_waiting(left: list[int], num_running: int) -> tuple[list, list]:
    """Sequences with ``left`` output tokens still to go; the first ``num_running`` run."""
    seqs = [make_seq(max_tokens=n) for n in left]
    return seqs[:num_running], seqs[num_running:]


def test_aging_horizon_follows_the_backlog_within_its_bounds():
    config = SchedulingConfig(aging_backlog=0.5, aging_steps_min=20, aging_steps=150)
    policy = EntropyPolicy(config)
    # 2 running, 600 decode steps left in all: 300 per running sequence, half of it.
    assert policy.aging_horizon(*running_and_waiting([100, 100, 200, 200], 2)) == 150
    # 200 per running sequence, but 1 waiting for 2 running: FCFS frees a slot sooner.
    assert policy.aging_horizon(*running_and_waiting([100, 60, 40], 2)) == 25
    assert policy.aging_horizon(*running_and_waiting([100, 60, 20, 10, 10], 2)) == 50  # 3 wait
    assert policy.aging_horizon(*running_and_waiting([10, 10], 2)) == 20  # never below the floor
    assert policy.aging_horizon(*running_and_waiting([900] * 8, 2)) == 150  # nor above aging_steps
    fixed = EntropyPolicy(SchedulingConfig(aging_backlog=0.0, aging_steps=80))
    assert fixed.aging_horizon(*running_and_waiting([900] * 8, 2)) == 80


def test_a_shorter_horizon_ages_the_same_wait_faster():
    policy = only("delta", aging_backlog=1.0, aging_steps_min=10, aging_steps=1000)
    old = make_seq(arrival_step=0)
    policy.begin_step(ControlRecord.build(40, *running_and_waiting([200] * 4, 2)))  # horizon 400
    deep = policy.urgency_term(old, 0.0)
    policy.begin_step(ControlRecord.build(40, *running_and_waiting([10] * 4, 2)))  # horizon 20
    assert policy.step == 40 and policy.horizon == 20
    assert policy.urgency_term(old, 0.0) == pytest.approx((40 / 20) ** 3)
    assert deep == pytest.approx((40 / 400) ** 3)


def test_slo_urgency_is_capped():
    clock = SimClock()
    policy = only("delta", clock, aging_steps=1e6, slo_cap=2.0)
    seq = make_seq(slo=1.0)
    clock.now = 100.0
    assert policy.urgency_term(seq, clock.now) == pytest.approx(2.0, abs=1e-3)


def test_every_term_but_aging_is_bounded():
    policy = EntropyPolicy(SchedulingConfig())
    huge = decoding(make_seq(prompt_len=8000, max_tokens=10**6), 1)
    huge.profile.update(50.0)
    huge.profile.update(0.0)
    seen(policy, huge)
    for term in (policy.entropy_term, policy.cost_term, policy.memory_term):
        assert 0.0 <= term(huge) <= 1.0


def test_a_preempted_request_keeps_its_place():
    clock = SimClock()
    policy = EntropyPolicy(clock=clock)
    seq = decoding(make_seq(prompt_len=300, max_tokens=200), 40)
    clock.now = 3.0
    seen(policy, seq)
    before = policy.priority(seq, clock.now)
    seq.num_computed_tokens = 0  # preempted: its KV is gone, its recompute still to come
    assert policy.priority(seq, clock.now) == pytest.approx(before)


# -- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("delta", 0.0, "delta must be in (0, inf], got 0"),
        ("gamma", -1.0, "gamma must be in [0, inf], got -1"),
        ("aging_power", 0.5, "aging_power must be in [1, inf], got 0.5"),
        ("entropy_prior", 3.0, "entropy_prior must be in [0, 2], got 3"),
        ("max_preemptions", 1.5, "max_preemptions must be an integer, got 1.5"),
        ("aging_steps", float("nan"), "aging_steps must be a finite number, got nan"),
    ],
)
def test_scheduling_config_names_the_bad_field(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        SchedulingConfig(**{field: value})


def test_control_config_switches_the_policy():
    assert EngineConfig().policy_name == "fcfs"
    assert EngineConfig(control=ControlConfig(scheduling=True)).policy_name == "entropy"
    assert EngineConfig(control=ControlConfig.full()).policy_name == "entropy"
    assert EngineConfig(control=ControlConfig.baseline()).policy_name == "fcfs"
    assert EngineConfig(scheduling_policy="entropy").policy_name == "entropy"
    custom = SchedulingConfig(gamma=2.0)
    assert ControlConfig(scheduling=custom).scheduling_config is custom
    with pytest.raises(ValueError, match="scheduling must be a bool or a SchedulingConfig"):
        ControlConfig(scheduling="yes")
