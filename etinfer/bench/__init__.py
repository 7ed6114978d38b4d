"""Benchmarks of the engine: scripts that print figures side by side in one run (never timed
tests), grouped by what they measure, each writing one JSON result. ``common/`` holds what
several share (the drivers, workloads, prompts, statistics, fidelity measures, the machine's
description). The paper's studies (Table 1, the laws one at a time, the stress tests, the seed
systems) are not here but in the checkout's ``studies/`` package (``python -m studies``)."""

from __future__ import annotations

import argparse

# The studies' commands, which moved out of the runtime package: asking ``etinfer bench`` for
# one says where it went instead of "invalid choice".
STUDIES = (
    "ablation", "fidelity", "iss", "longcontext", "pruning", "sampling", "scheduling-sim",
    "speculative", "stress", "switching",
)  # fmt: skip


def add_bench_commands(commands: argparse._SubParsersAction) -> None:
    # Imported here: `etinfer generate` and `etinfer serve` need none of them.
    from etinfer.bench.quality import perplexity, prompt_logprobs_cost
    from etinfer.bench.serving import abuse, server_load, serving, serving_sweep
    from etinfer.bench.speed import (
        kernels,
        kv_cache,
        memory,
        prefill_attention,
        quantization,
        speed,
        step_profile,
    )
    from etinfer.bench.structured import structured

    bench = commands.add_parser("bench", help="run a benchmark of the engine")
    kinds = bench.add_subparsers(dest="bench", required=True)
    speed.add_command(kinds)
    step_profile.add_command(kinds)
    serving.add_command(kinds)
    serving_sweep.add_command(kinds)
    server_load.add_command(kinds)
    abuse.add_command(kinds)
    kernels.add_command(kinds)
    prefill_attention.add_command(kinds)
    quantization.add_command(kinds)
    kv_cache.add_command(kinds)
    memory.add_command(kinds)
    structured.add_command(kinds)
    perplexity.add_command(kinds)
    prompt_logprobs_cost.add_command(kinds)
    for name in STUDIES:
        # No option prefix: whatever the study's own flags were, they are taken as they come.
        study = kinds.add_parser(
            name, help=f"a study: python -m studies {name}", add_help=False, prefix_chars="\0"
        )
        study.add_argument("arguments", nargs="*")
        study.set_defaults(func=_moved(name))


def _moved(name: str):
    def refuse(args: argparse.Namespace) -> int:
        raise ValueError(
            f"{name!r} is one of the paper's studies, not an engine benchmark: run "
            f"`python -m studies {name} ...` from a checkout of etinfer"
        )

    return refuse
