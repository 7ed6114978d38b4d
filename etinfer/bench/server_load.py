"""Load through the HTTP server: TTFT, ITL, TPOT, end-to-end latency and throughput at a few
request rates, measured by a client as vLLM's serving benchmark does.

Requests arrive with gamma-distributed gaps (shape ``burstiness``; 1 is a Poisson process) at
each rate in turn. Each is a streamed chat completion with a fixed number of output tokens
(EOS ignored), so every rate asks for the same work. TTFT runs from sending the request to the
first chunk with text; ITL is the gap between consecutive chunks with text; TPOT is
(end-to-end - TTFT) / (output tokens - 1) per request.

Without ``--url`` the benchmark starts ``etinfer serve`` in a subprocess on a free loopback
port, so the server and this client do not share an interpreter (as in a real deployment; on a
small machine they still share the cores).

    etinfer bench server --rates 1 4 --num-requests 48 --output results/server_load.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from etinfer.bench.prompts import instructions

SERVER_START_S = 300.0  # reading the model and building the engine on a loaded machine


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class RateResult:
    rate: float
    num_requests: int
    completed: int
    duration_s: float
    request_throughput: float  # completed requests per second
    output_throughput: float  # generated tokens per second
    ttft_ms: dict[str, float]  # mean, median, p99
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]


def summary_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "mean": 1000 * statistics.fmean(ordered),
        "median": 1000 * statistics.median(ordered),
        "p99": 1000 * p99,
    }


def arrival_gaps(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Seconds between consecutive arrivals: gamma with mean 1 / rate."""
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


async def one_request(client, model: str, prompt: str, max_tokens: int) -> RequestResult:
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last = None
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                result.output_tokens = chunk.usage.completion_tokens
            if not (chunk.choices and chunk.choices[0].delta.content):
                continue
            if last is None:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last = now
        result.e2e = time.perf_counter() - start
        result.ok = last is not None
    except Exception as e:  # a failed request is counted, not fatal to the run
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_rate(
    client, model: str, rate: float, args: argparse.Namespace, rng: random.Random
) -> RateResult:
    prompts = instructions(args.num_requests)
    gaps = arrival_gaps(args.num_requests, rate, args.burstiness, rng)
    tasks = []
    start = time.perf_counter()
    for prompt, gap in zip(prompts, gaps, strict=True):
        await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one_request(client, model, prompt, args.max_tokens)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    done = [r for r in results if r.ok]
    for r in results:
        if r.error:
            print(f"  failed: {r.error}", file=sys.stderr)
    return RateResult(
        rate=rate,
        num_requests=len(results),
        completed=len(done),
        duration_s=duration,
        request_throughput=len(done) / duration,
        output_throughput=sum(r.output_tokens for r in done) / duration,
        ttft_ms=summary_ms([r.ttft for r in done]),
        tpot_ms=summary_ms([r.tpot for r in done if r.tpot is not None]),
        itl_ms=summary_ms([gap for r in done for gap in r.itl]),
        e2e_ms=summary_ms([r.e2e for r in done]),
    )


@contextlib.contextmanager
def local_server(args: argparse.Namespace) -> Iterator[str]:
    """``etinfer serve`` in a subprocess on a free loopback port; yields its URL."""
    import httpx2

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "etinfer.cli",
        "serve",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--max-num-seqs",
        str(args.max_num_seqs),
    ]
    if args.model:
        command += ["--model", args.model]
    server = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"etinfer serve exited with {server.returncode}")
            with contextlib.suppress(httpx2.TransportError):
                if httpx2.get(f"{url}/health").status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("etinfer serve did not come up")
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=60)


async def run_all(url: str, args: argparse.Namespace) -> list[RateResult]:
    import openai

    rng = random.Random(args.seed)
    async with openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key=args.api_key or "none", max_retries=0, timeout=600
    ) as client:
        model = (await client.models.list()).data[0].id
        await one_request(client, model, "Warm up.", 4)  # first-call costs out of the figures
        rows = []
        for rate in args.rates:
            print(f"rate {rate:g} req/s: {args.num_requests} requests ...", flush=True)
            rows.append(await run_rate(client, model, rate, args, rng))
        return rows


def print_table(rows: list[RateResult]) -> None:
    print(
        "| rate (req/s) | done | req/s | out tok/s | TTFT mean / p50 / p99 (ms) | "
        "TPOT mean / p50 / p99 (ms) | ITL mean / p50 / p99 (ms) | E2E mean / p50 / p99 (ms) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")

    def cell(s: dict[str, float]) -> str:
        return f"{s['mean']:,.0f} / {s['median']:,.0f} / {s['p99']:,.0f}"

    for r in rows:
        print(
            f"| {r.rate:g} | {r.completed}/{r.num_requests} | {r.request_throughput:.2f} | "
            f"{r.output_throughput:.1f} | {cell(r.ttft_ms)} | {cell(r.tpot_ms)} | "
            f"{cell(r.itl_ms)} | {cell(r.e2e_ms)} |"
        )


def add_command(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("server", help="TTFT, ITL and throughput through the HTTP server")
    parser.add_argument("--url", help="a running server (default: start etinfer serve here)")
    parser.add_argument("--api-key", help="the server's API key, if it has one")
    parser.add_argument("--model", help="model for the server started here")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 4.0], help="req/s")
    parser.add_argument("--num-requests", type=int, default=48, help="per rate")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1: Poisson")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="write the figures as JSON here")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.url:
        rows = asyncio.run(run_all(args.url, args))
    else:
        with local_server(args) as url:
            rows = asyncio.run(run_all(url, args))
    print_table(rows)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        record = {
            "machine": platform.processor() or platform.machine(),
            "settings": {k: v for k, v in vars(args).items() if k not in ("func", "api_key")},
            "rows": [asdict(r) for r in rows],
        }
        Path(args.output).write_text(json.dumps(record, indent=2))
    return 0
