"""One configuration's pass over the ablation workload: the driver, its clock, and a meter of
the work each step does.

**The clock.** Requests arrive at their arrival times on the run's clock, and latencies are read
on it. ``wall`` is real time, as in ``bench serving``. ``cpu`` (the default) advances by the CPU
time this process spends in each engine step and skips idle gaps: with one torch thread it is
the time the run would take on this machine with nothing else running. On a shared machine
another engineer's job can double wall-clock step times from one configuration's run to the
next; on the ``cpu`` clock that noise mostly goes (what remains comes through shared caches and
memory bandwidth), and wall-clock figures are reported alongside.
"""

from __future__ import annotations

import bisect
import os
import time
from collections import deque
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from etinfer.bench.ablation_workload import AblationRequest
from etinfer.bench.pruning import attention_work
from etinfer.bench.serving import RequestRecord, warm_up
from etinfer.config import ControlConfig
from etinfer.engine.llm_engine import LLMEngine
from etinfer.engine.model_runner import AttentionStats
from etinfer.engine.observer import StepRecord
from etinfer.llm import LLM
from etinfer.model.config import ModelConfig
from etinfer.model.loader import LoadedModel
from etinfer.outputs import RequestOutput

CLOCKS = ("cpu", "wall")


def matmul_params(config: ModelConfig) -> int:
    """Weights one token multiplies by in the decoder layers (the LM head is counted apart)."""
    h, inter, d = config.hidden_size, config.intermediate_size, config.head_dim
    attention = h * d * (2 * config.num_heads + 2 * config.num_kv_heads)  # q, o; k, v
    return config.num_layers * (attention + 3 * h * inter)


class StepMeter:
    """Counts what each step computes, as an observer of the engine's steps.

    Model FLOPs: two per weight for every token computed, the LM head for every sampled row, and
    attention: causal over each prefill chunk, and over the (block, KV head) pairs each decode
    row read (all of its context when dense; the pairs kept, from the pruning telemetry,
    otherwise). Also the share of the KV pool that holds sequences, sampled every step.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.config = engine.model_config
        self.block_size = engine.block_size
        self.matmul_flops = 2 * matmul_params(self.config)
        self.steps = 0
        self.tokens = 0
        self.model_flops = 0.0
        self.decode_rows = 0
        self.pairs_read = 0.0  # (block, KV head) pairs decode attention read, all layers
        self.pairs_in_context = 0.0
        self.pool_used: list[float] = []
        engine.add_observer(self)

    def __call__(self, step: StepRecord) -> None:
        self.pool_used.append(1 - step.free_blocks / self.engine.num_blocks)
        self.steps += 1
        tokens = sum(step.num_tokens)
        self.tokens += tokens
        c = self.config
        self.model_flops += self.matmul_flops * tokens
        self.model_flops += 2 * c.hidden_size * c.vocab_size * len(step.sampled)  # LM head
        decode = step.num_decode
        for i in range(decode):
            self._decode_row(i, step.starts[i] + 1, step.attention)
        for start, n in zip(step.starts[decode:], step.num_tokens[decode:], strict=True):
            keys = n * start + n * (n + 1) // 2  # each query attends to itself and all before
            self.model_flops += keys * c.num_heads * c.head_dim * 4 * c.num_layers

    def _decode_row(self, i: int, context_len: int, stats: AttentionStats | None) -> None:
        """Decode row ``i``: the pairs in its context and those it read, from the pruning
        telemetry when there is some (it counts the same pairs: the tests check)."""
        if stats is None:
            blocks = -(-context_len // self.block_size)
            read = in_context = self.config.num_layers * self.config.num_kv_heads * blocks
        else:
            read = sum(layer[i] for layer in stats.kept)
            in_context = sum(layer[i] for layer in stats.total)
        self.decode_rows += 1
        self.pairs_in_context += in_context
        self.pairs_read += read
        self.model_flops += attention_work(read, self.config, self.block_size)[0]

    def totals(self) -> dict[str, float]:
        """The run's work: decode attention per decode row (FLOPs and KV bytes, as
        ``bench pruning`` counts them), model FLOPs, and KV pool use."""
        rows = max(1, self.decode_rows)
        flops, kv_bytes = attention_work(self.pairs_read / rows, self.config, self.block_size)
        return {
            "steps": self.steps,
            "computed_tokens": self.tokens,
            "model_flops": self.model_flops,
            "attn_flops_per_token": flops,
            "kv_bytes_per_token": kv_bytes,
            "decode_pairs_in_context": self.pairs_in_context,
            "kv_read_share": self.pairs_read / max(1.0, self.pairs_in_context),
            "kv_pool_mean": sum(self.pool_used) / max(1, len(self.pool_used)),
            "kv_pool_peak": max(self.pool_used, default=0.0),
        }


@dataclass
class Timeline:
    """Each step's end on the wall clock, and its start and end on the run's clock: an instant
    the engine stamped during a step (``time.perf_counter()``) reads as that step's start or end
    on the run's clock."""

    wall_ends: list[float] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)

    def add(self, wall_end: float, start: float, end: float) -> None:
        self.wall_ends.append(wall_end)
        self.starts.append(start)
        self.ends.append(end)

    def step_of(self, instant: float) -> int:
        return bisect.bisect_left(self.wall_ends, instant)

    def record(self, out: RequestOutput, arrival: float) -> RequestRecord:
        """The request's TTFT, end-to-end and queue time on the run's clock."""
        m = out.metrics
        return RequestRecord(
            len(out.token_ids),
            self.ends[self.step_of(m.first_token_time)] - arrival,
            self.ends[self.step_of(m.finished_time)] - arrival,
            self.starts[self.step_of(m.first_scheduled_time)] - arrival,
        )


@dataclass
class Run:
    """One configuration's pass over the workload."""

    config: str
    repeat: int
    outputs: list[RequestOutput]  # in request order
    records: list[RequestRecord]  # latencies on the run's clock, in request order
    makespan: float  # first arrival to last completion on the run's clock, seconds
    wall: float  # the same on the wall clock
    cpu: float  # CPU seconds this process spent inside engine.step()
    work: dict[str, float]
    preemptions: int
    recomputed_tokens: int
    load: tuple[float, float]  # 1-minute load average before and after


def drive(
    engine: LLMEngine, requests: list[AblationRequest], clock: str, bar: tqdm
) -> tuple[list[RequestOutput], Timeline, float, float]:
    """Run the requests, each added once the run's clock passes its arrival time. Returns the
    outputs in request order, the timeline, the makespan on the run's clock and the CPU time
    spent stepping."""
    outputs: dict[int, RequestOutput] = {}
    timeline = Timeline()
    arrivals = deque(enumerate(requests))
    now = cpu = 0.0
    wall_start = time.perf_counter()
    while arrivals or engine.has_unfinished_requests():
        while arrivals and arrivals[0][1].arrival_s <= now:
            i, r = arrivals.popleft()
            engine.add_request(
                r.prompt,
                r.params,
                request_id=str(i),
                prompt_token_ids=r.prompt,
                forced_token_ids=r.forced or None,
            )
        if engine.has_unfinished_requests():
            began, began_cpu = time.perf_counter(), time.process_time()
            finished = engine.step()
            step_cpu = time.process_time() - began_cpu
            ended = time.perf_counter()
            start = now if clock == "cpu" else began - wall_start
            now = now + step_cpu if clock == "cpu" else ended - wall_start
            timeline.add(ended, start, now)
            cpu += step_cpu
            outputs.update((int(out.request_id), out) for out in finished)
            bar.update(len(finished))
        elif clock == "wall":
            time.sleep(max(0.0, wall_start + arrivals[0][1].arrival_s - time.perf_counter()))
            now = time.perf_counter() - wall_start
        else:
            now = arrivals[0][1].arrival_s  # idle: nothing to spend CPU on until it arrives
    return [outputs[i] for i in range(len(requests))], timeline, now, cpu


def run_once(
    loaded: LoadedModel,
    name: str,
    repeat: int,
    control: ControlConfig,
    requests: list[AblationRequest],
    engine_kwargs: dict,
    clock: str,
    bar: tqdm,
) -> Run:
    """One configuration's pass, on a fresh engine warmed up first."""
    before = os.getloadavg()[0]
    engine = LLM(loaded, control=control, **engine_kwargs).engine
    warm_up(engine)
    meter = StepMeter(engine)
    wall_start = time.perf_counter()
    outputs, timeline, makespan, cpu = drive(engine, requests, clock, bar)
    wall = time.perf_counter() - wall_start
    records = [timeline.record(o, r.arrival_s) for o, r in zip(outputs, requests, strict=True)]
    scheduler = engine.scheduler
    return Run(
        name,
        repeat,
        outputs,
        records,
        makespan,
        wall,
        cpu,
        meter.totals(),
        scheduler.num_preemptions,
        scheduler.num_recomputed_tokens,
        (before, os.getloadavg()[0]),
    )
