"""Load through the HTTP server: TTFT, ITL, TPOT, end-to-end latency and throughput at a few
request rates, measured by a client as vLLM's serving benchmark does.

Requests arrive with gamma-distributed gaps (shape ``burstiness``; 1 is a Poisson process) at
each rate in turn. Each is a streamed chat completion with a fixed number of output tokens
(EOS ignored), so every rate asks for the same work; ``bench/common/driver.py`` sends them. TTFT
runs from the request's arrival (when it is sent) to the first chunk with text; ITL is the gap
between consecutive chunks with text; TPOT is (end-to-end - TTFT) / (output tokens - 1) per
request.

Without ``--url`` the benchmark starts ``etinfer serve`` in a subprocess on a free loopback
port, with this command's engine options, so the server and this client do not share an
interpreter (as in a real deployment; on a small machine they still share the cores).

    etinfer bench server --rates 1 4 --num-requests 48

The run's result holds, per rate, the throughputs, TTFT p50 and p99, TPOT, ITL and latency
(its ``details``: the settings and every rate's row).
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
from dataclasses import asdict, dataclass

from etinfer import options
from etinfer.bench.common.driver import Request, drive_server
from etinfer.bench.common.local_server import local_server
from etinfer.bench.common.prompts import instructions
from etinfer.bench.common.results import Figure, add_result_option, recorded
from etinfer.bench.common.stats import summary
from etinfer.options import positive_int
from etinfer.sampling_params import SamplingParams


@dataclass
class RateResult:
    rate: float
    num_requests: int
    completed: int
    duration_s: float
    request_throughput: float  # completed requests per second
    output_throughput: float  # generated tokens per second
    ttft_ms: dict[str, float | None]  # mean, median, p99 (None: no request measured)
    tpot_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    e2e_ms: dict[str, float | None]


def arrival_gaps(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Seconds between consecutive arrivals: gamma with mean 1 / rate."""
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


def chat_requests(prompts: list[str], arrivals: list[float], max_tokens: int) -> list[Request]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [Request(a, prompt, params) for prompt, a in zip(prompts, arrivals, strict=True)]


def run_rate(url: str, rate: float, args: argparse.Namespace, rng: random.Random) -> RateResult:
    gaps = arrival_gaps(args.num_requests, rate, args.burstiness, rng)
    requests = chat_requests(
        instructions(args.num_requests), list(itertools.accumulate(gaps)), args.max_tokens
    )
    records, duration = drive_server(url, requests, api_key=args.api_key)
    done = [r for r in records if r.ok]
    for r in records:
        if r.error:
            print(f"  failed: {r.error}", file=sys.stderr)
    return RateResult(
        rate=rate,
        num_requests=len(records),
        completed=len(done),
        duration_s=duration,
        request_throughput=len(done) / duration,
        output_throughput=sum(r.output_tokens for r in done) / duration,
        ttft_ms=summary([r.ttft for r in done if r.ttft is not None], 1000),
        tpot_ms=summary([r.tpot for r in done if r.tpot is not None], 1000),
        itl_ms=summary([gap for r in done for gap in r.itl or ()], 1000),
        e2e_ms=summary([r.e2e for r in done], 1000),
    )


def run_all(url: str, args: argparse.Namespace) -> list[RateResult]:
    rng = random.Random(args.seed)
    # One request first, so that first-call costs stay out of the figures.
    drive_server(url, chat_requests(["Warm up."], [0.0], 4), api_key=args.api_key)
    rows = []
    for rate in args.rates:
        print(f"rate {rate:g} req/s: {args.num_requests} requests ...", flush=True)
        rows.append(run_rate(url, rate, args, rng))
    return rows


def print_table(rows: list[RateResult]) -> None:
    print(
        "| rate (req/s) | done | req/s | out tok/s | TTFT mean / p50 / p99 (ms) | "
        "TPOT mean / p50 / p99 (ms) | ITL mean / p50 / p99 (ms) | E2E mean / p50 / p99 (ms) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")

    def cell(s: dict[str, float | None]) -> str:
        return " / ".join("-" if v is None else f"{v:,.0f}" for v in s.values())

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
    # For the server started here; --seed seeds the arrivals.
    options.add_engine_options(parser, exclude=("seed",))
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 4.0], help="req/s")
    parser.add_argument("--num-requests", type=positive_int, default=48, help="per rate")
    parser.add_argument(
        "--max-tokens", type=positive_int, default=64, help="output tokens per request"
    )
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1: Poisson")
    parser.add_argument("--seed", type=int, default=0)
    add_result_option(parser)
    parser.set_defaults(func=recorded("server", run))


def figures(row: RateResult) -> list[Figure]:
    labels = {"rate": row.rate}
    n = row.completed
    return [
        Figure("throughput", row.request_throughput, "req/s", labels, n=n),
        Figure("throughput", row.output_throughput, "tok/s", labels, n=n),
        *(
            Figure(subject, summary[key], "ms", labels, n=n)
            for subject, summary, key in (
                ("ttft p50", row.ttft_ms, "median"),
                ("ttft p99", row.ttft_ms, "p99"),
                ("tpot", row.tpot_ms, "mean"),
                ("itl p50", row.itl_ms, "median"),
            )
            if summary[key] is not None
        ),
        *(
            Figure(subject, row.e2e_ms[key] / 1000, "s", labels, n=n)
            for subject, key in (("latency", "mean"), ("latency p99", "p99"))
            if row.e2e_ms[key] is not None
        ),
    ]


def run(args: argparse.Namespace) -> tuple[list[Figure], dict]:
    if args.url:
        rows = run_all(args.url, args)
    else:
        flags = ["--log-level", "warning", *options.engine_flags(args)]
        with local_server(flags) as server:
            rows = run_all(server.url, args)
    print_table(rows)
    settings = {
        k: v for k, v in vars(args).items() if k not in ("func", "api_key", "engine_options")
    }
    report = {"settings": settings, "rows": [asdict(r) for r in rows]}
    return [f for row in rows for f in figures(row)], report
