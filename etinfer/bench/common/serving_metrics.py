"""The figures of a serving run, as vLLM's serving benchmark reports them (latencies in seconds),
their table, and the figures a result carries of them."""

from __future__ import annotations

import statistics

import numpy as np

from etinfer.bench.common.driver import RequestRecord
from etinfer.bench.common.results import Figure, Label
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


# The metrics a result carries: (metric, subject, unit, multiplier from seconds or counts, and
# whether a ratio to the reference arm is its own figure: one throughput ratio, not two).
RESULT_FIGURES = (
    ("request_throughput", "throughput", "req/s", 1, True),
    ("output_throughput", "throughput", "tok/s", 1, False),
    ("ttft_p50", "ttft p50", "ms", 1000, True),
    ("ttft_p99", "ttft p99", "ms", 1000, True),
    ("tpot_mean", "tpot", "ms", 1000, True),
    ("e2e_mean", "latency", "s", 1, True),
    ("e2e_p99", "latency p99", "s", 1, True),
    ("queue_mean", "queue time", "s", 1, True),
    ("preemptions", "preemptions", "count", 1, False),
)


def result_figures(
    arms: dict[str, list[dict]],
    reference: str | None = None,
    labels: dict[str, Label] | None = None,
) -> list[Figure]:
    """The figures a result carries of serving runs: per arm (its label ``arm``), each metric's
    mean over the arm's runs (summaries of ``summarize``), with its sd where there are several;
    for every other arm, its mean over ``reference``'s, each ratio its own figure."""
    found = []
    for name, runs in arms.items():
        arm = (labels or {}) | {"arm": name}
        against = None if reference is None or name == reference else arms[reference]
        for metric, subject, unit, scale, compared in RESULT_FIGURES:
            values = [r[metric] for r in runs if r.get(metric) is not None]
            if not values:
                continue
            value = statistics.fmean(values)
            spread = {"sd": scale * statistics.stdev(values)} if len(values) > 1 else None
            found.append(Figure(subject, scale * value, unit, dict(arm), spread, len(values)))
            base = [r[metric] for r in against or () if r.get(metric) is not None]
            if compared and base and statistics.fmean(base):
                ratio = value / statistics.fmean(base)
                found.append(Figure(subject, ratio, "x", arm | {"vs": reference}, n=len(values)))
    return found


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
