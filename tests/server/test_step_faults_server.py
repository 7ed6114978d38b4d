"""A step that fails in the server: its requests get an error naming the stage, the others
go on, and /health still says the engine is alive."""

from __future__ import annotations

import threading

import openai
import pytest

from etinfer.server import create_app
from tests.server.conftest import API_KEY, GREEDY_PROMPT, HTTP, ServerThread, make_engine

DOOMED_SEED = 4242


@pytest.fixture(scope="module")
def faulty_server(loaded_model):
    engine = make_engine(loaded_model, max_num_seqs=1)  # one runs, the other waits
    execute = engine.runner.execute

    def fail_for_the_doomed(batch, decisions):
        if any(seq.params.seed == DOOMED_SEED for seq in batch.seqs):
            raise RuntimeError("injected fault")
        return execute(batch, decisions)

    engine.runner.execute = fail_for_the_doomed
    with ServerThread(create_app(engine, api_key=API_KEY)) as running:
        yield running


def test_a_failed_step_fails_its_request_only(faulty_server):
    client = openai.OpenAI(base_url=f"{faulty_server.url}/v1", api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    results = {}

    def bystander() -> None:
        reply = client.completions.create(
            model=model, prompt=GREEDY_PROMPT, max_tokens=24, temperature=0
        )
        results["bystander"] = reply.choices[0]

    thread = threading.Thread(target=bystander)
    thread.start()
    with pytest.raises(openai.APIStatusError) as failed:
        client.completions.create(
            model=model, prompt=GREEDY_PROMPT, max_tokens=24, temperature=1.0, seed=DOOMED_SEED
        )
    thread.join(timeout=120)
    assert failed.value.status_code == 500
    assert "failed in forward: RuntimeError: injected fault" in str(failed.value)
    assert results["bystander"].finish_reason == "length"
    # Streamed: an error event, then the end of the stream.
    events = [
        line
        for line in HTTP.post(
            f"{faulty_server.url}/v1/completions",
            json={"prompt": "x", "max_tokens": 4, "seed": DOOMED_SEED, "stream": True},
            headers={"Authorization": f"Bearer {API_KEY}"},
        ).text.splitlines()
        if line.startswith("data: ")
    ]
    assert "failed in forward" in events[-2] and events[-1] == "data: [DONE]"
    assert HTTP.get(f"{faulty_server.url}/health").status_code == 200
    again = client.completions.create(model=model, prompt=GREEDY_PROMPT, max_tokens=4)
    assert again.choices[0].finish_reason == "length"
