"""What abusive requests cost everyone else: a server's answer to each, the latency of small
requests sent while it is being refused, its resident memory afterwards, a burst past its
queue, and the per-token cost of stop strings.

Each tree runs as ``etinfer serve`` in its own process with the same flags; ``--baseline-tree``
adds another checkout (say, the commit before the request limits) to the same run, so the two
are compared side by side on the same machine and load.

    etinfer bench abuse --baseline-tree /work/base

The run's result holds each tree's figures (labelled ``arm``: ``this tree`` or ``baseline``), and
its ``details`` the trees' rows.

It needs the test extra's clients (httpx2, psutil), imported when it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

from etinfer import options
from etinfer.bench.common.local_server import LocalServer, local_server
from etinfer.bench.common.results import Figure, add_result_option, recorded

MiB = 2**20
STOP_COUNTS = (0, 1, 16, 1_000, 100_000)
# Per-token cost of a request's stop strings, none of which matches: run in the tree measured.
STOP_COST = f"""
import json, time
from etinfer.engine.detokenizer import Detokenizer
from etinfer.model.loader import load_model
from etinfer.sampling_params import SamplingParams
tokenizer = load_model().tokenizer
ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 100)
costs = {{}}
for n in {STOP_COUNTS}:
    params = SamplingParams(stop=[f"<never {{i}}>" for i in range(n)])
    detokenizer = Detokenizer(tokenizer, params, ids[:1])
    start = time.perf_counter()
    for token in ids[1:]:
        detokenizer.append(token)
    costs[n] = (time.perf_counter() - start) / (len(ids) - 1) * 1e6
print(json.dumps(costs))
"""


def cases(only: list[str] | None) -> dict[str, tuple[str, bytes]]:
    """Named abusive requests: (path, body). Bodies are built once, as a client would."""
    words = "word " * 130_000  # 650 KB: under the size bound of an 8K context, so tokenized
    huge_message = {"role": "user", "content": "x" * 50_000_000}
    stops = [f"<s{i}>" for i in range(100_000)]
    bodies = {
        "prompt 20 MB": ("/v1/completions", {"prompt": "word " * 4_000_000, "max_tokens": 1}),
        "chat 50 MB": ("/v1/chat/completions", {"messages": [huge_message]}),
        "prompt 3 MB": ("/v1/completions", {"prompt": "word " * 600_000, "max_tokens": 1}),
        "prompt 650 KB": ("/v1/completions", {"prompt": words, "max_tokens": 1}),
        "100k stop strings": ("/v1/completions", {"prompt": "Hi", "max_tokens": 8, "stop": stops}),
        "nested 100k deep": ("/v1/completions", None),
    }
    chosen = {name: bodies[name] for name in only or bodies}
    nested = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    return {
        name: (path, nested if body is None else json.dumps(body).encode())
        for name, (path, body) in chosen.items()
    }


@dataclass
class CaseResult:
    name: str
    status: int
    answer_s: float  # from sending the abusive request to its answer
    small_max_s: float  # the slowest small request sent meanwhile
    small_count: int
    rss_after_mib: float


@dataclass
class TreeResult:
    tree: str
    small_alone_s: float  # median latency of a one-token completion on an idle server
    rss_start_mib: float
    cases: list[CaseResult] = field(default_factory=list)
    burst: dict[str, float] = field(default_factory=dict)
    stop_us_per_token: dict[str, float] = field(default_factory=dict)  # by number of strings


def post(url: str, path: str, body: bytes) -> int:
    """The answer's status; 0 when the connection failed (a server that hangs up mid-body)."""
    import httpx2

    headers = {"Content-Type": "application/json"}
    try:
        return httpx2.post(f"{url}{path}", content=body, headers=headers, timeout=600).status_code
    except httpx2.TransportError:
        return 0


def rss_mib(server: LocalServer) -> float:
    import psutil

    return psutil.Process(server.process.pid).memory_info().rss / MiB


def small_request_s(url: str) -> float:
    start = time.perf_counter()
    status = post(url, "/v1/completions", b'{"prompt": "Hi", "max_tokens": 1}')
    if status != 200:
        raise RuntimeError(f"a small request failed with {status}")
    return time.perf_counter() - start


def run_case(server: LocalServer, name: str, path: str, body: bytes) -> CaseResult:
    answer: dict[str, float] = {}

    def abusive() -> None:
        start = time.perf_counter()
        answer["status"] = post(server.url, path, body)
        answer["s"] = time.perf_counter() - start

    sender = threading.Thread(target=abusive)
    sender.start()
    small = []
    while sender.is_alive() or not small:
        small.append(small_request_s(server.url))
    sender.join()
    status = int(answer["status"])
    return CaseResult(name, status, answer["s"], max(small), len(small), rss_mib(server))


def run_burst(url: str, count: int) -> dict[str, float]:
    """``count`` one-line completions at once, /health polled meanwhile."""
    import httpx2

    body = {"prompt": "Count:", "max_tokens": 16, "ignore_eos": True}

    async def run() -> tuple[list[int], list[float]]:
        async with httpx2.AsyncClient(timeout=600) as http:
            burst = asyncio.gather(
                *(http.post(f"{url}/v1/completions", json=body) for _ in range(count))
            )
            health = []
            while not burst.done():
                start = time.perf_counter()
                await http.get(f"{url}/health")
                health.append(time.perf_counter() - start)
                await asyncio.sleep(0.05)
            return [r.status_code for r in await burst], health

    start = time.perf_counter()
    statuses, health = asyncio.run(run())
    result = {f"status {s}": float(statuses.count(s)) for s in sorted(set(statuses))}
    return {**result, "seconds": time.perf_counter() - start, "health_max_s": max(health)}


def stop_cost(tree: str | None) -> dict[str, float]:
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = tree
    command = [sys.executable, "-c", STOP_COST]
    done = subprocess.run(command, env=env, cwd=tree, capture_output=True, check=True)
    return json.loads(done.stdout)


def run_tree(tree: str | None, args: argparse.Namespace) -> TreeResult:
    flags = ["--log-level", "warning", "--max-waiting-requests", str(args.max_waiting_requests)]
    flags += options.engine_flags(args)
    env = {"OMP_WAIT_POLICY": "PASSIVE"}  # the client shares the cores
    with local_server(flags, pythonpath=tree, env=env) as server:
        alone = statistics.median(small_request_s(server.url) for _ in range(5))
        result = TreeResult(tree or "this tree", alone, rss_mib(server))
        for name, (path, body) in cases(args.cases).items():
            print(f"  {name} ...", flush=True)
            result.cases.append(run_case(server, name, path, body))
        result.burst = run_burst(server.url, 3 * args.max_waiting_requests)
    result.stop_us_per_token = stop_cost(tree)
    return result


def print_tables(results: list[TreeResult]) -> None:
    print("| tree | request | status | answered in (s) | small request max (s) | RSS after (MiB) |")
    print("|---|---|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r.tree} | (small request alone) | 200 | {r.small_alone_s:.3f} | - | "
              f"{r.rss_start_mib:,.0f} |")  # fmt: skip
        for c in r.cases:
            print(f"| {r.tree} | {c.name} | {c.status} | {c.answer_s:.2f} | "
                  f"{c.small_max_s:.2f} ({c.small_count}) | {c.rss_after_mib:,.0f} |")  # fmt: skip
    print("\n| tree | burst |")
    print("|---|---|")
    for r in results:
        print(f"| {r.tree} | {', '.join(f'{k}: {v:g}' for k, v in r.burst.items())} |")
    print("\n| tree | " + " | ".join(f"{n:,} stop strings" for n in STOP_COUNTS) + " |")
    print("|---|" + "---:|" * len(STOP_COUNTS))
    for r in results:
        costs = " | ".join(f"{v:,.1f} µs" for v in r.stop_us_per_token.values())
        print(f"| {r.tree} (per token) | {costs} |")


def add_command(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("abuse", help="what abusive requests cost the other clients")
    parser.add_argument("--baseline-tree", help="another etinfer checkout to run beside this one")
    parser.add_argument("--cases", nargs="+", help="a subset of the named requests")
    parser.add_argument("--max-waiting-requests", type=int, default=16)
    options.add_engine_options(parser, exclude=("seed",))
    add_result_option(parser)
    parser.set_defaults(func=recorded("abuse", run))


def figures(result: TreeResult, arm: str) -> list[Figure]:
    """What the tables print of one tree: latencies in seconds (a small request's median alone,
    its slowest while a case is answered), memory, and the per-token cost of stop strings."""
    found = [
        Figure("small request", result.small_alone_s, "s", {"arm": arm, "request": "alone"}),
        Figure("resident memory", result.rss_start_mib, "MiB", {"arm": arm, "request": "start"}),
    ]
    for case in result.cases:
        labels = {"arm": arm, "request": case.name, "status": case.status}
        found += [
            Figure("answer time", case.answer_s, "s", labels),
            Figure("small request max", case.small_max_s, "s", labels, n=case.small_count),
            Figure("resident memory", case.rss_after_mib, "MiB", labels),
        ]
    burst = {"arm": arm, "request": "burst"}
    found += [
        Figure("burst time", result.burst["seconds"], "s", burst),
        Figure("health check max", result.burst["health_max_s"], "s", burst),
        *(
            Figure("stop string cost", us / 1000, "ms", {"arm": arm, "count": int(count)})
            for count, us in result.stop_us_per_token.items()
        ),
    ]
    return found


def run(args: argparse.Namespace) -> tuple[list[Figure], dict]:
    trees = [None] + ([args.baseline_tree] if args.baseline_tree else [])
    results = []
    for tree in trees:
        print(f"{tree or 'this tree'}:", flush=True)
        results.append(run_tree(tree, args))
    print_tables(results)
    arms = ["this tree", "baseline"]
    report = {"flags": options.engine_flags(args), "trees": [asdict(r) for r in results]}
    return [f for r, arm in zip(results, arms, strict=False) for f in figures(r, arm)], report
