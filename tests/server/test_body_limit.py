"""The body size limit at its edge, with and without a Content-Length, and bodies nested or
sized to break a parser: each refused with an OpenAI-shaped 400 or 413, never a 5xx."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from etinfer.engine.llm_engine import LLMEngine
from etinfer.server import create_app
from etinfer.server.limits import default_max_request_bytes
from tests.server.conftest import (
    API_KEY,
    AUTH,
    CHAT,
    COMPLETIONS,
    HTTP,
    MAX_MODEL_LEN,
    ServerThread,
    post,
)

LIMIT = 4096  # a small limit, so bodies at its edge are cheap to build
# The conftest server's limit: its 512-token context at 81 bytes a token, escaped, plus 1 MiB.
DEFAULT_LIMIT = default_max_request_bytes(MAX_MODEL_LEN, 81)


@pytest.fixture(scope="module")
def small_limit(engine: LLMEngine) -> Iterator[ServerThread]:
    app = create_app(engine, api_key=API_KEY, max_request_bytes=LIMIT)
    with ServerThread(app) as running:
        yield running


def body_of_size(size: int) -> bytes:
    """A valid one-token completion request of exactly ``size`` bytes (padded by its user)."""
    empty = json.dumps({"prompt": "Hi", "max_tokens": 1, "user": ""}).encode()
    return json.dumps({"prompt": "Hi", "max_tokens": 1, "user": "u" * (size - len(empty))}).encode()


def chunked(body: bytes, size: int = 1000) -> Iterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start : start + size]


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_body_at_the_limit_is_served_and_one_byte_more_is_refused(small_limit, declared):
    for size, status in ((LIMIT, 200), (LIMIT + 1, 413)):
        body = body_of_size(size)
        assert len(body) == size
        content = body if declared else chunked(body)
        headers = {**AUTH, "Content-Type": "application/json"}
        response = HTTP.post(
            f"{small_limit.url}{COMPLETIONS}", content=content, headers=headers, timeout=60
        )
        assert response.status_code == status, response.text
        if status == 413:
            error = response.json()["error"]
            assert error["code"] == "request_too_large" and str(LIMIT) in error["message"]


def test_the_api_key_is_checked_before_the_size(small_limit):
    response = HTTP.post(f"{small_limit.url}{COMPLETIONS}", content=b"x" * (2 * LIMIT))
    assert response.status_code == 401


def test_a_lone_surrogate_is_a_400_naming_the_prompt(server):
    for path, body in [
        (COMPLETIONS, b'{"prompt": "a\\ud800b", "max_tokens": 1}'),
        (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 1}'),
    ]:
        response = post(server, path, body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] in ("prompt", "messages") and "surrogate" in error["message"]


@st.composite
def nested_or_oversized(draw: st.DrawFn) -> tuple[str, bytes, bool]:
    """(path, body, oversized): a value nested 3 to 200,000 deep (deeper than any field takes)
    where a field or the whole body goes, or a field's text over the server's body limit."""
    field = draw(st.sampled_from(["prompt", "stop", "messages", "body"]))
    path = CHAT if field == "messages" else COMPLETIONS
    if draw(st.booleans()):
        depth = draw(st.one_of(st.integers(3, 1_200), st.integers(1_200, 200_000)))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a": ', "}")]))
        value = opener * depth + "1" + closer * depth
        body = value if field == "body" else f'{{"{field}": {value}, "max_tokens": 1}}'
        return path, body.encode(), False
    text = "w" * draw(st.integers(DEFAULT_LIMIT + 1, 3 * DEFAULT_LIMIT))
    content = {
        "prompt": {"prompt": text},
        "stop": {"prompt": "Hi", "stop": [text]},
        "messages": {"messages": [{"role": "user", "content": text}]},
        "body": {"prompt": "Hi", "user": text},
    }[field]
    return path, json.dumps(content).encode(), True


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=nested_or_oversized())
def test_nested_and_oversized_bodies_are_refused_cleanly(
    server: ServerThread, request: tuple[str, bytes, bool]
) -> None:
    path, body, oversized = request
    response = post(server, path, body, timeout=120)
    assert response.status_code == (413 if oversized else 400), response.text[:300]
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
