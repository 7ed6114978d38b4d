"""The server under test: a real uvicorn server on a free loopback port over the real default
model, the official ``openai`` client, and helpers shared by the server's test modules. Each
module gets its own engine and server (module-scoped fixtures)."""

from __future__ import annotations

import atexit
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
from pydantic import BaseModel

from etinfer.config import EngineConfig
from etinfer.engine.llm_engine import LLMEngine
from etinfer.model.loader import LoadedModel
from etinfer.server import create_app
from tests.conftest import ENGINE_DEFAULTS

API_KEY = "test-key"
MAX_MODEL_LEN = 512
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GREEDY_PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
# Generous bounds for waiting on a state change, on a shared 2-core machine: they only stop a
# broken test from hanging, no assertion depends on them.
SETTLE_S = 120.0
# One HTTP client for the suite's raw requests: a new client builds an SSL context (30 ms on a
# slow host), and polling /metrics every 50 ms spent more time building clients than asking.
# Idle connections go after 2 s, before uvicorn's 5 s keep-alive closes them under a request.
HTTP = httpx2.Client(limits=httpx2.Limits(keepalive_expiry=2))
atexit.register(HTTP.close)


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
        return scrape_metrics(self.url)

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


def scrape_metrics(url: str) -> dict[str, float]:
    """Every sample of a server's /metrics, summed over labels."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(HTTP.get(f"{url}/metrics").text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + SETTLE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def make_engine(loaded: LoadedModel, **kwargs) -> LLMEngine:
    """An engine for a test server, with the suite's defaults (float32 weights on CUDA: a
    prompt met again from the prefix cache takes another attention path, whose last bits
    moved bfloat16's tokens between a streamed and a plain reply)."""
    kwargs = {
        "max_model_len": MAX_MODEL_LEN,
        "num_kvcache_blocks": 1024,
        **ENGINE_DEFAULTS,
        **kwargs,
    }
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
    return HTTP.post(f"{server.url}{path}", content=content, headers=headers, **kwargs)


# A model with a nested model: what structured-output libraries send as $defs and $ref.
class Address(BaseModel):
    city: str
    country: str


class Person(BaseModel):
    name: str
    age: int
    address: Address


EXTRACT_PERSON = "Alice is 30 and lives in Paris, France. Extract the person."
