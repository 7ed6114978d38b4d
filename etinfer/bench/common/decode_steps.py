"""Decode steps over long contexts, measured alone: every sequence decoding, none prefilling."""

from __future__ import annotations

import statistics

from etinfer.bench.common.prompts import TOPICS
from etinfer.engine.observer import StepRecord
from etinfer.llm import LLM
from etinfer.sampling_params import SamplingParams


def context_prompts(llm: LLM, batch: int, context: int) -> list[list[int]]:
    """``batch`` distinct token sequences of exactly ``context`` tokens of real text."""
    text = " ".join(f"Chapter {i}. This is an essay about {t}." for i, t in enumerate(TOPICS * 40))
    ids = llm.tokenizer.encode(text)
    while len(ids) < context + batch * 97:
        ids = ids + ids
    return [ids[i * 97 : i * 97 + context] for i in range(batch)]


def decode_budget(batch: int, context: int, steps: int, chunk: int) -> int:
    """Tokens each request may generate: enough to outlast everyone's chunked prefill."""
    return -(-batch * context // chunk) + batch + steps + 2


def ours_decode_step_ms(llm: LLM, batch: int, context: int, steps: int) -> float:
    """Median wall time of ``steps`` steps in which all ``batch`` sequences decode."""
    engine = llm.engine
    budget = decode_budget(batch, context, steps, engine.config.max_num_batched_tokens)
    params = SamplingParams(temperature=0, max_tokens=budget, ignore_eos=True)
    request_ids = [engine.add_request(p, params) for p in context_prompts(llm, batch, context)]
    times = []

    def decode_step(step: StepRecord) -> None:
        if step.num_decode == batch and not step.prefill_tokens:
            times.append(step.wall_time)

    with engine.observing(decode_step):
        while len(times) < steps:
            engine.step()
    for request_id in request_ids:
        engine.abort_request(request_id)
    return statistics.median(times) * 1000
