"""Entropic block pruning against dense attention: decode speed, attention work, fidelity.

    python -m studies pruning --output-dir results/pruning
    python -m studies fidelity  (fidelity only)

Side by side in one run and on one engine (prefill is dense, so every comparison decodes the
same prefilled cache both ways), dense attention and the entropic selector's configurations:

- decode step time against context length at batch 1 and 8, and attention FLOPs and KV bytes
  read per generated token (``bench/laws/pruning_speed.py``);
- teacher-forced fidelity and passkey retrieval (``bench/common/fidelity.py``);
- how many leading layers must stay dense;
- a plot of blocks kept against entropy over one long generation.

``--output-dir`` keeps the report (``pruning.json``, written after every part and the result's
``details``) and the plot; the result's figures are ``pruning_figures.py``'s.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from etinfer import options
from etinfer.bench.common.fidelity import (
    corpus_tokens,
    forced_log_probs,
    teacher_forced,
)
from etinfer.bench.common.results import Figure, add_result_option, recorded
from etinfer.control.block_selection import PruningConfig
from etinfer.control.config import ControlConfig
from etinfer.engine.layers import full_context_layers
from etinfer.llm import LLM
from etinfer.model.config import ModelConfig
from etinfer.options import positive_int
from studies import PROGRAM
from studies.laws.pruning_arms import Rankings, add_ranking_options, arms
from studies.laws.pruning_configs import BOUND, CONFIGS
from studies.laws.pruning_figures import figures
from studies.laws.pruning_passkeys import DENSE, passkey_rows
from studies.laws.pruning_plots import plot_blocks_against_entropy, plot_bytes_against_kl
from studies.laws.pruning_speed import speed_rows


def fidelity_rows(
    llm: LLM,
    configs: dict[str, PruningConfig],
    corpus: list[int],
    batches,
    context: int,
    steps: int,
    rankings: Rankings | None = None,
) -> list[dict]:
    """Teacher-forced fidelity of each configuration, and of each with the other ``rankings``
    (``pruning_arms.py``)."""
    rows = []
    for batch in batches:
        stride = (len(corpus) - context - steps) // batch
        texts = [corpus[i * stride : i * stride + context + steps] for i in range(batch)]
        llm.engine.set_pruning(None)
        dense = forced_log_probs(llm, texts, context, steps)
        # Calibration reads the corpus's last tokens, which no text here reaches.
        calibration = corpus[-(context + steps) :]
        runs = arms(llm, configs, rankings or Rankings(), calibration, context, steps)
        model = llm.engine.model_config
        # The share of (block, KV head) pairs of the whole context that dense attention reads:
        # 1 unless some layers slide over a window (Gemma 3), measured by keeping every block.
        dense_reads = 1.0
        if model.mixed_windows:
            everything = replace(BOUND, budget_low=1.0, budget_high=1.0, min_context=0)
            dense_reads = teacher_forced(llm, texts, context, steps, everything, dense).blocks_kept
        for name, config, selector in runs:
            stats = teacher_forced(llm, texts, context, steps, config, dense, selector)
            # A sketch reads its share of every key in each pruned layer, besides the blocks.
            sketch = getattr(selector, "sketch_share", engine_sketch_share(config, model))
            # ... in each layer it prunes: past the dense ones, those that see the whole
            # context (sliding layers read their window, never pruned).
            full = full_context_layers(model)
            pruned = sum(layer >= config.dense_layers for layer in full) / model.num_layers
            rows.append(
                {
                    "batch": batch,
                    "scorer": name,
                    "context": context,
                    **asdict(stats),
                    "perplexity_ratio": stats.perplexity_ratio,
                    "step_ratio": stats.step_ratio,
                    "sketch_reads": sketch * pruned,
                    "dense_reads": dense_reads,
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


def engine_sketch_share(config: PruningConfig, model: ModelConfig) -> float:
    """The share of a 16-bit cache's KV bytes the engine's sketch scorer reads of every token
    in each layer it prunes: the copy's 8-bit components and its float32 scale."""
    if not config.sketched:
        return 0.0
    return (config.rank_for(model.head_dim) + 4) / (2 * 2 * model.head_dim)


def dense_layer_sweep(
    llm: LLM, corpus: list[int], context: int, steps: int, counts: tuple[int, ...]
) -> list[dict]:
    """Teacher-forced KL with the first ``n`` layers dense, for each ``n``."""
    rows = []
    texts = [corpus[: context + steps]]
    llm.engine.set_pruning(None)
    dense = forced_log_probs(llm, texts, context, steps)
    for n in counts:
        stats = teacher_forced(llm, texts, context, steps, replace(BOUND, dense_layers=n), dense)
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


def engine(args: argparse.Namespace) -> LLM:
    """One engine for every comparison, built with pruning by the digest so that its cache keeps
    the key bounds and the keys' moments (every other scorer's summaries), or by the sketch
    where a configuration asks for its key copy (then no digest configuration may run: one
    engine keeps one or the other); ``set_pruning`` switches it between dense and each
    configuration. Its batch and pool are sized for the largest batch and context asked."""
    longest = max(max(args.contexts), args.fidelity_context + args.fidelity_steps) + 128
    names = args.speed_configs + args.fidelity_configs + args.passkey_configs
    sketched = any(CONFIGS[name].sketched for name in names)
    if sketched and any(CONFIGS[name].scorer == "digest" for name in names):
        raise SystemExit("the sketch and digest configurations need two runs: one engine each")
    return LLM(
        args.model,
        control=ControlConfig(pruning=configured("sketch" if sketched else "digest", args)),
        max_num_seqs=max(max(args.batches), 16),
        num_kvcache_blocks=max(max(args.batches), 6) * (longest // args.block_size + 8) + 64,
        **options.engine_kwargs(args),
    )


def dense_engine(args: argparse.Namespace) -> LLM:
    """A dense engine like ``engine``'s whose attention is the torch kernel: the passkeys' other
    exact dense computation (``pruning_passkeys.py``)."""
    longest = max(args.passkey_lengths) + 128
    return LLM(
        args.model,
        max_num_seqs=16,
        num_kvcache_blocks=6 * (longest // args.block_size + 8) + 64,
        **options.engine_kwargs(args) | {"attention_backend": "torch"},
    )


def configured(name: str, args: argparse.Namespace) -> PruningConfig:
    """The configuration ``name``, its key copy's rank ``--sketch-rank`` where it reads one."""
    config = CONFIGS[name]
    if config.sketched and args.sketch_rank is not None:
        return replace(config, sketch_rank=args.sketch_rank)
    return config


def run(args: argparse.Namespace) -> tuple[list[Figure], dict]:
    options.set_threads(args)
    llm = engine(args)
    corpus = corpus_tokens(llm.tokenizer)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = dict.fromkeys(args.speed_configs + args.fidelity_configs + args.passkey_configs)
    report: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "pruning": {name: asdict(configured(name, args)) for name in names},
        "setting": {
            "block_size": llm.engine.config.block_size,
            "quantization": llm.engine.config.quantization,
            "model": args.model,  # None: the default model
            # an engine built for a sketch scorer keeps every key's low-rank copy
            "key_copy": llm.engine.runner.cache.key_sketch is not None,
            "sketch_rank": args.sketch_rank,  # None: the default rank
        },
    }

    def subset(names: list[str]) -> dict[str, PruningConfig]:
        return {name: configured(name, args) for name in names}

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
            Rankings.from_args(args),
        )
        plot_bytes_against_kl(report["fidelity"], report["pruning"], out_dir / "bytes_vs_kl.png")
        save()
    if "passkey" in parts:
        print("passkey retrieval", flush=True)
        # The rankings apply to passkeys too, calibrated on the corpus's last tokens.
        context, steps = args.fidelity_context, args.fidelity_steps
        runs = arms(
            llm, subset(args.passkey_configs), Rankings.from_args(args),
            corpus[-(context + steps) :], context, steps,
        )  # fmt: skip
        lengths = tuple(args.passkey_lengths)
        dense = [(DENSE, None, None)]
        report["passkey"] = passkey_rows(llm, dense + runs, lengths, lambda: dense_engine(args))
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
    return figures(report, args.steps), report | {"device": str(llm.engine.config.torch_device())}


PARTS = ("speed", "fidelity", "passkey", "layers", "trace")


def add_commands(kinds: argparse._SubParsersAction) -> None:
    for name, parts in (("pruning", PARTS), ("fidelity", ("fidelity", "passkey"))):
        parser = kinds.add_parser(name, help="entropic pruning against dense: " + ", ".join(parts))
        options.add_engine_options(
            parser,
            exclude=("control", "max_num_seqs", "num_kvcache_blocks", "kv_cache_gib"),
            defaults={"max_num_batched_tokens": 2048},
        )
        parser.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8])
        parser.add_argument(
            "--contexts", type=positive_int, nargs="+", default=[1024, 2048, 4096, 6144, 8000]
        )
        parser.add_argument("--steps", type=positive_int, default=8)
        parser.add_argument(
            "--clock",
            choices=["wall", "cpu"],
            default="wall",
            help="cpu: this process's CPU time per step, which a busy machine inflates far "
            "less than wall time (use with --threads 1)",
        )
        options.add_threads_option(parser)
        parser.add_argument("--fidelity-batches", type=positive_int, nargs="+", default=[1, 8])
        parser.add_argument("--fidelity-context", type=positive_int, default=6144)
        parser.add_argument("--fidelity-steps", type=positive_int, default=128)
        parser.add_argument(
            "--passkey-lengths",
            type=positive_int,
            nargs="+",
            default=[1024, 2048, 4096, 6144, 8000],
        )
        for part, default in (
            ("speed", ["bound", "mass"]),
            ("fidelity", ["bound", "mass", "bound-half"]),
            ("passkey", ["bound", "mass"]),
        ):
            parser.add_argument(
                f"--{part}-configs", nargs="+", choices=list(CONFIGS), default=default
            )
        add_ranking_options(parser)
        parser.add_argument(
            "--sketch-rank",
            type=positive_int,
            help="the key copy's rank for the sketch scorers (default: 3/8 of the head size)",
        )
        parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(parts))
        parser.add_argument("--output-dir", default=f"results/{name}")
        add_result_option(parser)
        parser.set_defaults(func=recorded(name, run, PROGRAM))
