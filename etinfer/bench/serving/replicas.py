"""``etinfer bench serving --replicas 1 2``: one trace against one replica holding every core,
then against N replicas sharing them, Serve's power-of-two-choices router against ours, in one
run (each arm a fresh ``etinfer serve --replicas N`` on the loopback address).

With ``--shared-prefix-tokens P`` every prompt opens with one of ``--num-prefixes`` texts of P
tokens (a few system prompts or documents that many requests share), which is where prefix
affinity can pay: a replica that has computed an opening serves it from its prefix cache.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from etinfer import options
from etinfer.bench.common.driver import drive_server
from etinfer.bench.common.local_server import local_server
from etinfer.bench.common.results import Figure
from etinfer.bench.common.serving_metrics import format_table, result_figures, summarize
from etinfer.bench.common.workload import TextPrompts, driver_requests, load_workload


def arms(replica_counts: list[int], cores: int) -> list[tuple[str, list[str]]]:
    """(label, serve flags) of each arm: one replica once, each larger count under both
    routers."""
    out = []
    for count in replica_counts:
        threads = max(1, cores // count)
        routers = ["backlog"] if count == 1 else ["pow2", "backlog"]
        for router in routers:
            label = f"{count} x {threads} thread{'s' * (threads > 1)}"
            if count > 1:
                label += f", {router}"
            flags = ["--replicas", str(count), "--num-threads", str(threads), "--router", router]
            out.append((label, flags))
    return out


def prompts_of(args: argparse.Namespace, lengths: list[int]) -> list[list[int]]:
    from etinfer.model.loader import load_model

    text = TextPrompts(load_model(args.model).tokenizer)
    prompts = text.take(lengths, args.seed)
    if not args.shared_prefix_tokens:
        return prompts
    openings = text.take([args.shared_prefix_tokens] * args.num_prefixes, args.seed + 1)
    return [openings[i % args.num_prefixes] + p for i, p in enumerate(prompts)]


def replica_shares(url: str) -> dict[str, float]:
    """Requests each engine replica finished, from the deployment's /metrics."""
    import httpx2
    from prometheus_client.parser import text_string_to_metric_families

    shares: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx2.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == "etinfer:request_success_total":
                replica = sample.labels["replica"]
                shares[replica] = shares.get(replica, 0.0) + sample.value
    return shares


def run(args: argparse.Namespace) -> tuple[list[Figure], dict]:
    """Every arm on one trace: the figures of each, with ratios to the first arm's (one
    replica, as ``--replicas 1 2`` asks), and the report (to ``--output`` too, if given)."""
    requests = load_workload(args)
    prompts = prompts_of(args, [r.prompt_tokens for r in requests])
    sent = driver_requests(requests, prompts)
    cores = os.cpu_count() or 1
    results = {}
    for label, flags in arms(args.replicas, cores):
        print(f"{label}: starting", flush=True)
        env = {"OMP_WAIT_POLICY": "PASSIVE"}
        with local_server([*flags, *options.engine_flags(args)], env=env) as server:
            drive_server(server.url, sent[:2])  # warm-up: the first steps of each replica
            records, duration = drive_server(server.url, sent)
            results[label] = {
                **summarize(records, duration),
                "requests_per_replica": sorted(replica_shares(server.url).values()),
            }
        print(format_table({label: results[label]}), flush=True)
    print(format_table(results))
    report = {"cores": cores, "prompts": TextPrompts.SOURCE, "arms": results}
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2))
    runs = {label: [summary] for label, summary in results.items()}
    return result_figures(runs, reference=next(iter(results))), report
