"""One configuration's pass over the ablation workload: a fresh engine, the driver
(``bench/common/driver.py``, which keeps the run's clock: CPU time in engine steps by default, or
wall time), and a meter of the work each step does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from etinfer.bench.common.driver import EngineRun, drive_engine, warm_up
from etinfer.control.config import ControlConfig
from etinfer.engine.llm_engine import LLMEngine
from etinfer.engine.observer import StepRecord
from etinfer.engine.runner.attention_stats import AttentionStats
from etinfer.llm import LLM
from etinfer.model.loader import LoadedModel
from studies.common.mixed_workload import AblationRequest
from studies.common.work import attention_work, matmul_params


class StepMeter:
    """Counts what each step computes, as an observer of the engine's steps.

    Model FLOPs: two per weight for every token computed, the LM head for every sampled row, and
    attention: causal over each prefill chunk, and over the (block, KV head) pairs each decode
    row read (all of its context when dense; the pairs kept, from the pruning telemetry,
    otherwise). Also the share of the KV pool that holds sequences, sampled every step, and
    the batches' make-up: the share of stepping CPU time in steps that carried a prompt chunk,
    and how many running sequences a step left out (a decoding one left out waits a step).
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
        self.step_cpu = 0.0
        self.prompt_step_cpu = 0.0  # in steps with a prompt (or recompute) chunk
        self.left_out = 0  # running sequences a step did not schedule, summed over steps
        engine.add_observer(self)

    def __call__(self, step: StepRecord) -> None:
        self.pool_used.append(1 - step.free_blocks / self.engine.num_blocks)
        self.steps += 1
        self.step_cpu += step.cpu_time
        if len(step.num_tokens) > step.num_decode:
            self.prompt_step_cpu += step.cpu_time
        scheduled = set(step.request_ids)
        self.left_out += sum(seq.request_id not in scheduled for seq in step.control.running)
        tokens = sum(step.num_tokens)
        self.tokens += tokens
        c = self.config
        self.model_flops += self.matmul_flops * tokens
        # The LM head: a row per sampled sequence and per drafted token it verified.
        head_rows = len(set(step.sampled)) + step.num_draft_tokens
        self.model_flops += 2 * c.hidden_size * c.vocab_size * head_rows
        decode = step.num_decode
        rows = [step.starts[i] + 1 + j for i in range(decode) for j in range(step.num_tokens[i])]
        for row, context_len in enumerate(rows):  # a decoding sequence's token, then its drafts
            self._decode_row(row, context_len, step.attention)
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
            "prompt_step_cpu_share": self.prompt_step_cpu / max(1e-9, self.step_cpu),
            "decode_rows_per_step": self.decode_rows / max(1, self.steps),
            "left_out_per_step": self.left_out / max(1, self.steps),
        }


@dataclass(kw_only=True)
class Run(EngineRun):
    """One configuration's pass over the workload: what the driver measured (every request
    served), the work, and the load on the machine."""

    config: str
    repeat: int
    work: dict[str, float]
    preemptions: int
    recomputed_tokens: int
    load: tuple[float, float]  # 1-minute load average before and after
    meters: list = field(default_factory=list)  # the extra observers the caller asked for


def run_once(
    loaded: LoadedModel,
    name: str,
    repeat: int,
    control: ControlConfig,
    requests: list[AblationRequest],
    engine_kwargs: dict,
    clock: str,
    bar: tqdm,
    meters: Sequence[Callable[[LLMEngine], object]] = (),
    concurrency: int | None = None,
) -> Run:
    """One configuration's pass, on a fresh engine warmed up first; ``meters`` build extra
    observers of its steps (each adds itself to the engine); ``concurrency``: a closed loop of
    that many clients instead of the workload's arrival times."""
    before = os.getloadavg()[0]
    engine = LLM(loaded, control=control, **engine_kwargs).engine
    warm_up(engine)
    meter = StepMeter(engine)
    extra = [make(engine) for make in meters]
    driven = drive_engine(engine, requests, clock, bar, concurrency)
    refused = next((r.error for r in driven.records if r.error), None)
    if refused:
        raise ValueError(refused)
    scheduler = engine.scheduler
    return Run(
        **vars(driven),
        config=name,
        repeat=repeat,
        work=meter.totals(),
        preemptions=scheduler.num_preemptions,
        recomputed_tokens=scheduler.num_recomputed_tokens,
        load=(before, os.getloadavg()[0]),
        meters=extra,
    )
