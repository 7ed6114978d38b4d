"""Preemption victims, the scheduler with the policy, starvation, and the policy at scale on a
simulated engine: no model runs here."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from etinfer.bench.common import workload
from etinfer.bench.common.serving_metrics import summarize
from etinfer.control.scheduling import EntropyPolicy, FCFSPolicy, SchedulingConfig
from etinfer.engine.kv_cache.manager import KVCacheManager
from etinfer.engine.scheduler import ScheduledBatch, Scheduler
from etinfer.engine.sequence import Sequence, SequenceStatus
from studies.laws.scheduling_sim import StepCost, simulate
from tests.engine.scheduling_helpers import BLOCK, decoding, make_seq, only

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


def test_a_prompt_the_policy_ranks_first_never_stalls_the_decoding_sequences():
    # Ranked by memory alone, a prompt with one token to go outranks a sequence with 63 left;
    # its chunks still leave each decoding sequence its row (stall-free batching).
    scheduler = make_scheduler(only("gamma"), budget=8)
    talker = make_seq(prompt_len=3, max_tokens=64)
    scheduler.add(talker)
    run_step(scheduler, schedule(scheduler))  # its prompt: it decodes from now on
    reader = make_seq(prompt_len=40, max_tokens=1)
    scheduler.add(reader)
    for _ in range(4):  # the reader's prompt in chunks, the talker's token in every step
        batch = schedule(scheduler)
        assert scheduler.policy.order([talker, reader]) == [reader, talker]
        assert batch.seqs == [talker, reader] and batch.num_tokens == [1, 7]
        run_step(scheduler, batch)


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


def test_past_saturation_the_defaults_meet_their_latency_targets_on_eight_simulated_workloads():
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


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        # A request the whole pool cannot hold waited forever: the run never ended.
        ({"num_blocks": 2}, r"request 0 needs \d+ KV blocks .* num_kvcache_blocks is 2"),
        ({"max_num_seqs": 0}, r"max_num_seqs must be in \[1, inf\]"),
        ({"block_size": 0}, r"block_size must be in \[1, 1024\]"),
    ],
)
def test_the_simulator_refuses_what_the_engine_would(settings, message):
    with pytest.raises(ValueError, match=message):
        simulate([workload.WorkloadRequest(0.0, 40, 8)], "fcfs", **settings)


def test_a_step_cost_needs_a_positive_speed():
    with pytest.raises(ValueError, match=r"speed must be in \(0, inf\], got 0"):
        StepCost(speed=0.0)  # it divides every step's time
