"""Two engine replicas on Ray Serve behind one endpoint, started by ``etinfer serve
--replicas 2`` on the loopback address (one thread each), driven by the official ``openai``
client and compared with the single-engine server. One deployment for the module; the fault
test kills one of its replicas, so it runs last."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx2
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from etinfer.bench.common.local_server import LocalServer, local_server
from etinfer.server import create_app
from tests.server.conftest import (
    API_KEY,
    AUTH,
    HTTP,
    MAX_MODEL_LEN,
    MESSAGES,
    ServerThread,
    make_engine,
    wait_for,
)

pytest.importorskip("ray", reason="needs the ray extra: pip install -e '.[ray]'")

STOP_S = 60.0
RAY_PROCESSES = "raylet|gcs_server|ServeReplica|ServeController|ProxyActor"
MODEL = "etinfer-test"
PROMPTS = ["The capital of France is", "def add(a, b):", "Water boils at"]


def replica_samples(url: str) -> dict[str, dict[str, float]]:
    """Each replica's samples of /metrics, summed over the other labels: {replica: {name: v}}."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(HTTP.get(f"{url}/metrics").text):
        for sample in family.samples:
            replica = sample.labels.get("replica", "")
            values = out.setdefault(replica, {})
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return out


def engine_replicas(url: str) -> dict[str, dict[str, float]]:
    """The engine replicas' samples, those that carry the engine's own metrics."""
    return {r: v for r, v in replica_samples(url).items() if "etinfer:num_requests_running" in v}


@dataclass
class Deployment:
    server: LocalServer

    @property
    def url(self) -> str:
        return self.server.url

    def healthy(self) -> bool:
        try:
            return HTTP.get(f"{self.url}/health", timeout=5).status_code == 200
        except httpx2.HTTPError:
            return False

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def deployment():
    flags = ["--replicas", "2", "--num-threads", "1", "--api-key", API_KEY,
             "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN),
             "--num-kvcache-blocks", "1024"]  # fmt: skip
    with local_server(flags, env={"OMP_WAIT_POLICY": "PASSIVE"}) as server:
        running = Deployment(server)
        wait_for(lambda: len(engine_replicas(running.url)) == 2, "both replicas' metrics")
        yield running


@pytest.fixture(scope="module")
def single_server(loaded_model):
    app = create_app(make_engine(loaded_model), api_key=API_KEY, model_name=MODEL)
    with ServerThread(app) as running:
        yield running


def answers(client: openai.OpenAI) -> list[str]:
    """Greedy answers, one request at a time: chat, completion and a streamed completion."""
    texts = []
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0
    )
    texts.append(chat.choices[0].message.content)
    for prompt in PROMPTS:
        done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        texts.append(done.choices[0].text)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True
    )
    texts.append("".join(chunk.choices[0].text for chunk in stream if chunk.choices))
    return texts


def test_greedy_answers_equal_the_single_engine_servers(deployment, single_server):
    replicas = answers(deployment.client())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each replica runs: the same sums in the same order
    try:
        single = answers(
            openai.OpenAI(base_url=f"{single_server.url}/v1", api_key=API_KEY, max_retries=0)
        )
    finally:
        torch.set_num_threads(threads)
    assert replicas == single
    assert all(replicas)


def test_responses_and_the_tokenizer_are_the_single_servers(deployment, single_server):
    """/v1/responses (whole and streamed) and the tokenizer endpoints through the ingress."""

    def replies(url: str) -> list:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
        kwargs = {"model": MODEL, "input": "Name a colour.", "max_output_tokens": 12}
        whole = client.responses.create(temperature=0, **kwargs)
        with client.responses.stream(temperature=0, **kwargs) as stream:
            deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        body = {"model": MODEL, "prompt": PROMPTS[0]}
        tokens = HTTP.post(f"{url}/tokenize", json=body, headers=AUTH).json()
        detokenized = HTTP.post(
            f"{url}/detokenize", json={"tokens": tokens["tokens"]}, headers=AUTH
        ).json()
        info = HTTP.get(f"{url}/tokenizer_info", headers=AUTH).json()
        refused = HTTP.post(f"{url}/detokenize", json={"tokens": [-1]}, headers=AUTH)
        return [whole.output_text, "".join(deltas), tokens, detokenized, info, refused.json()]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each replica runs: the same sums in the same order
    try:
        single = replies(single_server.url)
    finally:
        torch.set_num_threads(threads)
    replicas = replies(deployment.url)
    assert replicas == single
    assert replicas[0] and replicas[3]["prompt"] == PROMPTS[0]
    assert replicas[5]["error"]["param"] == "tokens"


def test_errors_and_the_playground_are_the_single_servers(deployment, single_server):
    def replies(url: str) -> list[tuple[int, dict]]:
        bad = {"model": MODEL, "prompt": "x", "max_tokens": -3}
        shapeless = {"model": MODEL, "messages": "not a list"}
        return [
            (r.status_code, r.json())
            for r in (
                HTTP.post(f"{url}/v1/completions", json=bad, headers=AUTH),
                HTTP.post(f"{url}/v1/chat/completions", json=shapeless, headers=AUTH),
                HTTP.post(f"{url}/v1/completions", json=bad),  # no key
            )
        ]

    replicas = replies(deployment.url)
    assert [status for status, _ in replicas] == [400, 400, 401]
    page = HTTP.get(f"{deployment.url}/")  # the playground, as a single server serves it
    assert page.status_code == 200 and page.text == HTTP.get(f"{single_server.url}/").text
    assert replicas[0][1]["error"]["param"] == "max_tokens"
    assert replicas == replies(single_server.url)


def test_concurrent_plain_and_streamed_requests_use_both_replicas(deployment):
    client = deployment.client()
    before = engine_replicas(deployment.url)

    def ask(i: int) -> str:
        """Half the requests streamed: each answers with its finish reason."""
        content = f"Count to {i + 3}." if i % 2 else f"Name {i + 2} animals."
        messages = [{"role": "user", "content": content}]
        if i % 2:
            reply = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=24, temperature=0
            )
            return reply.choices[0].finish_reason
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True
        )
        return [c.choices[0].finish_reason for c in stream if c.choices][-1]

    with ThreadPoolExecutor(8) as pool:
        reasons = list(pool.map(ask, range(8), timeout=300))
    assert all(reason in ("stop", "length") for reason in reasons)

    def counted() -> bool:
        after = engine_replicas(deployment.url)
        served = {
            r: after[r].get("etinfer:request_success_total", 0)
            - before.get(r, {}).get("etinfer:request_success_total", 0)
            for r in after
        }
        return sum(served.values()) >= 8 and all(n > 0 for n in served.values())

    wait_for(counted, "both replicas to report the requests they served")


def test_metrics_label_every_replica_and_count_the_routers_decisions(deployment):
    samples = replica_samples(deployment.url)
    engines = engine_replicas(deployment.url)
    assert len(engines) == 2
    for values in engines.values():
        assert values["etinfer:kv_cache_usage_perc"] >= 0
        assert "etinfer:time_to_first_token_seconds_count" in values
    decisions = sum(v.get("etinfer:router_decisions_total", 0) for v in samples.values())
    assert decisions >= 8


def test_a_client_that_leaves_a_stream_frees_its_blocks(deployment):
    with HTTP.stream(
        "POST",
        f"{deployment.url}/v1/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"prompt": "Tell a long story.", "max_tokens": 400, "stream": True,
              "ignore_eos": True},
        timeout=60,
    ) as response:  # fmt: skip
        lines = response.iter_lines()
        assert sum(line.startswith("data:") for _, line in zip(range(6), lines, strict=False))

    def idle() -> bool:
        return all(
            v["etinfer:num_requests_running"] == 0 and v["etinfer:kv_cache_usage_perc"] == 0
            for v in engine_replicas(deployment.url).values()
        )

    wait_for(idle, "the replica to abort the stream and free its blocks")


def test_a_killed_replica_fails_only_its_streams_and_is_replaced(deployment):
    """Kill one engine replica while both serve a bounded load: whole answers it held are sent
    again elsewhere, a stream it was sending ends with an error event, nothing hangs, the
    other replica's requests are untouched, and Serve brings a new replica up."""
    client = openai.OpenAI(
        base_url=f"{deployment.url}/v1", api_key=API_KEY, max_retries=0, timeout=300
    )
    started = threading.Event()

    def plain(i: int) -> str:
        reply = client.completions.create(
            model=MODEL, prompt=f"List {i} fruits:", max_tokens=48, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return "ok" if reply.choices[0].finish_reason == "length" else "bad"

    def streamed(i: int) -> str:
        try:
            stream = client.completions.create(
                model=MODEL, prompt=f"Story number {i}:", max_tokens=48, temperature=0,
                stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            reasons = []
            for chunk in stream:
                started.set()
                reasons += [c.finish_reason for c in chunk.choices]
            return "ok" if reasons[-1] == "length" else "bad"
        except openai.APIError as e:  # the error event the ingress sends
            return "failed" if "replica" in str(e) else f"unclear: {e}"

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(streamed if i % 2 else plain, i) for i in range(8)]
        assert started.wait(timeout=120)
        victims = subprocess.run(
            ["pgrep", "-f", "ServeReplica:etinfer:EngineReplica"],
            capture_output=True,
            text=True,
        ).stdout.split()
        assert len(victims) == 2
        os.kill(int(victims[0]), signal.SIGKILL)
        outcomes = [f.result(timeout=300) for f in futures]  # nothing hangs

    lost_sends = replica_samples(deployment.url)[""]["etinfer:ingress_lost_sends_total"]
    assert set(outcomes) <= {"ok", "failed"}, outcomes
    plain_outcomes = outcomes[0::2]
    assert plain_outcomes == ["ok"] * 4  # whole answers are sent again, never lost
    assert outcomes.count("ok") >= 4  # the surviving replica's streams are untouched
    assert outcomes.count("failed") + lost_sends >= 1  # the kill hit requests in flight

    def replaced() -> bool:
        return deployment.healthy() and len(engine_replicas(deployment.url)) == 2

    wait_for(replaced, "Serve to replace the killed replica")
    reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert reply.choices[0].text


def test_sigterm_stops_everything(deployment):
    deployment.server.process.send_signal(signal.SIGTERM)
    deployment.server.process.wait(timeout=STOP_S)
    time.sleep(2)
    left = subprocess.run(["pgrep", "-f", RAY_PROCESSES], capture_output=True, text=True)
    assert left.stdout.split() == []
