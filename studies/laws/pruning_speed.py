"""Decode step time and attention work, dense against entropic pruning: the speed part of
``bench pruning``.

Work is counted from the engine's telemetry (the (block, KV head) pairs each layer read); step
times come from the engine's step observer.
"""

from __future__ import annotations

import statistics

from etinfer.bench.common.decode_steps import context_prompts, decode_budget
from etinfer.control.block_selection import PruningConfig
from etinfer.engine.observer import StepRecord
from etinfer.engine.runner.attention_stats import AttentionStats
from etinfer.llm import LLM
from etinfer.model.config import ModelConfig
from etinfer.sampling_params import SamplingParams
from studies.common.work import attention_work


def step_work(stats: list[AttentionStats], config: ModelConfig, block_size: int) -> dict:
    """Per generated token, averaged over the measured steps and their sequences."""
    kept = statistics.fmean(sum(map(sum, s.kept)) / len(s.seqs) for s in stats)
    total = statistics.fmean(sum(map(sum, s.total)) / len(s.seqs) for s in stats)
    flops, kv_bytes = attention_work(kept, config, block_size)
    dense_flops, dense_bytes = attention_work(total, config, block_size)
    # Scoring reads each block's key bounds (min and max) in the pruned layers.
    bounds = total * config.head_dim * 4 * 2 / block_size
    return {
        "blocks_kept": kept / total,
        "dense_flops": dense_flops,
        "flops": flops,
        "dense_kv_bytes": dense_bytes,
        "kv_bytes": kv_bytes,
        "bound_bytes": bounds,
        "max_dropped_mass": max(max(map(max, s.dropped_mass)) for s in stats),
    }


WARMUP = 10  # untimed pruned steps before timing a configuration


def paired_step_ms(
    llm: LLM, batch: int, context: int, steps: int, configs: dict[str, PruningConfig], clock: str
) -> dict[str, dict]:
    """Decode step time, dense against each pruning configuration, on one prefilled batch.

    Steps alternate between dense and pruned, so both see the same contexts and the same
    moment of a noisy machine. Each configuration first runs ``WARMUP`` pruned steps untimed:
    its budgets start from dense and shrink at the rate limit. ``clock``: ``cpu`` times a step
    by this process's CPU time, ``wall`` by wall-clock time.
    """
    engine = llm.engine
    engine.set_pruning(None)
    rounds = len(configs) * (WARMUP + 2 * steps)
    budget = decode_budget(batch, context, rounds, engine.config.max_num_batched_tokens)
    params = SamplingParams(temperature=0, max_tokens=budget, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in context_prompts(llm, batch, context)]
    for _ in range(budget):  # every step computes at least one prompt token of the batch
        running = engine.scheduler.running
        if len(running) == batch and all(s.num_output_tokens for s in running):
            break
        engine.step()
    else:
        raise RuntimeError(f"the KV pool cannot hold {batch} sequences of {context} tokens")

    records: list[StepRecord] = []

    def timed() -> StepRecord:
        with engine.observing(records.append):
            engine.step()
        return records.pop()

    def ms(record: StepRecord) -> float:
        return 1000 * (record.cpu_time if clock == "cpu" else record.wall_time)

    results = {}
    for name, config in configs.items():
        engine.set_pruning(config)
        for _ in range(WARMUP):
            engine.step()
        dense_ms, pruned_ms, stats = [], [], []
        for _ in range(steps):
            engine.set_pruning(None)
            dense_ms.append(ms(timed()))
            engine.set_pruning(config)
            pruned = timed()
            pruned_ms.append(ms(pruned))
            stats.append(pruned.attention)
        results[name] = {
            "dense_ms": statistics.median(dense_ms),
            "ms": statistics.median(pruned_ms),
            "stats": stats,
        }
    for request_id in ids:
        engine.abort_request(request_id)
    engine.set_pruning(None)
    return results


def speed_rows(
    llm: LLM, configs: dict[str, PruningConfig], batches, contexts, steps: int, clock: str
) -> list[dict]:
    rows = []
    model, block_size = llm.engine.model_config, llm.engine.block_size
    for batch in batches:
        for context in contexts:
            row: dict = {"batch": batch, "context": context}
            for name, result in paired_step_ms(llm, batch, context, steps, configs, clock).items():
                row[name] = {
                    "ms": result["ms"],
                    "dense_ms": result["dense_ms"],
                    "ratio": result["ms"] / result["dense_ms"],
                    **step_work(result["stats"], model, block_size),
                }
            rows.append(row)
            parts = [
                f"{name} {row[name]['ms']:.1f} ms against dense {row[name]['dense_ms']:.1f} ms "
                f"({row[name]['ratio']:.2f}x, {100 * row[name]['blocks_kept']:.0f} % blocks)"
                for name in configs
            ]
            print(f"  batch {batch} context {context:5d}: " + "; ".join(parts), flush=True)
    return rows
