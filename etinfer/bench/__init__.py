"""Benchmarks: scripts that print figures side by side in one run (never timed tests), grouped by
what they measure. ``common/`` holds what several share (the drivers, workloads, prompts,
statistics, fidelity and quality measures, the machine's description and plotting)."""

from __future__ import annotations

import argparse


def add_bench_commands(commands: argparse._SubParsersAction) -> None:
    # Imported here: `etinfer generate` and `etinfer serve` need none of them.
    from etinfer.bench.ablation import ablation
    from etinfer.bench.laws import pruning, sampling, scheduling_sim
    from etinfer.bench.seed_systems import longcontext, speculative, switching
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
    from etinfer.bench.stress import iss_check, stress
    from etinfer.bench.structured import structured

    bench = commands.add_parser("bench", help="run a benchmark")
    kinds = bench.add_subparsers(dest="bench", required=True)
    speed.add_command(kinds)
    step_profile.add_command(kinds)
    sampling.add_command(kinds)
    pruning.add_commands(kinds)
    serving.add_command(kinds)
    serving_sweep.add_command(kinds)
    scheduling_sim.add_command(kinds)
    server_load.add_command(kinds)
    ablation.add_command(kinds)
    abuse.add_command(kinds)
    kernels.add_command(kinds)
    prefill_attention.add_command(kinds)
    longcontext.add_command(kinds)
    iss_check.add_command(kinds)
    stress.add_command(kinds)
    quantization.add_command(kinds)
    kv_cache.add_command(kinds)
    memory.add_command(kinds)
    speculative.add_command(kinds)
    switching.add_command(kinds)
    structured.add_command(kinds)
