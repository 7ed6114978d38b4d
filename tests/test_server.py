"""The OpenAI-compatible server, end to end: a real uvicorn server on a free loopback port,
the real default model, and the official ``openai`` client (sync and async)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable

import httpx2
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from etinfer.config import ControlConfig, EngineConfig
from etinfer.control.scheduling import SchedulingConfig
from etinfer.engine.llm_engine import LLMEngine
from etinfer.model.loader import LoadedModel
from etinfer.server import create_app
from etinfer.server.protocol import SamplingExtensions
from etinfer.server.serving import FIELDS

API_KEY = "test-key"
MAX_MODEL_LEN = 512
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GREEDY_PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
# Generous bounds for waiting on a state change, on a shared 2-core machine: they only stop a
# broken test from hanging, no assertion depends on them.
SETTLE_S = 120.0


class ServerThread:
    """A real uvicorn server on a free loopback port, run in a thread of this process."""

    def __init__(self, app) -> None:
        self.app = app
        # Bound here and handed to uvicorn, so no other process can take the port in between.
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True
        )

    def __enter__(self) -> ServerThread:
        self.thread.start()
        wait_for(lambda: self.server.started, "the server to start")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.socket.close()

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, summed over labels."""
        values: dict[str, float] = {}
        text = httpx2.get(f"{self.url}/metrics").text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
        return values

    def wait_idle(self) -> dict[str, float]:
        """Wait until nothing runs, waits or holds a KV block; return the metrics then."""
        result = {}

        def idle() -> bool:
            result.update(self.metrics())
            return (
                result["etinfer:num_requests_running"] == 0
                and result["etinfer:num_requests_waiting"] == 0
                and result["etinfer:kv_cache_usage_perc"] == 0
            )

        wait_for(idle, "the server to go idle")
        return result


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + SETTLE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def make_engine(loaded: LoadedModel, **kwargs) -> LLMEngine:
    kwargs = {"max_model_len": MAX_MODEL_LEN, "num_kvcache_blocks": 1024, **kwargs}
    return LLMEngine(EngineConfig(model=str(loaded.path), **kwargs), loaded)


def assert_engine_drained(engine: LLMEngine) -> None:
    """Only call while the server is idle: the engine thread is then blocked, waiting."""
    assert not engine.has_unfinished_requests()
    assert engine.kv.pool.num_free_blocks == engine.num_blocks
    assert all(count == 0 for count in engine.kv.pool.ref_counts)


@pytest.fixture(scope="module")
def engine(loaded_model: LoadedModel) -> LLMEngine:
    return make_engine(loaded_model)


@pytest.fixture(scope="module")
def server(engine: LLMEngine):
    with ServerThread(create_app(engine, api_key=API_KEY)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    # No retries: a retried 5xx would hide exactly what these tests look for.
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def post(server: ServerThread, path: str, body: dict | bytes, **kwargs) -> httpx2.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**AUTH, "Content-Type": "application/json"}
    return httpx2.post(f"{server.url}{path}", content=content, headers=headers, **kwargs)


# -- the API -----------------------------------------------------------------------------------


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct.Q4_1"]
    assert models[0].owned_by == "etinfer"
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_every_sampling_field_is_a_request_field() -> None:
    openai_named = {"temperature", "top_p", "seed", "max_tokens", "stop", "logprobs"}
    assert set(FIELDS) - openai_named == set(SamplingExtensions.model_fields)


def test_chat_applies_the_chat_template(
    client: openai.OpenAI, model_name: str, loaded_model: LoadedModel
) -> None:
    chat = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=12, temperature=0
    )
    # The same conversation rendered by the tokenizer's template, sent as token ids.
    ids = loaded_model.tokenizer.encode_chat(MESSAGES)
    plain = client.completions.create(model=model_name, prompt=ids, max_tokens=12, temperature=0)
    choice = chat.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == plain.choices[0].text
    assert choice.message.content.strip()
    assert chat.usage.prompt_tokens == len(ids)
    assert chat.usage.completion_tokens == len(choice.model_extra["etinfer"]["entropies"])
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")


def test_streaming_text_equals_non_streaming_for_greedy(
    client: openai.OpenAI, model_name: str
) -> None:
    common = {"model": model_name, "max_tokens": 16, "temperature": 0}
    whole = client.chat.completions.create(messages=MESSAGES, **common)
    stream = client.chat.completions.create(
        messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **common
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    entropies = [
        h
        for c in chunks
        if c.choices
        for h in c.choices[0].model_extra.get("etinfer", {}).get("entropies", [])
    ]
    assert text == whole.choices[0].message.content
    assert entropies == pytest.approx(whole.choices[0].model_extra["etinfer"]["entropies"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == (
        whole.choices[0].finish_reason
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens

    whole = client.completions.create(prompt=GREEDY_PROMPT, **common)
    pieces = [
        c.choices[0].text
        for c in client.completions.create(prompt=GREEDY_PROMPT, stream=True, **common)
    ]
    assert "".join(pieces) == whole.choices[0].text
    assert len(pieces) > 1  # it did stream


def test_n_choices_and_seed(client: openai.OpenAI, model_name: str) -> None:
    def sample() -> openai.types.Completion:
        return client.completions.create(
            model=model_name,
            prompt=["Once upon a time", "My favourite food is"],
            n=3,
            max_tokens=6,
            temperature=1.0,
            seed=7,
        )

    first, again = sample(), sample()
    assert [c.index for c in first.choices] == list(range(6))
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices[:3]}) > 1  # each choice draws its own tokens
    counts = [len(c.model_extra["etinfer"]["entropies"]) for c in first.choices]
    assert first.usage.completion_tokens == sum(counts)


def test_chat_logprobs_shapes(client: openai.OpenAI, model_name: str) -> None:
    response = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert entry.logprob <= 0


def test_completion_logprobs_shapes(client: openai.OpenAI, model_name: str) -> None:
    common = {"model": model_name, "prompt": GREEDY_PROMPT, "max_tokens": 8, "temperature": 0}
    whole = client.completions.create(logprobs=2, **common)
    logprobs = whole.choices[0].logprobs
    n = whole.usage.completion_tokens
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == n
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == n
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    streamed = [
        c.choices[0].logprobs for c in client.completions.create(logprobs=2, stream=True, **common)
    ]
    assert [t for lp in streamed for t in lp.tokens] == logprobs.tokens
    assert [v for lp in streamed for v in lp.token_logprobs] == pytest.approx(
        logprobs.token_logprobs
    )
    no_logprobs = client.completions.create(**common)
    assert no_logprobs.choices[0].logprobs is None


def test_stop_string_ends_the_text(client: openai.OpenAI, model_name: str) -> None:
    response = client.completions.create(
        model=model_name, prompt=GREEDY_PROMPT, max_tokens=16, temperature=0, stop=["."]
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert "." not in choice.text and choice.text.strip()


def test_entropy_control_through_extra_body(client: openai.OpenAI, model_name: str) -> None:
    target = 1.5
    response = client.completions.create(
        model=model_name,
        prompt="Write a story about a dragon.",
        max_tokens=16,
        seed=3,
        extra_body={"entropy_target": target, "entropy_control": "exact", "ignore_eos": True},
    )
    telemetry = response.choices[0].model_extra["etinfer"]
    assert len(telemetry["entropies"]) == len(telemetry["temperatures"]) == 16
    assert telemetry["entropic_time"] >= 0
    assert "blocks_kept" not in telemetry  # pruning is off on this server
    # The exact law solves H(softmax(z / T)) = target wherever T stays inside its bounds.
    inside = [
        h
        for h, t in zip(telemetry["tempered_entropies"], telemetry["temperatures"], strict=True)
        if 0.1 + 1e-3 < t < 1.5 - 1e-3
    ]
    assert inside
    assert all(h == pytest.approx(target, abs=0.05) for h in inside)


# -- errors ------------------------------------------------------------------------------------


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MALFORMED = [
    # (path, body, expected param)
    (COMPLETIONS, {"prompt": "a", "temperature": -0.5}, "temperature"),
    (COMPLETIONS, {"prompt": "a", "top_p": 1.5}, "top_p"),
    (COMPLETIONS, {"prompt": "a", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    (CHAT, {"messages": MESSAGES, "max_tokens": 10**9}, "max_tokens"),
    (CHAT, {"messages": MESSAGES, "max_completion_tokens": MAX_MODEL_LEN}, "max_completion_tokens"),
    (COMPLETIONS, {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    (COMPLETIONS, {"prompt": "a", "model": "gpt-4o"}, "model"),
    (COMPLETIONS, {"prompt": "a", "temperature": "hot"}, "temperature"),
    (COMPLETIONS, {"prompt": "a", "max_tokens": 2.5}, "max_tokens"),
    (COMPLETIONS, {"prompt": "a", "stream": "yes"}, "stream"),
    (COMPLETIONS, {"prompt": 5}, "prompt"),
    (COMPLETIONS, {"prompt": [1, 10**6]}, "prompt"),
    (COMPLETIONS, {"prompt": ""}, "prompt"),
    (COMPLETIONS, {}, "prompt"),
    (COMPLETIONS, {"prompt": "a", "n": 0}, "n"),
    (COMPLETIONS, {"prompt": "a", "logprobs": 21}, "logprobs"),
    (COMPLETIONS, {"prompt": "a", "seed": -1}, "seed"),
    (COMPLETIONS, {"prompt": "a", "stop": ""}, "stop"),
    (COMPLETIONS, {"prompt": "a", "best_of": 2}, "best_of"),
    (COMPLETIONS, {"prompt": "a", "frequency_penalty": 0.5}, "frequency_penalty"),
    (COMPLETIONS, {"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    (COMPLETIONS, {"prompt": "a", "entropy_target": 2.0, "temperature": 0}, "entropy_target"),
    (COMPLETIONS, {"prompt": "a", "entropy_control": "magic"}, "entropy_control"),
    (COMPLETIONS, {"prompt": "a", "temperature_min": 0}, "temperature_min"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": "hello"}, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
        "messages[0].content[0].type",
    ),
    (CHAT, {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 25}, "top_logprobs"),
    (COMPLETIONS, {"prompt": "a", "priority": 1.5}, "priority"),
    (COMPLETIONS, {"prompt": "a", "priority": "high"}, "priority"),
    (COMPLETIONS, {"prompt": "a", "priority": 2**31}, "priority"),
    (CHAT, {"messages": MESSAGES, "priority": -(2**31) - 1}, "priority"),
    (COMPLETIONS, {"prompt": "a", "slo": 0}, "slo"),
    (CHAT, {"messages": MESSAGES, "slo": -2.5}, "slo"),
    (COMPLETIONS, {"prompt": "a", "slo": "soon"}, "slo"),
    (COMPLETIONS, {"prompt": "a", "slo": float("inf")}, "slo"),  # sent as Infinity
]


@pytest.mark.parametrize(("path", "body", "param"), MALFORMED)
def test_invalid_requests_are_400_naming_the_field(
    server: ServerThread, path: str, body: dict, param: str
) -> None:
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]


@pytest.mark.parametrize("body", [b'{"prompt": "a",', b"not json", b"", b"[1, 2]", b"\xff\xfe"])
def test_malformed_bodies_are_400(server: ServerThread, body: bytes) -> None:
    response = post(server, COMPLETIONS, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"priority": 2**31}, "Input should be less than or equal to 2147483647"),
        ({"priority": -(2**31) - 1}, "Input should be greater than or equal to -2147483648"),
        ({"slo": 0.0}, "Input should be greater than 0"),
    ],
)
def test_scheduling_fields_out_of_range_name_the_field_and_the_limit(
    client: openai.OpenAI, model_name: str, body: dict, message: str
) -> None:
    (name,) = body
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model_name, prompt="a", max_tokens=1, extra_body=body)
    assert caught.value.status_code == 400 and caught.value.param == name
    assert caught.value.body["message"] == f"Invalid value for '{name}': {message}"


def test_openai_client_surfaces_errors(client: openai.OpenAI, model_name: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model_name, messages=MESSAGES, temperature=-1)
    assert caught.value.status_code == 400 and caught.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="no-such-model", prompt="a")
    assert caught.value.code == "model_not_found"


def test_api_key(server: ServerThread, model_name: str) -> None:
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.completions.create(model=model_name, prompt="a", max_tokens=1)
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    # Without a key, even a malformed body is refused for the key first.
    response = httpx2.post(f"{server.url}{COMPLETIONS}", content=b"{")
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    # Health and metrics stay open, for probes and scrapers.
    assert httpx2.get(f"{server.url}/health").status_code == 200
    assert httpx2.get(f"{server.url}/metrics").status_code == 200


def test_unknown_route_is_404_in_openai_shape(server: ServerThread) -> None:
    response = httpx2.get(f"{server.url}/v1/engines", headers=AUTH)
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "Not Found"


def test_accepted_streams_keep_streaming_through_errors(
    client: openai.OpenAI, server: ServerThread, model_name: str
) -> None:
    common = {"model": model_name, "prompt": GREEDY_PROMPT, "max_tokens": 24, "temperature": 0}
    expected = client.completions.create(**common).choices[0].text
    stream = client.completions.create(stream=True, **common)
    pieces = [next(stream).choices[0].text]
    for path, body, _ in MALFORMED[:8]:
        assert post(server, path, body).status_code == 400
    assert post(server, COMPLETIONS, b"{{{").status_code == 400
    pieces += [chunk.choices[0].text for chunk in stream]
    assert "".join(pieces) == expected


# -- scheduling fields --------------------------------------------------------------------------


def test_priority_and_slo_reach_the_scheduler(loaded_model: LoadedModel) -> None:
    """One sequence slot and the entropy policy with aging out of reach, so `priority` alone
    orders the queue. While a long request holds the slot, an ordinary request and then a more
    urgent one (priority -1, as vLLM's extra parameter) queue up; the urgent one, though it
    arrived later, is admitted first. Every choice of a request carries its fields."""
    control = ControlConfig(scheduling=SchedulingConfig(aging_steps=1e6, aging_backlog=0.0))
    engine = make_engine(loaded_model, max_num_seqs=1, control=control)
    seen: dict[str, tuple[int, float | None]] = {}
    add_request = engine.add_request

    def spy(*args, **kwargs) -> str:
        seen[kwargs["request_id"]] = (kwargs["priority"], kwargs["slo"])
        return add_request(*args, **kwargs)

    engine.add_request = spy
    finished: list[str] = []

    def send(name: str, max_tokens: int, extra: dict, n: int) -> None:
        common = {"max_tokens": max_tokens, "extra_body": {"ignore_eos": True, **extra}}
        if name == "ordinary":
            reply = client.chat.completions.create(model=model, messages=MESSAGES, **common)
        else:
            reply = client.completions.create(model=model, prompt=name, n=n, **common)
        finished.append(name)
        ids[name] = reply.id

    with ServerThread(create_app(engine)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        ids: dict[str, str] = {}
        queued = [  # a chat request, and completions (two choices for the urgent one)
            ("blocker", 300, {}, 1, ("etinfer:num_requests_running", 1)),
            ("ordinary", 2, {}, 1, ("etinfer:num_requests_waiting", 1)),
            ("urgent", 2, {"priority": -1, "slo": 2.5}, 2, ("etinfer:num_requests_waiting", 3)),
        ]
        threads = []
        for name, max_tokens, extra, n, (gauge, count) in queued:
            threads.append(threading.Thread(target=send, args=(name, max_tokens, extra, n)))
            threads[-1].start()
            wait_for(lambda g=gauge, c=count: server.metrics()[g] == c, f"{name} to queue")
        for thread in threads:
            thread.join(timeout=SETTLE_S)
    assert finished == ["blocker", "urgent", "ordinary"]
    fields = {name: {seen[k] for k in seen if k.startswith(ids[name])} for name in ids}
    assert fields == {"blocker": {(0, None)}, "ordinary": {(0, None)}, "urgent": {(-1, 2.5)}}


# -- concurrency, disconnects, metrics ---------------------------------------------------------


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
