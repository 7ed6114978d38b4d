"""Concurrent streams, dropped requests and the Prometheus metrics, on a real server."""

from __future__ import annotations

import asyncio
import json
import socket

import openai

from etinfer.engine.llm_engine import LLMEngine
from tests.server.conftest import (
    API_KEY,
    COMPLETIONS,
    ServerThread,
    assert_engine_drained,
    wait_for,
)


def test_32_concurrent_streams_complete(
    server: ServerThread, engine: LLMEngine, model_name: str
) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int, str | None]:
        common = {
            "model": model_name,
            "max_tokens": 8,
            "temperature": 0.8,
            "seed": i,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if i % 2:
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": f"Tell me about the number {i}."}], **common
            )
            chunks = [chunk async for chunk in stream]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            stream = await client.completions.create(prompt=f"Fact {i}:", **common)
            chunks = [chunk async for chunk in stream]
            text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        return text, chunks[-1].usage.completion_tokens, finish

    async def run() -> list:
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(run())
    assert len(results) == 32
    for _text, tokens, finish in results:
        assert finish in ("stop", "length")
        assert 1 <= tokens <= 8
    server.wait_idle()
    assert_engine_drained(engine)


def test_dropped_requests_are_aborted_and_freed(
    client: openai.OpenAI, server: ServerThread, engine: LLMEngine, model_name: str
) -> None:
    before = server.metrics()
    long = {"max_tokens": 400, "temperature": 0, "extra_body": {"ignore_eos": True}}
    stream = client.completions.create(model=model_name, prompt="Count:", stream=True, **long)
    next(stream), next(stream)
    stream.close()
    server.wait_idle()
    # A non-streaming request whose client goes away while it runs is aborted too.
    body = json.dumps({"prompt": "List:", "max_tokens": 400, "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(
            f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_for(
            lambda: (
                server.metrics()["etinfer:generation_tokens_total"]
                > before["etinfer:generation_tokens_total"] + 4
            ),
            "the request to generate",
        )
    after = server.wait_idle()
    assert_engine_drained(engine)
    # Neither ran to its end.
    finished = after["etinfer:request_success_total"] - before["etinfer:request_success_total"]
    assert finished == 0
    generated = after["etinfer:generation_tokens_total"] - before["etinfer:generation_tokens_total"]
    assert generated < 2 * 400


REQUIRED_METRICS = [
    "etinfer:time_to_first_token_seconds_count",
    "etinfer:inter_token_latency_seconds_count",
    "etinfer:e2e_request_latency_seconds_count",
    "etinfer:request_queue_time_seconds_count",
    "etinfer:num_requests_running",
    "etinfer:num_requests_waiting",
    "etinfer:kv_cache_usage_perc",
    "etinfer:prompt_tokens_total",
    "etinfer:generation_tokens_total",
    "etinfer:num_preemptions_total",
    "etinfer:prefix_cache_queries_total",
    "etinfer:prefix_cache_hits_total",
    "etinfer:token_entropy_nats_count",
    "etinfer:entropic_time_nats_total",
    "etinfer:blocks_kept_ratio_count",
]


def test_metrics_are_present_and_move(
    client: openai.OpenAI, server: ServerThread, model_name: str
) -> None:
    before = server.metrics()
    assert set(REQUIRED_METRICS) <= set(before)
    response = client.completions.create(
        model=model_name,
        prompt="A long and winding road",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    client.completions.create(  # the same prompt again: its full blocks come from the cache
        model=model_name, prompt="A long and winding road " * 8, max_tokens=1, temperature=0
    )
    client.completions.create(
        model=model_name, prompt="A long and winding road " * 8, max_tokens=1, temperature=0
    )
    after = server.wait_idle()

    def moved(name: str) -> float:
        return after[name] - before[name]

    assert moved("etinfer:generation_tokens_total") == 8 + 1 + 1
    assert moved("etinfer:token_entropy_nats_count") == 8 + 1 + 1
    assert moved("etinfer:inter_token_latency_seconds_count") == 7
    assert moved("etinfer:time_to_first_token_seconds_count") == 3
    assert moved("etinfer:e2e_request_latency_seconds_count") == 3
    assert moved("etinfer:request_queue_time_seconds_count") == 3
    assert moved("etinfer:prompt_tokens_total") >= response.usage.prompt_tokens
    assert moved("etinfer:prefix_cache_queries_total") >= response.usage.prompt_tokens
    assert moved("etinfer:prefix_cache_hits_total") >= 16
    assert moved("etinfer:entropic_time_nats_total") > 0
    assert moved("etinfer:time_to_first_token_seconds_sum") > 0
