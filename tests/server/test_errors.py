"""Every error a request can get: 400s naming the field, malformed bodies, the API key, 404,
errors mid-stream; and the scheduling fields reaching the scheduler."""

from __future__ import annotations

import threading

import openai
import pytest

from etinfer.control.config import ControlConfig
from etinfer.control.scheduling import SchedulingConfig
from etinfer.engine.observer import StepRecord
from etinfer.model.loader import LoadedModel
from etinfer.server import create_app
from tests.server.conftest import (
    AUTH,
    CHAT,
    COMPLETIONS,
    GREEDY_PROMPT,
    HTTP,
    MAX_MODEL_LEN,
    MESSAGES,
    SETTLE_S,
    ServerThread,
    make_engine,
    post,
    wait_for,
)

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
    response = HTTP.post(f"{server.url}{COMPLETIONS}", content=b"{")
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    # Health and metrics stay open, for probes and scrapers.
    assert HTTP.get(f"{server.url}/health").status_code == 200
    assert HTTP.get(f"{server.url}/metrics").status_code == 200


def test_unknown_route_is_404_in_openai_shape(server: ServerThread) -> None:
    response = HTTP.get(f"{server.url}/v1/engines", headers=AUTH)
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


def test_priority_and_slo_reach_the_scheduler(loaded_model: LoadedModel) -> None:
    """One sequence slot and the entropy policy with aging out of reach, so `priority` alone
    orders the queue. While a long request holds the slot, an ordinary request and then a more
    urgent one (priority -1, as vLLM's extra parameter) queue up; the urgent one, though it
    arrived later, is admitted first. Every choice of a request carries its fields."""
    control = ControlConfig(scheduling=SchedulingConfig(aging_steps=1e6, aging_backlog=0.0))
    engine = make_engine(loaded_model, max_num_seqs=1, control=control)
    seen: dict[str, tuple[int, float | None]] = {}

    def scheduled(step: StepRecord) -> None:  # what the scheduling policy saw of each request
        seen.update({seq.request_id: (seq.priority, seq.slo) for seq in step.control.seqs})

    engine.add_observer(scheduled)
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
