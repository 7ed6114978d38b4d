"""Serving benchmark: a seeded workload sent at wall-clock arrival times, latency and throughput.

    etinfer bench serving --policy entropy --num-requests 64 --request-rate 2 --seed 0 \\
        --output requests.json

The engine runs in this process on the wall clock (``bench/common/driver.py``): each request is
added when its arrival time has passed, with that arrival time (a request that arrives while a step
runs has waited for it), and the engine steps while it has work. With ``--base-url`` the same
requests go to an OpenAI-compatible server instead (streamed completions with token-id prompts,
``ignore_eos``, usage in the last chunk).

Every request decodes exactly its drawn number of output tokens (EOS ignored, as vLLM's
benchmark does with ``--ignore-eos``), so both policies do the same work. Metrics follow vLLM's
benchmark: TTFT; TPOT excludes the first token; end-to-end latency; queue time from arrival to
first scheduling. ``recomputed_tokens`` are tokens whose KV a preemption discarded, less those
the prefix cache found again. ``jain_fairness`` is Jain's index over per-request output rates
(output tokens over end-to-end latency): 1 when every request is served at the same rate.

The run's result carries these figures (its ``details``: the summary, the policy); ``--output``
writes them with every request's record.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

from etinfer import options
from etinfer.bench.common.driver import drive_engine, drive_server, warm_up
from etinfer.bench.common.results import Figure, add_result_option, recorded
from etinfer.bench.common.serving_metrics import format_table, result_figures, summarize
from etinfer.bench.common.workload import (
    TextPrompts,
    add_workload_args,
    driver_requests,
    load_workload,
)
from etinfer.control.config import ControlConfig
from etinfer.control.scheduling import SchedulingConfig
from etinfer.options import positive_int


def add_engine_options(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """The engine options of this benchmark, and of the sweep that passes them on to it: the
    control layers follow ``--policy``, and ``--seed`` seeds the workload."""
    options.add_engine_options(
        parser,
        exclude=("control", "scheduling_policy", "seed", *exclude),
        # 16 sequences are near this CPU's throughput knee (293 tok/s against 332 at 32,
        # BENCHMARKS.md, "Serving"): more only stretches every request, and fewer let a queue
        # form past saturation.
        defaults={"max_num_seqs": 16},
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = options.engine_kwargs(args)
    if args.policy == "entropy":
        overrides = json.loads(args.scheduling_config or "{}")
        kwargs["control"] = ControlConfig(scheduling=SchedulingConfig(**overrides))
    elif args.scheduling_config:
        raise ValueError("--scheduling-config applies to --policy entropy only")
    return kwargs


def wait_for_go(ready_file: str | None, go_file: str | None) -> None:
    """Say this run is ready, then wait for the word to start: paired runs in two processes
    start their workloads together, whatever loading the model took in each."""
    if ready_file:
        Path(ready_file).touch()
    while go_file and not Path(go_file).exists():
        time.sleep(0.01)


def run(args: argparse.Namespace) -> tuple[list[Figure], dict]:
    from etinfer.llm import LLM

    if args.replicas:
        from etinfer.bench.serving import replicas  # it builds on this module

        return replicas.run(args)
    options.set_threads(args)
    requests = load_workload(args)
    lengths = [r.prompt_tokens for r in requests]
    if args.base_url:
        from etinfer.model.loader import load_model

        prompts = TextPrompts(load_model(args.model).tokenizer).take(lengths, args.seed)
        wait_for_go(args.ready_file, args.go_file)
        records, duration = drive_server(
            args.base_url, driver_requests(requests, prompts), model=args.served_model
        )
        result = summarize(records, duration)
        device = {}  # the server's, which this client does not know
    else:
        engine = LLM(args.model, **engine_kwargs(args)).engine
        prompts = TextPrompts(engine.tokenizer).take(lengths, args.seed)
        warm_up(engine)
        wait_for_go(args.ready_file, args.go_file)
        driven = drive_engine(engine, driver_requests(requests, prompts))
        records = driven.records
        scheduler = engine.scheduler
        result = summarize(
            records,
            driven.makespan,
            preemptions=scheduler.num_preemptions,
            recomputed_tokens=scheduler.num_recomputed_tokens,
        )
        device = {"device": str(engine.config.torch_device())}
    label = f"server at {args.base_url}" if args.base_url else args.policy
    print(format_table({label: result}))
    report = {
        "policy": label,
        "scheduling_config": args.scheduling_config,
        "prompts": TextPrompts.SOURCE,
        **result,
        **device,
    }
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        every = {"requests": [asdict(r) for r in records]}
        Path(args.output).write_text(json.dumps(report | every, indent=2))
    arm = "server" if args.base_url else args.policy
    return result_figures({arm: [result]}), report


def add_command(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("serving", help="latency and throughput of a serving workload")
    parser.add_argument(
        "--policy", choices=("fcfs", "entropy"), default="fcfs", help="in-process engine only"
    )
    add_workload_args(parser)
    add_engine_options(parser)
    parser.add_argument("--base-url", help="send to this OpenAI-compatible server instead")
    parser.add_argument(
        "--served-model", help="model name for --base-url (default: the first the server serves)"
    )
    parser.add_argument(
        "--scheduling-config", help="SchedulingConfig fields as JSON, e.g. '{\"alpha\": 0}'"
    )
    options.add_threads_option(parser)
    parser.add_argument("--ready-file", help="create this file when loaded and warmed up")
    parser.add_argument("--go-file", help="then start the workload once this file exists")
    parser.add_argument("--output", help="write the figures and per-request records as JSON")
    add_result_option(parser)
    parser.add_argument(
        "--replicas",
        type=int,
        nargs="+",
        help="compare these replica counts on Ray Serve (each count's replicas share the "
        "cores; bench/serving/replicas.py) instead of running one engine in this process",
    )
    parser.add_argument(
        "--shared-prefix-tokens",
        type=int,
        default=0,
        help="with --replicas: every prompt opens with one of --num-prefixes texts this long",
    )
    parser.add_argument("--num-prefixes", type=positive_int, default=4)
    parser.set_defaults(func=recorded("serving", run))
