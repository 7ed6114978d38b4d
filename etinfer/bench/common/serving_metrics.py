"""The figures of a serving run, as vLLM's serving benchmark reports them (latencies in seconds),
and their table."""

from __future__ import annotations

import numpy as np

from etinfer.bench.common.driver import RequestRecord
from etinfer.bench.common.stats import mean, percentile

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
    tpot = [r.tpot for r in done if r.tpot is not None]
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
        "ttft_mean": mean(ttft),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "tpot_mean": mean(tpot),
        "tpot_p99": percentile(tpot, 99),
        "e2e_mean": mean(e2e),
        "e2e_p50": percentile(e2e, 50),
        "e2e_p99": percentile(e2e, 99),
        "queue_mean": mean(queue),
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
