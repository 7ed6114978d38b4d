"""The server with speculative decoding on: the official client gets what plain decoding gives,
streamed or not, and /metrics exports the drafts and acceptances (vLLM's counter names)."""

import openai
import pytest

from etinfer import SpeculativeConfig
from etinfer.server import create_app
from tests.server.conftest import API_KEY, ServerThread, make_engine

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, "
    "and wrote the weather in a leather logbook that his grandfather had started."
)
MESSAGES = [{"role": "user", "content": f"Repeat this text exactly:\n\n{PASSAGE}"}]


@pytest.fixture(scope="module")
def servers(loaded_model):
    plain = make_engine(loaded_model)
    speculative = make_engine(loaded_model, speculative=SpeculativeConfig())
    with (
        ServerThread(create_app(plain, api_key=API_KEY)) as a,
        ServerThread(create_app(speculative, api_key=API_KEY)) as b,
    ):
        yield a, b


def chat(server: ServerThread, stream: bool = False) -> str:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    kwargs = {"model": model, "messages": MESSAGES, "max_tokens": 48, "temperature": 0}
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(**kwargs, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_same_replies_and_acceptance_in_the_metrics(servers):
    plain, speculative = servers
    expected = chat(plain)
    assert chat(speculative) == expected
    assert chat(speculative, stream=True) == expected
    metrics = speculative.wait_idle()
    drafted = metrics["etinfer:spec_decode_num_draft_tokens_total"]
    accepted = metrics["etinfer:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= drafted
    assert plain.wait_idle()["etinfer:spec_decode_num_draft_tokens_total"] == 0
