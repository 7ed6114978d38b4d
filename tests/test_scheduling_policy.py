"""The entropy scheduling policy on scripted sequences and a fake clock: no model runs here."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from etinfer.bench import workload
from etinfer.bench.scheduling_sim import StepCost, simulate
from etinfer.bench.serving import summarize
from etinfer.config import ControlConfig, EngineConfig
from etinfer.control.record import ControlRecord
from etinfer.control.scheduling import EntropyPolicy, FCFSPolicy, SchedulingConfig
from etinfer.engine.kv_cache_manager import KVCacheManager
from etinfer.engine.scheduler import ScheduledBatch, Scheduler
from etinfer.engine.sequence import Sequence, SequenceStatus
from etinfer.sampling_params import SamplingParams

BLOCK = 4
_ids = itertools.count()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


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


def only(term: str, clock: Clock | None = None, **overrides) -> EntropyPolicy:
    """A policy whose priority is one term (urgency cannot be off: it keeps a tiny weight)."""
    weights = {"alpha": 0.0, "beta": 0.0, "gamma": 0.0, "delta": 1e-9} | {term: 1.0}
    return EntropyPolicy(SchedulingConfig(**weights, **overrides), clock=clock or Clock())


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
    pruned.blocks_kept = [0.9, 0.25]  # the latest step counts
    assert policy.cost_term(pruned) < policy.cost_term(dense)
    seen(policy, dense, pruned)
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
    clock = Clock()
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
    clock = Clock()
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
    clock = Clock()
    policy = EntropyPolicy(clock=clock)
    seq = decoding(make_seq(prompt_len=300, max_tokens=200), 40)
    clock.now = 3.0
    seen(policy, seq)
    before = policy.priority(seq, clock.now)
    seq.num_computed_tokens = 0  # preempted: its KV is gone, its recompute still to come
    assert policy.priority(seq, clock.now) == pytest.approx(before)


# -- preemption victims ------------------------------------------------------------------------


def running(computed: int, *, steps: int = 100, preemptions: int = 0, priority: int = 0):
    seq = decoding(make_seq(prompt_len=computed, max_tokens=64, priority=priority), 1)
    seq.steps_since_admitted, seq.num_preemptions = steps, preemptions
    return seq


def test_victim_is_the_least_computed_work():
    big, small, medium = running(400), running(20), running(100)
    assert EntropyPolicy().victim([big, small, medium]) is small


def test_hysteresis_protects_a_sequence_just_admitted():
    policy = EntropyPolicy(SchedulingConfig(min_run_steps=8))
    just_back, settled = running(20, steps=3), running(400, steps=50)
    assert policy.victim([just_back, settled]) is settled
    just_back.steps_since_admitted = 8
    assert policy.victim([just_back, settled]) is just_back


def test_a_request_preempted_max_times_is_preempted_last():
    policy = EntropyPolicy(SchedulingConfig(max_preemptions=2))
    capped, other = running(20, preemptions=2), running(400, preemptions=1)
    assert policy.victim([capped, other]) is other
    # When every candidate is protected, the least computed work still goes.
    assert policy.victim([capped, running(400, preemptions=2)]) is capped


def test_the_least_important_priority_class_is_preempted_first():
    vip, ordinary = running(20, priority=-1), running(400, priority=0)
    assert EntropyPolicy().victim([vip, ordinary]) is ordinary


def make_scheduler(policy, num_blocks=64, max_num_seqs=8, budget=64):
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=False)
    return Scheduler(kv, policy, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)


def schedule(scheduler: Scheduler) -> ScheduledBatch:
    return scheduler.schedule(scheduler.control_record())


def run_step(scheduler: Scheduler, batch) -> None:
    """What the engine does after the model ran: computed tokens advance, a finished prompt
    gets a token, a sequence at max_tokens finishes."""
    for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
            if seq.num_output_tokens >= seq.params.max_tokens:
                scheduler.finish(seq)


def test_scheduler_preempts_the_least_computed_work_and_counts_the_recompute():
    # 5 blocks of 4 tokens. An old request with a short prompt and a long way to go, and a newer
    # one with a long prompt about to finish, fill the pool. The newer one runs first (less
    # remaining memory-time) and needs a sixth block: FCFS would evict it (the newest); the
    # entropy policy evicts the old one, which has less computed work to lose.
    policy = EntropyPolicy(SchedulingConfig(min_run_steps=0, admission_lookahead=0))
    scheduler = make_scheduler(policy, num_blocks=5)
    old = make_seq(prompt_len=4, max_tokens=50, arrival=0.0)
    new = make_seq(prompt_len=16, max_tokens=2, arrival=1.0)
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler, schedule(scheduler))  # old holds 1 block, new 4: the pool is full
    assert FCFSPolicy().victim([old, new]) is new
    batch = schedule(scheduler)
    assert batch.preempted == [old] and batch.seqs == [new]
    assert old.status is SequenceStatus.WAITING and old.num_preemptions == 1
    run_step(scheduler, batch)  # new finishes and frees its blocks
    batch = schedule(scheduler)
    assert batch.seqs == [old] and batch.num_tokens == [5]  # its prompt again, and its token
    assert scheduler.num_recomputed_tokens == 4


def test_admission_keeps_blocks_for_the_running_sequences_to_grow_into():
    # 8 blocks of 4 tokens. A running sequence of 8 tokens with 40 to go fills 4 more blocks in
    # its next 16 tokens; a waiting one needs 3 blocks now. FCFS admits it (3 of 6 free
    # blocks); the entropy policy looking 16 tokens ahead keeps the 4 and waits.
    entropy = EntropyPolicy(SchedulingConfig(admission_lookahead=16))
    for policy, admitted in ((FCFSPolicy(), True), (entropy, False)):
        scheduler = make_scheduler(policy, num_blocks=8)
        running = make_seq(prompt_len=7, max_tokens=40)
        scheduler.add(running)
        run_step(scheduler, schedule(scheduler))  # 8 tokens in 2 blocks
        assert policy.growth_reserve([running], BLOCK) == (4 if admitted is False else 0)
        waiting = make_seq(prompt_len=10)
        scheduler.add(waiting)
        batch = schedule(scheduler)
        assert (waiting in batch.seqs) is admitted
        assert not batch.preempted


def test_steps_since_admitted_counts_scheduled_steps_and_resets_on_admission():
    scheduler = make_scheduler(FCFSPolicy())
    seq = make_seq(prompt_len=4, max_tokens=10)
    scheduler.add(seq)
    for _ in range(3):
        run_step(scheduler, schedule(scheduler))
    assert seq.steps_since_admitted == 3
    scheduler._preempt(seq, ScheduledBatch())
    schedule(scheduler)
    assert seq.steps_since_admitted == 1


# -- no starvation -----------------------------------------------------------------------------


def adversarial_run(config: SchedulingConfig, steps: int) -> tuple[Sequence, int | None]:
    """One slot. Before the first step a long, low-priority request arrives; then before every
    step a short, high-priority one, more than the slot can serve, forever. Returns the long
    request and the step that admitted it (None if none did)."""
    scheduler = make_scheduler(EntropyPolicy(config), max_num_seqs=1)
    victim = make_seq(prompt_len=200, max_tokens=500, priority=1)
    scheduler.add(victim)
    for _ in range(steps):
        scheduler.add(make_seq(prompt_len=4, max_tokens=3, priority=-1))
        batch = schedule(scheduler)
        if victim in batch.seqs:
            return victim, scheduler.num_steps
        run_step(scheduler, batch)
    return victim, None


def test_aging_admits_a_low_priority_request_under_an_endless_high_priority_stream():
    config = SchedulingConfig()
    bound = config.starvation_bound_steps(priority_gap=2)
    victim, admitted = adversarial_run(config, steps=int(4 * bound))
    assert admitted is not None
    # It outranks every arrival more than `bound` steps younger, so only the arrivals within
    # `bound` of it (one per step, each holding the slot for 3 steps) can go ahead of it.
    assert admitted <= 4 * bound
    assert admitted > 3  # but high priority did go first for a while
    assert victim.num_preemptions == 0


def test_without_aging_the_same_stream_starves_it():
    # The same policy with aging stretched out of reach (what strict priority does, as vLLM's
    # `priority` policy): the test above would fail.
    config = dataclasses.replace(SchedulingConfig(), aging_steps=1e9, aging_backlog=0.0)
    bound = SchedulingConfig().starvation_bound_steps(priority_gap=2)
    _, admitted = adversarial_run(config, steps=int(2 * bound))
    assert admitted is None


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


# -- at scale, on a simulated engine -----------------------------------------------------------


TARGETS = ("e2e_mean", "e2e_p99", "max_queue_time", "request_throughput")


def simulated(
    kv_blocks: int, rate: float, config: SchedulingConfig | None = None, seeds=(1, 2, 3)
) -> list[tuple[dict, dict]]:
    """FCFS and entropy figures on seeded ShareGPT-like workloads of 80 requests, on the
    simulated engine at the speed the shared machine ran the real benchmark."""
    pairs = []
    for seed in seeds:
        requests = workload.generate("sharegpt", 80, rate, seed, length_scale=0.35)
        figures = []
        for policy in ("fcfs", "entropy"):
            records, duration, scheduler = simulate(
                requests,
                policy,
                config=config if policy == "entropy" else None,
                num_blocks=kv_blocks,
                cost=StepCost(speed=0.2),
            )
            figures.append(
                summarize(records, duration, preemptions=scheduler.num_preemptions)
                | {"recomputed": scheduler.num_recomputed_tokens}
            )
        pairs.append((figures[0], figures[1]))
    return pairs


def test_past_saturation_shortest_remaining_first_cuts_mean_latency():
    pairs = simulated(kv_blocks=100_000, rate=0.76)  # about twice what the engine sustains
    for fcfs, entropy in pairs:
        assert entropy["completed"] == fcfs["completed"] == 80
        assert entropy["e2e_mean"] < 0.95 * fcfs["e2e_mean"]
        assert entropy["ttft_mean"] < 0.75 * fcfs["ttft_mean"]


def test_past_saturation_the_defaults_meet_the_targets_of_issue_5_on_eight_simulated_workloads():
    # As the mean of the ratios to FCFS over the seeds (single seeds miss: on some, even no
    # aging at all leaves the mean above 0.88x). The horizon that follows the backlog keeps the
    # longest waits and the p99 near FCFS's while short requests overtake. (Under KV pressure
    # the real engine is the judge: the simulator prices a preemption's recompute too low to
    # weigh the admission reserve; see SchedulingConfig.admission_lookahead.)
    pairs = simulated(100_000, 0.76, seeds=range(1, 9))
    ratio = {k: np.mean([e[k] / f[k] for f, e in pairs]) for k in TARGETS}
    assert ratio["e2e_mean"] <= 0.88
    assert ratio["e2e_p99"] <= 1.1 and ratio["max_queue_time"] <= 1.1
    assert ratio["request_throughput"] >= 1.0


@pytest.mark.parametrize("rate", [0.38, 0.5])
def test_near_capacity_the_longest_queue_stays_near_fcfs(rate):
    # At about the rate the engine sustains, short bursts form and drain: there is little to
    # reorder, and a long request that arrives in a burst must not wait far longer than FCFS
    # makes it (the horizon shrinks with the queue). Simulated (8 seeds): 0.97x and 0.98x.
    pairs = simulated(100_000, rate, seeds=range(1, 9))
    ratio = {k: np.mean([e[k] / f[k] for f, e in pairs]) for k in TARGETS}
    assert ratio["e2e_mean"] <= 1.0
    assert ratio["e2e_p99"] <= 1.1 and ratio["max_queue_time"] <= 1.1


def test_under_kv_pressure_the_admission_reserve_cuts_preemptions_and_recompute():
    for fcfs, entropy in simulated(kv_blocks=80, rate=0.38):
        assert entropy["completed"] == 80
        assert entropy["preemptions"] < 0.6 * fcfs["preemptions"]
        assert entropy["recomputed"] < fcfs["recomputed"]
