"""The server under abuse: a fuzzed request schema, a soak with random disconnects, a full
waiting queue, and the pruning telemetry of a second server. Real model, real server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random

import hypothesis
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from etinfer.control.block_selection import PruningConfig
from etinfer.control.config import ControlConfig
from etinfer.engine.llm_engine import LLMEngine
from etinfer.model.loader import LoadedModel
from etinfer.server import create_app
from tests.server.conftest import (
    API_KEY,
    AUTH,
    HTTP,
    MAX_MODEL_LEN,
    ServerThread,
    assert_engine_drained,
    make_engine,
    wait_for,
)

MODEL = "SmolLM2-135M-Instruct.Q4_1"


def assert_healthy(server: ServerThread, engine: LLMEngine) -> None:
    """The loop is alive, answers a real request, and holds nothing afterwards."""
    assert HTTP.get(f"{server.url}/health").status_code == 200
    response = HTTP.post(
        f"{server.url}/v1/completions",
        json={"prompt": "Hello", "max_tokens": 2},
        headers=AUTH,
        timeout=120,
    )
    assert response.status_code == 200, response.text
    server.wait_idle()
    assert server.app.state.loop.num_in_flight == 0
    assert_engine_drained(engine)


# -- fuzzing the request schema ----------------------------------------------------------------

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),  # NaN and infinities included: Python's JSON writes and reads them
    st.text(max_size=6),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def field(valid: st.SearchStrategy, invalid: st.SearchStrategy | None = None) -> tuple:
    """A field's valid values, and what a confused or hostile client sends instead."""
    return valid, junk if invalid is None else st.one_of(invalid, junk)


def floats(low: float, high: float) -> st.SearchStrategy:
    return st.floats(low, high, allow_nan=False)


# Valid values are kept small (a few tokens, a choice or two) so that the requests the server
# accepts finish quickly.
FIELDS = {
    "model": field(st.just(MODEL), st.text(max_size=8)),
    "max_tokens": field(
        st.integers(1, 3), st.one_of(st.integers(max_value=0), st.integers(MAX_MODEL_LEN, 2**64))
    ),
    "temperature": field(floats(0, 2), floats(-5, -1e-6)),
    "top_p": field(floats(0.01, 1), st.one_of(floats(1.001, 5), floats(-1, 0))),
    "top_k": field(st.integers(0, 50), st.integers(max_value=-1)),
    "min_p": field(floats(0, 1), floats(1.001, 5)),
    "n": field(st.integers(1, 2), st.one_of(st.integers(max_value=0), st.integers(129, 2**40))),
    "seed": field(st.integers(0, 2**63 - 1), st.integers(2**63, 2**70)),
    "stop": field(
        st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3))),
        st.just(""),
    ),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "stop_token_ids": field(st.lists(st.integers(0, 49_151), max_size=2), st.just([-1])),
    "ignore_eos": field(st.booleans()),
    "entropy_target": field(floats(0.1, 5), floats(-1, 0)),
    "entropy_control": field(st.sampled_from(["feedback", "lagged", "exact"]), st.just("pid")),
    "entropy_estimator": field(st.sampled_from(["exact", "topk", "tail"]), st.just("guess")),
    "temperature_min": field(floats(0.05, 1), floats(-1, 0)),
    "mirostat_tau": field(floats(0.5, 8), floats(-1, 0)),
    "edt_theta": field(floats(0.1, 2), floats(-1, 0)),
    "frequency_penalty": field(st.just(0), floats(0.01, 2)),
    "logit_bias": field(st.just({})),
    "no_such_field": (junk, junk),
}
COMPLETION_FIELDS = {
    "prompt": field(
        st.one_of(
            st.text(min_size=1, max_size=20),
            st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=2),
            st.lists(st.integers(0, 49_151), min_size=1, max_size=5),
            st.lists(
                st.lists(st.integers(0, 49_151), min_size=1, max_size=4), min_size=1, max_size=2
            ),
        ),
        st.one_of(st.just(""), st.just([]), st.lists(st.integers(49_152, 10**6), min_size=1)),
    ),
    "logprobs": field(st.integers(0, 5), st.integers(21, 100)),
}
TEXT_PART = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)})
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "developer", "user", "assistant"]),
        "content": st.one_of(st.text(max_size=20), st.lists(TEXT_PART, min_size=1, max_size=2)),
    }
)
CHAT_FIELDS = {
    "messages": field(
        st.lists(MESSAGE, min_size=1, max_size=3),
        st.one_of(st.just([]), st.lists(st.fixed_dictionaries({"role": st.just("tool")}))),
    ),
    "logprobs": field(st.booleans()),
    "top_logprobs": field(st.integers(0, 5), st.integers(21, 100)),
}


@st.composite
def requests(draw) -> tuple[str, object]:
    """(path, body): mostly well-formed requests with a few fields fuzzed, now and then
    anything at all. About one field in six is invalid."""
    chat = draw(st.booleans())
    specific = CHAT_FIELDS if chat else COMPLETION_FIELDS
    required = "messages" if chat else "prompt"
    optional = sorted({*FIELDS, *specific} - {required})
    names = [required, *draw(st.lists(st.sampled_from(optional), max_size=5, unique=True))]
    body = {}
    for name in names:
        valid, invalid = (FIELDS | specific)[name]
        body[name] = draw(invalid if draw(st.integers(0, 5)) == 5 else valid)
    if body.get("max_tokens") is None:
        # Keep accepted requests short (chat without a limit runs to the end of the context).
        body["max_tokens"] = draw(st.integers(1, 3))
    if draw(st.integers(0, 19)) == 19:
        body = draw(st.one_of(junk, st.lists(junk, max_size=3)))
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


@settings(
    max_examples=80,
    deadline=None,
    derandomize=True,  # the same requests on every run: CI sees what a developer saw
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=requests())
def test_fuzzed_requests_never_get_a_5xx(server: ServerThread, request) -> None:
    path, body = request
    content = json.dumps(body).encode()
    with HTTP.stream(
        "POST",
        f"{server.url}{path}",
        content=content,
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=120,
    ) as response:
        text = response.read().decode()
    assert response.status_code < 500, (body, text)
    hypothesis.event(f"status {response.status_code}")
    if response.status_code != 200:
        error = json.loads(text)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
        assert events[-1] == "[DONE]"
        for data in events[:-1]:
            assert "error" not in json.loads(data), data
    else:
        choices = json.loads(text)["choices"]
        assert all(c["finish_reason"] in ("stop", "length") for c in choices)


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(body=st.binary(max_size=40))
def test_fuzzed_bytes_never_get_a_5xx(server: ServerThread, body: bytes) -> None:
    response = HTTP.post(f"{server.url}/v1/chat/completions", content=body, headers=AUTH)
    assert response.status_code == 400, response.text


def test_loop_survives_the_fuzzing(server: ServerThread, engine: LLMEngine) -> None:
    assert_healthy(server, engine)


# -- soak --------------------------------------------------------------------------------------


def test_soak_with_random_disconnects(server: ServerThread, engine: LLMEngine) -> None:
    """200 mixed requests, 16 at a time; about a quarter of the clients hang up early."""
    rng = random.Random(0)
    before = server.metrics()

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        """(outcome, choices that completed): outcome is "done", "dropped" or "rejected"."""
        chat, stream, drop = rng.random() < 0.5, rng.random() < 0.6, rng.random() < 0.25
        n, invalid = rng.choice([1, 1, 2]), rng.random() < 0.1
        common = {"model": MODEL, "n": n, "max_tokens": rng.randint(1, 12),
                  "temperature": rng.choice([0.0, 0.7, 1.0]), "seed": i,
                  "extra_body": {"ignore_eos": rng.random() < 0.5}}  # fmt: skip
        if invalid:
            common["top_p"] = 2.0
        if chat:
            create = client.chat.completions.create
            common["messages"] = [{"role": "user", "content": f"Say something about {i}."}]
        else:
            create = client.completions.create
            common["prompt"] = f"Item {i}:"
        try:
            if stream:
                chunks = await create(stream=True, **common)
                if drop:
                    for _ in range(rng.randint(0, 3)):
                        if await anext(chunks, None) is None:
                            break
                    await chunks.close()
                    return "dropped", 0
                finishes = [c.finish_reason async for chunk in chunks for c in chunk.choices]
                finishes = [f for f in finishes if f is not None]
            elif drop:
                # Hang up while the request runs (or after it ended, if it was quick).
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(create(**common), timeout=rng.uniform(0.05, 0.5))
                return "dropped", 0
            else:
                finishes = [c.finish_reason for c in (await create(**common)).choices]
        except openai.BadRequestError:
            assert invalid
            return "rejected", 0
        assert not invalid
        assert len(finishes) == n and set(finishes) <= {"stop", "length"}
        return "done", n

    async def run() -> list[tuple[str, int]]:
        gate = asyncio.Semaphore(16)
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300
        ) as client:

            async def gated(i: int) -> tuple[str, int]:
                async with gate:
                    return await one(client, i)

            return await asyncio.gather(*(gated(i) for i in range(200)))

    outcomes = asyncio.run(run())
    assert len(outcomes) == 200
    kinds = {kind: sum(1 for k, _ in outcomes if k == kind) for kind in ("done", "dropped")}
    assert kinds["done"] > 100 and kinds["dropped"] > 20
    after = server.wait_idle()
    assert server.app.state.loop.num_in_flight == 0  # no request left behind
    assert_engine_drained(engine)
    # Every completed choice was counted once; a dropped one may have finished before its
    # client left, but none was lost.
    finished = after["etinfer:request_success_total"] - before["etinfer:request_success_total"]
    completed = sum(n for _, n in outcomes)
    assert completed <= finished <= completed + 2 * kinds["dropped"]
    assert_healthy(server, engine)


# -- back-pressure and pruning telemetry on a small server -------------------------------------


@pytest.fixture(scope="module")
def small_server(loaded_model: LoadedModel):
    """One sequence at a time, one waiting, and block pruning on from the first token."""
    pruning = PruningConfig(
        scorer="bound", min_context=0, min_blocks=2, recent_blocks=1, dense_layers=2
    )
    engine = make_engine(loaded_model, max_num_seqs=1, control=ControlConfig(pruning=pruning))
    with ServerThread(create_app(engine, api_key=API_KEY, max_waiting_requests=1)) as running:
        yield running, engine


def test_full_queue_answers_429(small_server) -> None:
    server, engine = small_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    long = {"model": MODEL, "max_tokens": 400, "stream": True, "extra_body": {"ignore_eos": True}}
    running = client.completions.create(prompt="Count to a thousand:", **long)
    first = next(running)  # it runs, and holds the only sequence slot
    waiting = client.completions.create(prompt="And again:", **long)
    wait_for(lambda: server.metrics()["etinfer:num_requests_waiting"] == 1, "one waiting")
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model=MODEL, prompt="One more", max_tokens=1)
    assert caught.value.status_code == 429
    assert caught.value.code == "queue_full" and "overloaded" in caught.value.message
    assert caught.value.response.headers["retry-after"] == "1"
    # The accepted ones are unaffected: the running stream goes on.
    more = [next(running) for _ in range(3)]
    assert all(chunk.choices[0].finish_reason is None for chunk in [first, *more])
    running.close()
    waiting.close()
    server.wait_idle()
    assert_engine_drained(engine)


def test_pruning_reports_blocks_kept(small_server) -> None:
    server, _ = small_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    before = server.metrics()
    response = client.completions.create(
        model=MODEL, prompt="A story: " + "once upon a time " * 20, max_tokens=6,
        temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    telemetry = response.choices[0].model_extra["etinfer"]
    # One ratio per decode step: the first token comes from the prefill.
    assert len(telemetry["blocks_kept"]) == 6 - 1
    assert all(0 < ratio <= 1 for ratio in telemetry["blocks_kept"])
    assert min(telemetry["blocks_kept"]) < 1  # with 6 blocks of context, some were skipped
    after = server.wait_idle()
    assert after["etinfer:blocks_kept_ratio_count"] - before["etinfer:blocks_kept_ratio_count"] == 5
    assert math.isfinite(after["etinfer:blocks_kept_ratio_sum"])
