"""One client must not stall the others: request limits against a real ``etinfer serve`` in its
own process (so its resident memory is its own), at the default model's full 8K context."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Iterator

import httpx2
import openai
import psutil
import pytest

from etinfer.bench.common.local_server import LocalServer, local_server
from etinfer.server.limits import default_max_request_bytes
from tests.server.conftest import HTTP, scrape_metrics

MAX_WAITING = 8
KV_BLOCKS = 1024  # 16K tokens: two sequences at the full context
DEFAULT_BODY_LIMIT = default_max_request_bytes(8192, 81)  # 5 MiB
# What the abuse below may leave resident, on top of where the server was (measured: it ends
# below where it started, since the freed memory goes back to the system).
RSS_BOUND = 64 * 2**20
# A small request's latency while others are refused, on top of its latency alone: generous
# for a shared 2-core machine; tokenizing the same prompts on the event loop stalled it ~10 s.
STALL_BOUND_S = 2.0


@pytest.fixture(scope="module")
def served() -> Iterator[LocalServer]:
    flags = ["--log-level", "warning", "--num-kvcache-blocks", str(KV_BLOCKS),
             "--max-num-seqs", "2", "--max-waiting-requests", str(MAX_WAITING)]  # fmt: skip
    with local_server(flags, env={"OMP_WAIT_POLICY": "PASSIVE"}) as server:
        yield server


@pytest.fixture(scope="module")
def client(served: LocalServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def small_request_s(url: str) -> float:
    start = time.perf_counter()
    response = HTTP.post(
        f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=120
    )
    assert response.status_code == 200, response.text
    return time.perf_counter() - start


def abusive_bodies() -> list[tuple[str, dict]]:
    words = "word " * 130_000  # 650 KB: under the size bound, so it is tokenized, then refused
    return [
        ("/v1/completions", {"prompt": "word " * 4_000_000}),  # 20 MB: 413
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 50_000_000}]}),
        ("/v1/completions", {"prompt": "word " * 600_000}),  # 3 MB: refused by its size
        ("/v1/completions", {"prompt": words}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": words}]}),
        ("/v1/completions", {"prompt": "日本語" * 70_000}),
        ("/v1/completions", {"prompt": [1] * 600_000}),
        ("/v1/completions", {"prompt": "Hi", "stop": [f"s{i}" for i in range(100_000)]}),
    ]


def send_all(url: str, bodies: list[tuple[str, dict]]) -> list[int]:
    async def run() -> list[int]:
        async with httpx2.AsyncClient(timeout=300) as http:
            sent = [http.post(f"{url}{path}", json=body) for path, body in bodies]
            return [r.status_code for r in await asyncio.gather(*sent)]

    return asyncio.run(run())


def test_an_oversized_body_is_refused_with_413_before_it_is_read(client, model, served):
    start = time.perf_counter()
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model=model, prompt="word " * 4_000_000, max_tokens=1)
    assert time.perf_counter() - start < 10
    error = caught.value
    assert error.status_code == 413 and error.code == "request_too_large"
    assert f"at most {DEFAULT_BODY_LIMIT} bytes" in error.message
    assert "--max-request-bytes" in error.message

    # Without a Content-Length (a chunked body), it is read up to the limit and no further.
    def chunks():
        yield b'{"prompt": "'
        for _ in range(80):
            yield b"word " * 20_000
        yield b'"}'

    response = HTTP.post(f"{served.url}/v1/completions", content=chunks(), timeout=60)
    assert response.status_code == 413, response.text


def test_prompts_over_the_context_do_not_stall_other_requests(served):
    alone = statistics.median(small_request_s(served.url) for _ in range(3))
    statuses: list[int] = []
    barrage = [body for body in abusive_bodies()[2:6] for _ in range(2)]
    sender = threading.Thread(target=lambda: statuses.extend(send_all(served.url, barrage)))
    sender.start()
    during = []
    while sender.is_alive() or not during:
        during.append(small_request_s(served.url))
        start = time.perf_counter()
        assert HTTP.get(f"{served.url}/health", timeout=60).status_code == 200
        during.append(time.perf_counter() - start)
    sender.join()
    assert statuses == [400] * len(barrage)
    assert max(during) < alone + STALL_BOUND_S, (alone, during)


def test_refusals_name_the_field_and_the_limit(client, model):
    too_many_ids = {"extra_body": {"stop_token_ids": [1] * 65}}
    cases = [
        ({"prompt": "Hi", "stop": ["s"] * 100_000}, "stop", "array_above_max_length", "16"),
        ({"prompt": "Hi", "stop": ["a", "b" * 300]}, "stop[1]", "string_above_max_length", "256"),
        ({"prompt": "Hi", "stop": "b" * 300}, "stop", "string_above_max_length", "256"),
        ({"prompt": "Hi", **too_many_ids}, "stop_token_ids", "array_above_max_length", "64"),
        ({"prompt": "word " * 600_000}, "prompt", "context_length_exceeded", "8192"),
        ({"prompt": "word " * 10_000}, "prompt", "context_length_exceeded", "10001 tokens"),
        ({"prompt": [1] * 9_000}, "prompt", "context_length_exceeded", "9000 tokens"),
        ({"prompt": ["Hi"] * 3, "n": 3}, "n", None, f"queues at most {MAX_WAITING}"),
    ]
    for body, param, code, limit in cases:
        body = {"max_tokens": 1, **body}
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=model, **body)
        assert caught.value.param == param, (body.keys(), caught.value.message)
        assert code is None or caught.value.code == code
        assert limit in caught.value.message
    messages = [{"role": "user", "content": "Hi"}] * 2049
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=messages)
    assert caught.value.param == "messages" and "2048" in caught.value.message


def test_n_times_max_tokens_must_fit_the_kv_pool(client, model):
    # Without max_tokens each choice may run to the end of the context: 4 x 512 blocks.
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "n": 4}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**chat)
    assert caught.value.param == "n" and f"the pool holds {KV_BLOCKS}" in caught.value.message
    answer = client.chat.completions.create(**chat, max_tokens=2)
    assert len(answer.choices) == 4


def test_a_burst_past_the_queue_gets_429_and_keeps_every_accepted_request(served):
    body = {"prompt": "Count:", "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    before = scrape_metrics(served.url)

    async def run() -> tuple[list[httpx2.Response], list[float]]:
        async with httpx2.AsyncClient(timeout=300) as http:
            burst = asyncio.gather(
                *(http.post(f"{served.url}/v1/completions", json=body) for _ in range(32))
            )
            health = []
            while not burst.done():
                for route in ("/health", "/metrics"):
                    start = time.perf_counter()
                    assert (await http.get(f"{served.url}{route}")).status_code == 200
                    health.append(time.perf_counter() - start)
                await asyncio.sleep(0.05)
            return await burst, health

    responses, health = asyncio.run(run())
    accepted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(accepted) + len(refused) == 32 and refused and accepted
    assert all(r.headers["retry-after"] == "1" for r in refused)
    assert all(r.json()["usage"]["completion_tokens"] == 24 for r in accepted)
    after = scrape_metrics(served.url)
    done = after["etinfer:request_success_total"] - before["etinfer:request_success_total"]
    assert done == len(accepted)
    assert max(health) < STALL_BOUND_S, health


def test_abusive_requests_leave_resident_memory_where_it_was(served):
    process = psutil.Process(served.process.pid)
    small_request_s(served.url)
    before = process.memory_info().rss
    for _ in range(3):
        assert set(send_all(served.url, abusive_bodies())) <= {400, 413}
    after = process.memory_info().rss
    assert after < before + RSS_BOUND, (before / 2**20, after / 2**20)
    small_request_s(served.url)
