"""Serving workloads: when requests arrive and how long their prompts and outputs are.

Arrivals follow vLLM's serving benchmark: gaps drawn from a gamma distribution with shape
``burstiness`` (1 is a Poisson process) and mean ``1 / rate``. Lengths come from quantile
functions:

- ``sharegpt``: interpolated log-linearly between the ShareGPT first-turn quantiles
  (prompts p50 33, p90 345, p99 906 tokens; outputs p50 292, p90 630, p99 945; ANCHORS.md), so
  a large sample reproduces those quantiles. The ends (4 and 1,024 prompt tokens, 8 and 1,024
  output tokens) are our choice: vLLM's ShareGPT loader drops longer conversations.
- ``long``: prompts log-uniform in [1,024, 6,144] tokens, ShareGPT outputs.
- ``mixed``: ShareGPT, with one request in five drawn from ``long``.

A trace is a CSV file with the columns ``arrival_s, prompt_tokens, output_tokens``. Prompts are
real text: windows of the Python Language Reference that CPython ships (``pydoc_data.topics``,
the corpus ``etinfer calibrate`` uses), cut at seeded offsets to the drawn length.
"""

from __future__ import annotations

import argparse
import csv
import math
from dataclasses import astuple, dataclass
from pathlib import Path

import numpy as np

from etinfer.bench.common.driver import Request
from etinfer.corpus import CORPUS, corpus_text
from etinfer.model.tokenizer import Tokenizer
from etinfer.options import positive_int
from etinfer.sampling_params import SamplingParams
from etinfer.validation import check_float, check_int

Knots = tuple[tuple[float, float], ...]  # (cumulative probability, tokens), both increasing

SHAREGPT_PROMPT: Knots = ((0.0, 4), (0.5, 33), (0.9, 345), (0.99, 906), (1.0, 1024))
SHAREGPT_OUTPUT: Knots = ((0.0, 8), (0.5, 292), (0.9, 630), (0.99, 945), (1.0, 1024))
LONG_PROMPT: Knots = ((0.0, 1024), (1.0, 6144))
LONG_SHARE = 0.2  # of the mixed workload
WORKLOADS = ("sharegpt", "long", "mixed")
TRACE_COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens")


@dataclass(frozen=True)
class WorkloadRequest:
    arrival_s: float  # seconds after the start of the run
    prompt_tokens: int
    output_tokens: int


def quantile(knots: Knots, u: np.ndarray) -> np.ndarray:
    """The inverse CDF through ``knots``, log-linear between them, at probabilities ``u``."""
    probs, tokens = zip(*knots, strict=True)
    return np.exp(np.interp(u, probs, np.log(tokens)))


def arrival_times(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Seconds after the start; the first request arrives at 0. An infinite rate sends all at
    once."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.gamma(burstiness, 1 / (rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def generate(
    kind: str,
    num_requests: int,
    rate: float,
    seed: int,
    *,
    burstiness: float = 1.0,
    length_scale: float = 1.0,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
) -> list[WorkloadRequest]:
    """``num_requests`` requests of workload ``kind``. Lengths are multiplied by
    ``length_scale`` (which keeps the shape of the distribution, unlike a cap) and then capped."""
    if kind not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {kind!r}")
    check_int("num_requests", num_requests, low=1)
    if rate != math.inf:  # an infinite rate sends every request at once
        check_float("request_rate", rate, low=0, low_open=True)
    check_float("burstiness", burstiness, low=0, low_open=True)
    check_float("length_scale", length_scale, low=0, low_open=True)
    for name, cap in (
        ("max_prompt_tokens", max_prompt_tokens),
        ("max_output_tokens", max_output_tokens),
    ):
        if cap is not None:
            check_int(name, cap, low=1)
    rng = np.random.default_rng(seed)
    arrivals = arrival_times(num_requests, rate, burstiness, rng)
    prompt_u, output_u, kind_u = rng.random((3, num_requests))
    prompts = quantile(SHAREGPT_PROMPT, prompt_u)
    long = quantile(LONG_PROMPT, prompt_u)
    if kind == "long":
        prompts = long
    elif kind == "mixed":
        prompts = np.where(kind_u < LONG_SHARE, long, prompts)
    outputs = quantile(SHAREGPT_OUTPUT, output_u)
    prompts = _scale(prompts, length_scale, max_prompt_tokens)
    outputs = _scale(outputs, length_scale, max_output_tokens)
    return [
        WorkloadRequest(float(a), int(p), int(o))
        for a, p, o in zip(arrivals, prompts, outputs, strict=True)
    ]


def _scale(tokens: np.ndarray, scale: float, cap: int | None) -> np.ndarray:
    scaled = np.maximum(1, np.rint(tokens * scale))
    return scaled if cap is None else np.minimum(scaled, cap)


def read_trace(path: str | Path) -> list[WorkloadRequest]:
    """Requests from a CSV trace (header ``arrival_s,prompt_tokens,output_tokens``), sorted by
    arrival."""
    with Path(path).open(newline="") as file:
        reader = csv.DictReader(file)
        missing = set(TRACE_COLUMNS) - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: trace lacks the column(s) {', '.join(sorted(missing))}")
        requests = []
        for line, row in enumerate(reader, start=2):
            try:
                request = WorkloadRequest(
                    float(row["arrival_s"]), int(row["prompt_tokens"]), int(row["output_tokens"])
                )
            except ValueError as e:
                raise ValueError(f"{path}, line {line}: {e}") from e
            if request.arrival_s < 0 or request.prompt_tokens < 1 or request.output_tokens < 1:
                raise ValueError(
                    f"{path}, line {line}: need arrival_s >= 0 and at least one prompt and one "
                    f"output token, got {row}"
                )
            requests.append(request)
    return sorted(requests, key=lambda r: r.arrival_s)


def write_trace(path: str | Path, requests: list[WorkloadRequest]) -> None:
    with Path(path).open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(TRACE_COLUMNS)
        writer.writerows(astuple(r) for r in requests)


class TextPrompts:
    """Prompts of exact token lengths cut from real text (CPython's Language Reference)."""

    SOURCE = CORPUS

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.ids = tokenizer.encode(corpus_text())

    def take(self, lengths: list[int], seed: int) -> list[list[int]]:
        """One window per length, at seeded random offsets (distinct prompts rarely share a
        prefix, so the prefix cache does not flatter either policy)."""
        rng = np.random.default_rng(seed)
        longest = max(lengths, default=0)
        if longest > len(self.ids):
            raise ValueError(f"the corpus holds {len(self.ids)} tokens, a prompt asks {longest}")
        starts = rng.integers(0, len(self.ids) - np.asarray(lengths) + 1)
        return [self.ids[s : s + n] for s, n in zip(starts.tolist(), lengths, strict=True)]


def driver_requests(requests: list[WorkloadRequest], prompts: list[list[int]]) -> list[Request]:
    """The workload as the driver sends it: each request decodes exactly its drawn length."""
    return [
        Request(
            r.arrival_s,
            prompt,
            SamplingParams(temperature=1.0, max_tokens=r.output_tokens, ignore_eos=True),
        )
        for r, prompt in zip(requests, prompts, strict=True)
    ]


def load_workload(args: argparse.Namespace) -> list[WorkloadRequest]:
    if args.trace:
        return read_trace(args.trace)
    return generate(
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
    parser.add_argument("--workload", choices=WORKLOADS, default="sharegpt")
    parser.add_argument("--trace", help="replay a CSV of arrival_s,prompt_tokens,output_tokens")
    parser.add_argument("--num-requests", type=positive_int, default=64)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1: Poisson")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--length-scale", type=float, default=1.0, help="multiplies lengths")
    parser.add_argument("--max-prompt-tokens", type=int)
    parser.add_argument("--max-output-tokens", type=int)
