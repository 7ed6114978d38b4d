"""Serving benchmark: a seeded workload sent at wall-clock arrival times, latency and throughput.

    etinfer bench serving --policy entropy --num-requests 64 --request-rate 2 --seed 0 \\
        --output result.json

The engine runs in this process: each request is added when its arrival time has passed, with
that arrival time (a request that arrives while a step runs has waited for it), and the engine
steps while it has work. With ``--base-url`` the same requests go to an OpenAI-compatible server
instead (streamed completions with token-id prompts, ``ignore_eos``, usage in the last chunk).

Every request decodes exactly its drawn number of output tokens (EOS ignored, as vLLM's
benchmark does with ``--ignore-eos``), so both policies do the same work. Metrics follow vLLM's
benchmark: TTFT; TPOT excludes the first token; end-to-end latency; queue time from arrival to
first scheduling. ``recomputed_tokens`` are tokens whose KV a preemption discarded, less those
the prefix cache found again. ``jain_fairness`` is Jain's index over per-request output rates
(output tokens over end-to-end latency): 1 when every request is served at the same rate.
"""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
import urllib.request
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from etinfer.bench import workload
from etinfer.bench.workload import TextPrompts, WorkloadRequest
from etinfer.config import ControlConfig
from etinfer.control.scheduling import SchedulingConfig
from etinfer.engine.llm_engine import LLMEngine
from etinfer.outputs import RequestOutput
from etinfer.sampling_params import SamplingParams

METRICS = (
    "num_requests",
    "completed",
    "failed",
    "duration_s",
    "request_throughput",
    "output_throughput",
    "ttft_mean",
    "ttft_p50",
    "ttft_p99",
    "tpot_mean",
    "tpot_p99",
    "e2e_mean",
    "e2e_p50",
    "e2e_p99",
    "queue_mean",
    "max_queue_time",
    "preemptions",
    "recomputed_tokens",
    "jain_fairness",
)


@dataclass
class RequestRecord:
    """One request's fate; times in seconds from its arrival."""

    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    queue_time: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.e2e is not None

    @classmethod
    def of(cls, out: RequestOutput) -> RequestRecord:
        m = out.metrics
        return cls(len(out.token_ids), m.time_to_first_token, m.total_time, m.queue_time)


def request_params(request: WorkloadRequest) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=request.output_tokens, ignore_eos=True)


def drive_engine(
    engine: LLMEngine, requests: list[WorkloadRequest], prompts: list[list[int]]
) -> tuple[list[RequestRecord], float]:
    """Run the workload in process; the records (in request order) and the makespan."""
    records = [RequestRecord() for _ in requests]
    index: dict[str, int] = {}
    arrivals = deque(enumerate(requests))
    start = time.perf_counter()
    while arrivals or engine.has_unfinished_requests():
        now = time.perf_counter()
        while arrivals and start + arrivals[0][1].arrival_s <= now:
            i, request = arrivals.popleft()
            params, arrival = request_params(request), start + request.arrival_s
            try:
                index[engine.add_request(prompts[i], params, arrival_time=arrival)] = i
            except ValueError as e:  # refused: it could never fit (the pool is too small)
                records[i].error = str(e)
        if engine.has_unfinished_requests():
            for out in engine.step():
                records[index.pop(out.request_id)] = RequestRecord.of(out)
        elif arrivals:
            time.sleep(max(0.0, start + arrivals[0][1].arrival_s - time.perf_counter()))
    return records, time.perf_counter() - start


def drive_http(
    base_url: str, model: str, requests: list[WorkloadRequest], prompts: list[list[int]]
) -> tuple[list[RequestRecord], float]:
    """Send the workload to an OpenAI-compatible server, one thread per request in flight."""
    records = [RequestRecord() for _ in requests]
    start = time.perf_counter()
    threads = []
    for i, request in enumerate(requests):
        time.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
        body = {
            "model": model,
            "prompt": prompts[i],
            "max_tokens": request.output_tokens,
            "ignore_eos": True,
            "temperature": 1.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        thread = threading.Thread(
            target=_http_request, args=(base_url, body, start + request.arrival_s, records[i])
        )
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    return records, time.perf_counter() - start


def _http_request(base_url: str, body: dict, arrival: float, record: RequestRecord) -> None:
    """Stream one completion, noting when the first text and the end arrive."""
    request = urllib.request.Request(
        base_url.rstrip("/") + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    chunks = 0
    try:
        with urllib.request.urlopen(request, timeout=3600) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data:") :])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    chunks += 1
                    if record.ttft is None:
                        record.ttft = time.perf_counter() - arrival
                usage = chunk.get("usage")
                if usage:
                    record.output_tokens = usage["completion_tokens"]
        record.e2e = time.perf_counter() - arrival
        record.output_tokens = record.output_tokens or chunks
    except (OSError, ValueError, KeyError) as e:
        record.error = f"{type(e).__name__}: {e}"


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def summarize(
    records: list[RequestRecord],
    duration: float,
    *,
    preemptions: int | None = None,
    recomputed_tokens: int | None = None,
) -> dict:
    """The figures of one run (latencies in seconds)."""
    done = [r for r in records if r.ok]
    ttft = [r.ttft for r in done if r.ttft is not None]
    e2e = [r.e2e for r in done]
    tpot = [
        (r.e2e - r.ttft) / (r.output_tokens - 1)
        for r in done
        if r.output_tokens > 1 and r.ttft is not None
    ]
    queue = [r.queue_time for r in done if r.queue_time is not None]
    rates = np.array([r.output_tokens / r.e2e for r in done if r.e2e > 0])
    output_tokens = sum(r.output_tokens for r in done)
    return {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "ttft_mean": _mean(ttft),
        "ttft_p50": _percentile(ttft, 50),
        "ttft_p99": _percentile(ttft, 99),
        "tpot_mean": _mean(tpot),
        "tpot_p99": _percentile(tpot, 99),
        "e2e_mean": _mean(e2e),
        "e2e_p50": _percentile(e2e, 50),
        "e2e_p99": _percentile(e2e, 99),
        "queue_mean": _mean(queue),
        "max_queue_time": max(queue, default=None),
        "preemptions": preemptions,
        "recomputed_tokens": recomputed_tokens,
        "jain_fairness": float(rates.sum() ** 2 / (len(rates) * (rates**2).sum()))
        if len(rates)
        else None,
    }


def format_table(columns: dict[str, dict]) -> str:
    """Metrics down, runs across (a markdown table)."""
    names = list(columns)
    lines = ["| metric | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for metric in METRICS:
        cells = [_cell(columns[n].get(metric)) for n in names]
        lines.append(f"| {metric} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: float | int | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.3f}" if abs(value) < 100 else f"{value:,.1f}"


def load_workload(args: argparse.Namespace) -> list[WorkloadRequest]:
    if args.trace:
        return workload.read_trace(args.trace)
    return workload.generate(
        args.workload,
        args.num_requests,
        args.request_rate,
        args.seed,
        burstiness=args.burstiness,
        length_scale=args.length_scale,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
    )


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=workload.WORKLOADS, default="sharegpt")
    parser.add_argument("--trace", help="replay a CSV of arrival_s,prompt_tokens,output_tokens")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1: Poisson")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--length-scale", type=float, default=1.0, help="multiplies lengths")
    parser.add_argument("--max-prompt-tokens", type=int)
    parser.add_argument("--max-output-tokens", type=int)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model")
    parser.add_argument("--num-kvcache-blocks", type=int)
    # 16 sequences are near this CPU's throughput knee (293 tok/s against 332 at 32, BENCHMARKS
    # issue 2): more only stretches every request, and fewer let a queue form past saturation.
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)


def engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = {
        "num_kvcache_blocks": args.num_kvcache_blocks,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    if args.policy == "entropy":
        overrides = json.loads(args.scheduling_config or "{}")
        kwargs["control"] = ControlConfig(scheduling=SchedulingConfig(**overrides))
    elif args.scheduling_config:
        raise ValueError("--scheduling-config applies to --policy entropy only")
    return kwargs


def warm_up(engine: LLMEngine) -> None:
    """One short request, so the first measured step does not pay for lazy initialisation."""
    engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def wait_for_go(ready_file: str | None, go_file: str | None) -> None:
    """Say this run is ready, then wait for the word to start: paired runs in two processes
    start their workloads together, whatever loading the model took in each."""
    if ready_file:
        Path(ready_file).touch()
    while go_file and not Path(go_file).exists():
        time.sleep(0.01)


def main(args: argparse.Namespace) -> int:
    from etinfer.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    requests = load_workload(args)
    lengths = [r.prompt_tokens for r in requests]
    if args.base_url:
        from etinfer.model.loader import load_model

        prompts = TextPrompts(load_model(args.model).tokenizer).take(lengths, args.seed)
        wait_for_go(args.ready_file, args.go_file)
        records, duration = drive_http(args.base_url, args.served_model, requests, prompts)
        result = summarize(records, duration)
    else:
        engine = LLM(args.model, **engine_kwargs(args)).engine
        prompts = TextPrompts(engine.tokenizer).take(lengths, args.seed)
        warm_up(engine)
        wait_for_go(args.ready_file, args.go_file)
        records, duration = drive_engine(engine, requests, prompts)
        scheduler = engine.scheduler
        result = summarize(
            records,
            duration,
            preemptions=scheduler.num_preemptions,
            recomputed_tokens=scheduler.num_recomputed_tokens,
        )
    label = f"server at {args.base_url}" if args.base_url else args.policy
    print(format_table({label: result}))
    result = {
        "policy": label,
        "scheduling_config": args.scheduling_config,
        "prompts": TextPrompts.SOURCE,
        **result,
        "requests": [asdict(r) for r in records],
    }
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2))
    return 0


def add_command(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("serving", help="latency and throughput of a serving workload")
    parser.add_argument(
        "--policy", choices=("fcfs", "entropy"), default="fcfs", help="in-process engine only"
    )
    add_workload_args(parser)
    add_engine_args(parser)
    parser.add_argument("--base-url", help="send to this OpenAI-compatible server instead")
    parser.add_argument("--served-model", default="etinfer", help="model name for --base-url")
    parser.add_argument(
        "--scheduling-config", help="SchedulingConfig fields as JSON, e.g. '{\"alpha\": 0}'"
    )
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--ready-file", help="create this file when loaded and warmed up")
    parser.add_argument("--go-file", help="then start the workload once this file exists")
    parser.add_argument("--output", help="write the figures and per-request records as JSON")
    parser.set_defaults(func=main)
