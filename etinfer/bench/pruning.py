"""Entropic block pruning against dense attention: decode speed, attention work, fidelity.

    etinfer bench pruning --output-dir results/pruning      (etinfer bench fidelity: fidelity only)

Side by side in one run and on one engine (prefill is dense, so every comparison decodes the
same prefilled cache both ways), dense attention and the entropic selector's configurations:

- decode step time against context length at batch 1 and 8;
- attention FLOPs and KV bytes read per generated token (from the engine's telemetry: the
  (block, KV head) pairs each layer read);
- teacher-forced fidelity and passkey retrieval (``bench/fidelity.py``);
- how many leading layers must stay dense;
- a plot of blocks kept against entropy over one long generation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from etinfer.bench.fidelity import (
    corpus_tokens,
    forced_log_probs,
    passkey_accuracy,
    passkey_cases,
    teacher_forced,
)
from etinfer.bench.oracle_selection import OracleSelector
from etinfer.bench.speed import context_prompts, decode_budget
from etinfer.config import ControlConfig
from etinfer.control.block_selection import PruningConfig
from etinfer.engine.model_runner import AttentionStats
from etinfer.engine.observer import StepRecord
from etinfer.llm import LLM
from etinfer.model.config import ModelConfig
from etinfer.sampling_params import SamplingParams

# Named pruning configurations; each part of the benchmark runs the ones it is given.
CONFIGS = {
    "bound": PruningConfig(),
    "mass": PruningConfig(scorer="mass"),
    # Fixed shares of the blocks at every entropy: the speed/fidelity frontier.
    "bound-fifth": PruningConfig(budget_low=0.2, budget_high=0.2),
    "bound-half": PruningConfig(budget_low=0.5, budget_high=0.5),
}


def attention_work(pairs: float, config: ModelConfig, block_size: int) -> tuple[float, float]:
    """FLOPs and KV bytes of decode attention over ``pairs`` (block, KV head) pairs in a token's
    step, summed over layers: scores and weighted sum are two multiply-adds per element."""
    tokens = pairs * block_size
    flops = tokens * config.queries_per_kv * config.head_dim * 4
    kv_bytes = tokens * config.head_dim * 4 * 2
    return flops, kv_bytes


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


def fidelity_rows(
    llm: LLM,
    configs: dict[str, PruningConfig],
    corpus: list[int],
    batches,
    context: int,
    steps: int,
    oracle: bool = False,
) -> list[dict]:
    """Teacher-forced fidelity of each configuration; with ``oracle``, also of the same budgets
    with blocks ranked by their exact attention mass (the ceiling of any block scorer)."""
    rows = []
    for batch in batches:
        stride = (len(corpus) - context - steps) // batch
        texts = [corpus[i * stride : i * stride + context + steps] for i in range(batch)]
        llm.engine.set_pruning(None)
        dense = forced_log_probs(llm, texts, context, steps)
        runs = [(name, config, None) for name, config in configs.items()]
        if oracle:
            cache = llm.engine.runner.cache
            runs += [
                (f"{name} oracle", config, OracleSelector(config, cache))
                for name, config in configs.items()
                if config.scorer == "bound"  # the mass scorer's refresh steps are dense anyway
            ]
        for name, config, selector in runs:
            stats = teacher_forced(llm, texts, context, steps, config, dense, selector)
            rows.append(
                {
                    "batch": batch,
                    "scorer": name,
                    "context": context,
                    **asdict(stats),
                    "perplexity_ratio": stats.perplexity_ratio,
                    "step_ratio": stats.step_ratio,
                }
            )
            print(
                f"  fidelity batch {batch} {name}: KL mean {stats.kl_mean:.4f} "
                f"p99 {stats.kl_p99:.4f}, top-1 {stats.top1_agreement:.4f}, "
                f"ppl ratio {stats.perplexity_ratio:.4f}, {100 * stats.blocks_kept:.0f} % blocks, "
                f"step {stats.step_ms:.1f} ms against dense {stats.dense_step_ms:.1f} ms",
                flush=True,
            )
    return rows


def passkey_rows(
    llm: LLM, configs: dict[str, PruningConfig | None], lengths: tuple[int, ...]
) -> list[dict]:
    """Every case under every configuration (None: dense). One length at a time, so that the
    pool keeps its prompts: after the first configuration they come from the prefix cache, and
    each further one costs only its decode steps."""
    rows = []
    for haystack in ("repeated", "varied"):
        found: dict[str, list[bool]] = {name: [] for name in configs}
        for length in lengths:
            cases = passkey_cases(llm.tokenizer, (length,), haystack)
            hits = {}
            for name, config in configs.items():
                llm.engine.set_pruning(config)
                hits[name] = passkey_accuracy(llm, cases)
                found[name] += hits[name]
            for i, case in enumerate(cases):
                rows.append(
                    {"haystack": haystack, "length": case.length, "depth": case.depth}
                    | {name: h[i] for name, h in hits.items()}
                )
        print(
            f"  passkey {haystack}: "
            + ", ".join(f"{name} {sum(h)}/{len(h)}" for name, h in found.items()),
            flush=True,
        )
    llm.engine.set_pruning(None)
    return rows


def dense_layer_sweep(llm: LLM, corpus: list[int], context: int, steps: int, options) -> list[dict]:
    """Teacher-forced KL with the first ``n`` layers dense, for each ``n``."""
    rows = []
    texts = [corpus[: context + steps]]
    llm.engine.set_pruning(None)
    dense = forced_log_probs(llm, texts, context, steps)
    for n in options:
        stats = teacher_forced(
            llm, texts, context, steps, replace(CONFIGS["bound"], dense_layers=n), dense
        )
        rows.append(
            {
                "dense_layers": n,
                "kl_mean": stats.kl_mean,
                "kl_p99": stats.kl_p99,
                "top1_agreement": stats.top1_agreement,
                "blocks_kept": stats.blocks_kept,
            }
        )
        print(
            f"  dense_layers {n}: KL mean {stats.kl_mean:.4f}, top-1 {stats.top1_agreement:.4f}",
            flush=True,
        )
    return rows


def plot_blocks_against_entropy(pruned: LLM, corpus: list[int], context: int, path: Path) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = pruned.generate(
        [corpus[:context]], SamplingParams(temperature=1.0, seed=0, max_tokens=256, ignore_eos=True)
    )[0]
    # The first token comes from the prefill; every later one from a decode step whose budget
    # followed the entropy of the token before it.
    entropies, kept = out.entropies[:-1], out.blocks_kept
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    left.plot(entropies, label="entropy of the previous token (nats)", linewidth=1)
    left.plot([10 * b for b in kept], label="blocks kept (x10 share)", linewidth=1)
    left.set_xlabel("decode step")
    left.legend()
    right.scatter(entropies, kept, s=6)
    right.set_xlabel("entropy of the previous token (nats)")
    right.set_ylabel("share of blocks kept")
    fig.suptitle(f"Entropic pruning over one generation after {context} tokens of context")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return {"entropies": out.entropies, "blocks_kept": out.blocks_kept}


def engine(args: argparse.Namespace) -> LLM:
    """One engine for every comparison, built with pruning on so that its cache keeps the key
    bounds; ``set_pruning`` switches it between dense and each configuration."""
    longest = max(max(args.contexts), args.fidelity_context + args.fidelity_steps) + 128
    return LLM(
        args.model,
        control=ControlConfig(pruning=CONFIGS["bound"]),
        max_num_seqs=max(max(args.batches), 16),
        max_num_batched_tokens=2048,
        num_kvcache_blocks=max(max(args.batches), 6) * (longest // 16 + 8) + 64,
    )


def run(args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = engine(args)
    corpus = corpus_tokens(llm.tokenizer)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = dict.fromkeys(args.speed_configs + args.fidelity_configs + args.passkey_configs)
    report: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "pruning": {name: asdict(CONFIGS[name]) for name in names},
    }

    def subset(names: list[str]) -> dict[str, PruningConfig]:
        return {name: CONFIGS[name] for name in names}

    def save() -> None:  # after every part: a long run leaves what it measured behind
        (out_dir / "pruning.json").write_text(json.dumps(report, indent=2))

    parts = set(args.parts)
    if "speed" in parts:
        print("decode step time, dense against pruned", flush=True)
        report["speed"] = speed_rows(
            llm, subset(args.speed_configs), args.batches, args.contexts, args.steps, args.clock
        )
        save()
    if "fidelity" in parts:
        print("teacher-forced fidelity", flush=True)
        report["fidelity"] = fidelity_rows(
            llm,
            subset(args.fidelity_configs),
            corpus,
            args.fidelity_batches,
            args.fidelity_context,
            args.fidelity_steps,
            args.oracle,
        )
        save()
    if "passkey" in parts:
        print("passkey retrieval", flush=True)
        report["passkey"] = passkey_rows(
            llm, {"dense": None, **subset(args.passkey_configs)}, tuple(args.passkey_lengths)
        )
        save()
    if "layers" in parts:
        print("dense layers", flush=True)
        report["dense_layers"] = dense_layer_sweep(
            llm, corpus, args.fidelity_context, args.fidelity_steps, (0, 1, 2, 4)
        )
        save()
    if "trace" in parts:
        llm.engine.set_pruning(CONFIGS[args.speed_configs[0]])
        report["trace"] = plot_blocks_against_entropy(
            llm, corpus, args.fidelity_context, out_dir / "blocks_vs_entropy.png"
        )
        save()
    return report


PARTS = ("speed", "fidelity", "passkey", "layers", "trace")


def add_commands(kinds: argparse._SubParsersAction) -> None:
    for name, parts in (("pruning", PARTS), ("fidelity", ("fidelity", "passkey"))):
        parser = kinds.add_parser(name, help="entropic pruning against dense: " + ", ".join(parts))
        parser.add_argument("--model")
        parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
        parser.add_argument(
            "--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 6144, 8000]
        )
        parser.add_argument("--steps", type=int, default=8)
        parser.add_argument(
            "--clock",
            choices=["wall", "cpu"],
            default="wall",
            help="cpu: this process's CPU time per step, which a busy machine inflates far "
            "less than wall time (use with --threads 1)",
        )
        parser.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
        parser.add_argument("--fidelity-batches", type=int, nargs="+", default=[1, 8])
        parser.add_argument("--fidelity-context", type=int, default=6144)
        parser.add_argument("--fidelity-steps", type=int, default=128)
        parser.add_argument(
            "--passkey-lengths", type=int, nargs="+", default=[1024, 2048, 4096, 6144, 8000]
        )
        for part, default in (
            ("speed", ["bound", "mass"]),
            ("fidelity", ["bound", "mass", "bound-half"]),
            ("passkey", ["bound", "mass"]),
        ):
            parser.add_argument(
                f"--{part}-configs", nargs="+", choices=list(CONFIGS), default=default
            )
        parser.add_argument(
            "--oracle",
            action="store_true",
            help="fidelity also with blocks ranked by their exact attention mass (slow)",
        )
        parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(parts))
        parser.add_argument("--output-dir", default=f"results/{name}")
        parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    run(args)
    return 0
