"""Entropic block pruning against dense attention: decode speed, attention work, fidelity.

    etinfer bench pruning --output-dir results/pruning      (etinfer bench fidelity: fidelity only)

Side by side in one run, dense attention and the entropic selector with both of its scorers (key
bounds and lagged attention mass):

- decode step time against context length at batch 1 and 8;
- attention FLOPs and KV bytes read per generated token (from the engine's telemetry: the
  (block, KV head) pairs each layer read);
- teacher-forced fidelity and passkey retrieval (``bench/fidelity.py``);
- how many leading layers must stay dense;
- a plot of blocks kept against entropy over one long generation.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

from etinfer.bench.fidelity import (
    corpus_tokens,
    passkey_accuracy,
    passkey_cases,
    teacher_forced,
)
from etinfer.bench.speed import ours_decode_step_ms
from etinfer.config import ControlConfig
from etinfer.control.block_selection import PruningConfig
from etinfer.engine.model_runner import AttentionStats
from etinfer.llm import LLM
from etinfer.model.config import ModelConfig
from etinfer.model.loader import LoadedModel, load_model
from etinfer.sampling_params import SamplingParams

# Named pruning configurations; each part of the benchmark runs the ones it is given.
CONFIGS = {
    "bound": PruningConfig(),
    "mass": PruningConfig(scorer="mass"),
    # A fidelity operating point: half the blocks at every entropy.
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


def speed_rows(dense: LLM, pruned: dict[str, LLM], batches, contexts, steps: int) -> list[dict]:
    rows = []
    config, block_size = dense.engine.model_config, dense.engine.block_size
    for batch in batches:
        for context in contexts:
            row = {
                "batch": batch,
                "context": context,
                "dense_ms": ours_decode_step_ms(dense, batch, context, steps),
            }
            for name, llm in pruned.items():
                stats: list[AttentionStats] = []
                ms = ours_decode_step_ms(
                    llm,
                    batch,
                    context,
                    steps,
                    on_step=lambda llm=llm, stats=stats: stats.append(llm.engine.last_attention),
                )
                row[name] = {
                    "ms": ms,
                    "ratio": ms / row["dense_ms"],
                    **step_work(stats, config, block_size),
                }
            rows.append(row)
            parts = [f"dense {row['dense_ms']:.1f} ms"] + [
                f"{name} {row[name]['ms']:.1f} ms ({row[name]['ratio']:.2f}x, "
                f"{100 * row[name]['blocks_kept']:.0f} % blocks)"
                for name in pruned
            ]
            print(f"  batch {batch} context {context:5d}: " + ", ".join(parts), flush=True)
    return rows


def fidelity_rows(
    dense: LLM, pruned: dict[str, LLM], corpus: list[int], batches, context: int, steps: int
) -> list[dict]:
    rows = []
    for batch in batches:
        stride = (len(corpus) - context - steps) // batch
        texts = [corpus[i * stride : i * stride + context + steps] for i in range(batch)]
        for name, llm in pruned.items():
            stats = teacher_forced(dense, llm, texts, context, steps)
            rows.append(
                {
                    "batch": batch,
                    "scorer": name,
                    "context": context,
                    **asdict(stats),
                    "perplexity_ratio": stats.perplexity_ratio,
                }
            )
            print(
                f"  fidelity batch {batch} {name}: KL mean {stats.kl_mean:.4f} "
                f"p99 {stats.kl_p99:.4f}, top-1 {stats.top1_agreement:.4f}, "
                f"ppl ratio {stats.perplexity_ratio:.4f}",
                flush=True,
            )
    return rows


def passkey_rows(llms: dict[str, LLM], lengths: tuple[int, ...]) -> list[dict]:
    rows = []
    tokenizer = next(iter(llms.values())).tokenizer
    for haystack in ("repeated", "varied"):
        cases = passkey_cases(tokenizer, lengths, haystack)
        found = {name: passkey_accuracy(llm, cases) for name, llm in llms.items()}
        for i, case in enumerate(cases):
            rows.append(
                {"haystack": haystack, "length": case.length, "depth": case.depth}
                | {name: hits[i] for name, hits in found.items()}
            )
        print(
            f"  passkey {haystack}: "
            + ", ".join(f"{name} {sum(h)}/{len(h)}" for name, h in found.items()),
            flush=True,
        )
    return rows


def dense_layer_sweep(
    loaded: LoadedModel,
    dense: LLM,
    corpus: list[int],
    context: int,
    steps: int,
    options,
    engine_kwargs,
) -> list[dict]:
    """Teacher-forced KL with the first ``n`` layers dense, for each ``n``."""
    rows = []
    for n in options:
        llm = LLM(
            loaded,
            control=ControlConfig(pruning=replace(CONFIGS["bound"], dense_layers=n)),
            **engine_kwargs,
        )
        stats = teacher_forced(dense, llm, [corpus[: context + steps]], context, steps)
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
        del llm
        gc.collect()
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


def engines(args: argparse.Namespace) -> tuple[LoadedModel, LLM, dict[str, LLM], dict]:
    loaded = load_model(args.model)
    longest = max(max(args.contexts), args.fidelity_context + args.fidelity_steps) + 128
    kwargs = dict(
        max_num_seqs=max(max(args.batches), 16),
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
        num_kvcache_blocks=max(max(args.batches), 5) * (longest // 16 + 8) + 64,
    )
    dense = LLM(loaded, **kwargs)
    names = dict.fromkeys(args.speed_configs + args.fidelity_configs + args.passkey_configs)
    pruned = {
        name: LLM(loaded, control=ControlConfig(pruning=CONFIGS[name]), **kwargs) for name in names
    }
    return loaded, dense, pruned, kwargs


def run(args: argparse.Namespace) -> dict:
    loaded, dense, pruned, kwargs = engines(args)
    corpus = corpus_tokens(dense.tokenizer)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "pruning": {name: asdict(CONFIGS[name]) for name in pruned},
    }

    def subset(names: list[str]) -> dict[str, LLM]:
        return {name: pruned[name] for name in names}

    def save() -> None:  # after every part: a long run leaves what it measured behind
        (out_dir / "pruning.json").write_text(json.dumps(report, indent=2))

    if not args.fidelity_only:
        print("decode step time, dense against pruned", flush=True)
        report["speed"] = speed_rows(
            dense, subset(args.speed_configs), args.batches, args.contexts, args.steps
        )
        save()
    print("teacher-forced fidelity", flush=True)
    report["fidelity"] = fidelity_rows(
        dense,
        subset(args.fidelity_configs),
        corpus,
        args.fidelity_batches,
        args.fidelity_context,
        args.fidelity_steps,
    )
    save()
    print("passkey retrieval", flush=True)
    report["passkey"] = passkey_rows(
        {"dense": dense, **subset(args.passkey_configs)}, tuple(args.passkey_lengths)
    )
    save()
    if not args.fidelity_only:
        print("dense layers", flush=True)
        report["dense_layers"] = dense_layer_sweep(
            loaded, dense, corpus, args.fidelity_context, args.fidelity_steps, (0, 1, 2, 4), kwargs
        )
        report["trace"] = plot_blocks_against_entropy(
            pruned[args.speed_configs[0]],
            corpus,
            args.fidelity_context,
            out_dir / "blocks_vs_entropy.png",
        )
        save()
    return report


def add_commands(kinds: argparse._SubParsersAction) -> None:
    for name, fidelity_only in (("pruning", False), ("fidelity", True)):
        parser = kinds.add_parser(
            name,
            help="entropic pruning against dense: "
            + ("fidelity" if fidelity_only else "speed, work, fidelity"),
        )
        parser.add_argument("--model")
        parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
        parser.add_argument(
            "--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 6144, 8000]
        )
        parser.add_argument("--steps", type=int, default=8)
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
        parser.add_argument("--output-dir", default=f"results/{name}")
        parser.set_defaults(func=main, fidelity_only=fidelity_only)


def main(args: argparse.Namespace) -> int:
    run(args)
    return 0
