"""Scheduling policies on a simulated engine: the real scheduler, KV manager and policies, with a
step-time model in place of the model.

    python -m studies scheduling-sim --policy fcfs entropy --num-requests 80 --request-rate 0.76 \\
        --length-scale 0.35 --speed 0.2

A run takes a fraction of a second and has no noise, so it can compare many settings and seeds;
this is how the entropy policy's defaults were chosen. The figures in BENCHMARKS.md come from
the real benchmark (``etinfer bench serving-sweep``). Replaying its traces here with ``--speed``
0.18-0.2 (the shared machine ran at about a fifth of the speed this model was fitted to)
reproduced its FCFS mean latencies within about 12%, and the entropy/FCFS ratio within 0.02 in
one overloaded run, but 0.15 off in another; it also understates what a preemption costs the
real engine. Its figures guide; the real benchmark decides. Entropy is not simulated: every
sequence keeps the policy's prior, so the entropy term cannot act here. The run's result holds
each policy's latency and throughput figures, and their ratios to FCFS's.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import numpy as np

from etinfer import options
from etinfer.bench.common.driver import RequestRecord
from etinfer.bench.common.results import Figure, add_result_option, recorded
from etinfer.bench.common.serving_metrics import format_table, result_figures, summarize
from etinfer.bench.common.workload import WorkloadRequest, add_workload_args, load_workload
from etinfer.config import EngineConfig
from etinfer.control.scheduling import SCHEDULING_POLICIES, SchedulingConfig
from etinfer.engine.kv_cache.manager import KVCacheManager
from etinfer.engine.scheduler import ScheduledBatch, Scheduler
from etinfer.engine.sequence import Sequence
from etinfer.sampling_params import SamplingParams
from etinfer.validation import check_float
from studies import PROGRAM


@dataclass(frozen=True)
class StepCost:
    """Seconds per engine step, fitted to two cores of this CPU (BENCHMARKS.md, "Serving"): a decode
    step takes 34 ms at batch 1, 55 ms at 16 and 96 ms at 32; decode attention adds about 3 us
    per row and context token; a prefill chunk of 1,024 tokens takes about a third of a second.
    ``speed`` divides everything (0.5: a machine half as fast)."""

    base: float = 0.032
    per_row: float = 0.0014  # per decode row, up to 16 rows
    per_row_above: float = 0.0026  # per decode row beyond 16
    per_context_token: float = 3e-6
    per_prefill_token: float = 3e-4
    speed: float = 1.0

    def __post_init__(self) -> None:
        check_float("speed", self.speed, low=0, low_open=True)

    def __call__(self, batch: ScheduledBatch) -> float:
        rows = batch.num_decode
        seconds = self.base + self.per_row * min(rows, 16) + self.per_row_above * max(0, rows - 16)
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            if n == 1:
                seconds += self.per_context_token * seq.num_computed_tokens
            else:
                seconds += self.per_prefill_token * n
        return seconds / self.speed


class SimClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(
    requests: list[WorkloadRequest],
    policy: str,
    *,
    config: SchedulingConfig | None = None,
    max_num_seqs: int = 16,
    num_blocks: int = 100_000,
    block_size: int = 16,
    max_num_batched_tokens: int = 1024,
    cost: StepCost | None = None,
    seed: int = 0,
) -> tuple[list[RequestRecord], float, Scheduler]:
    """Run ``requests`` to completion; the records, the makespan and the scheduler (counters).

    The engine's own checks refuse what it would refuse: its settings' ranges, and a request
    the whole pool cannot hold, which would wait forever (a simulated step costs time even
    when it schedules nothing, so the run would never end)."""
    EngineConfig(
        max_num_seqs=max_num_seqs,
        num_kvcache_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    kv = KVCacheManager(num_blocks, block_size)
    for i, request in enumerate(requests):
        kv.check_holds(request.prompt_tokens, request.output_tokens, name=f"request {i}")
    cost = cost or StepCost()
    clock = SimClock()
    policy_ = SCHEDULING_POLICIES.create(
        policy, config=config, chunk_tokens=max_num_batched_tokens, clock=clock
    )
    scheduler = Scheduler(
        kv,
        policy_,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        clock=clock,
    )
    rng = np.random.default_rng(seed)
    records = [RequestRecord() for _ in requests]
    first_token: dict[Sequence, float] = {}
    index: dict[Sequence, int] = {}
    pending = 0
    while pending < len(requests) or scheduler.has_unfinished():
        while pending < len(requests) and requests[pending].arrival_s <= clock.now:
            seq = _sequence(pending, requests[pending], rng)
            index[seq] = pending
            scheduler.add(seq)
            pending += 1
        if not scheduler.has_unfinished():
            clock.now = requests[pending].arrival_s
            continue
        batch = scheduler.schedule(scheduler.control_record())
        clock.now += cost(batch)
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            seq.num_computed_tokens += n
            scheduler.kv.publish_full_blocks(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk that does not end the prompt
            seq.token_ids.append(0)
            first_token.setdefault(seq, clock.now)
            if seq.num_output_tokens >= seq.params.max_tokens:
                scheduler.finish(seq)
                records[index[seq]] = RequestRecord(
                    seq.num_output_tokens,
                    first_token[seq] - seq.arrival_time,
                    clock.now - seq.arrival_time,
                    seq.metrics.first_scheduled_time - seq.arrival_time,
                )
    return records, clock.now - requests[0].arrival_s, scheduler


def _sequence(i: int, request: WorkloadRequest, rng: np.random.Generator) -> Sequence:
    """Random prompt tokens: distinct prompts share no prefix, as in the real benchmark."""
    prompt = rng.integers(0, 2**31, request.prompt_tokens).tolist()
    params = SamplingParams(max_tokens=request.output_tokens, ignore_eos=True)
    return Sequence(
        str(i), i, prompt, params, None, prompt=None, arrival_time=request.arrival_s, stream=False
    )


def run(args: argparse.Namespace) -> tuple[list[Figure], dict]:
    requests = load_workload(args)
    overrides = json.loads(args.scheduling_config or "{}")
    columns = {}
    for policy in args.policy:
        config = SchedulingConfig(**overrides) if policy == "entropy" else None
        records, duration, scheduler = simulate(
            requests,
            policy,
            config=config,
            max_num_seqs=args.max_num_seqs,
            num_blocks=args.num_kvcache_blocks,
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            cost=StepCost(speed=args.speed),
        )
        columns[policy] = summarize(
            records,
            duration,
            preemptions=scheduler.num_preemptions,
            recomputed_tokens=scheduler.num_recomputed_tokens,
        )
    print(format_table(columns))
    arms = {policy: [summary] for policy, summary in columns.items()}
    reference = "fcfs" if "fcfs" in columns else None
    return result_figures(arms, reference), {"policies": columns}


def add_command(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("scheduling-sim", help="scheduling policies on a simulated engine")
    policies = ("fcfs", "entropy")
    parser.add_argument("--policy", nargs="+", choices=policies, default=list(policies))
    add_workload_args(parser)
    options.add_engine_options(
        parser,
        only=("max_num_seqs", "num_kvcache_blocks", "block_size", "max_num_batched_tokens"),
        defaults={"max_num_seqs": 16, "num_kvcache_blocks": 100_000},
    )
    parser.add_argument("--speed", type=float, default=1.0, help="of the machine, against ours")
    parser.add_argument("--scheduling-config", help="SchedulingConfig fields as JSON")
    add_result_option(parser)
    parser.set_defaults(func=recorded("scheduling-sim", run, PROGRAM))
