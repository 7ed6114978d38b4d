"""The server with speculative decoding on: the official client gets what plain decoding gives,
streamed or not, and /metrics exports the drafts and acceptances (vLLM's counter names)."""

import openai
import pytest

from etinfer import ControlConfig, SpeculativeConfig
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


def chat(server: ServerThread, stream: bool = False, **extra) -> tuple[str, dict]:
    """The reply's text and its ``etinfer`` object (the last chunk's, when streamed)."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    kwargs = {"model": model, "messages": MESSAGES, "max_tokens": 48, "temperature": 0, **extra}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content, choice.model_extra["etinfer"]
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    return text, chunks[-1].choices[0].model_extra["etinfer"]


def test_same_replies_and_acceptance_in_the_metrics(servers):
    plain, speculative = servers
    expected, _ = chat(plain)
    text, extension = chat(speculative)
    assert text == expected
    assert 0 < extension["num_accepted_tokens"] <= extension["num_draft_tokens"]
    assert chat(speculative, stream=True)[0] == expected
    client = openai.OpenAI(base_url=f"{speculative.url}/v1", api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    both = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=48, temperature=0, n=2
    )
    assert [c.message.content for c in both.choices] == [expected, expected]
    metrics = speculative.wait_idle()
    drafted = metrics["etinfer:spec_decode_num_draft_tokens_total"]
    accepted = metrics["etinfer:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= drafted
    assert plain.wait_idle()["etinfer:spec_decode_num_draft_tokens_total"] == 0


def test_switching_replies_say_which_model_wrote_each_token(loaded_model):
    engine = make_engine(loaded_model, draft_model="self:22", control=ControlConfig(switching=True))
    with ServerThread(create_app(engine, api_key=API_KEY)) as server:
        text, extension = chat(server)
        streamed, last = chat(server, stream=True)
    assert streamed == text and text
    assert set(extension["token_models"]) <= {"target", "exit"}
    assert len(extension["token_models"]) == len(extension["entropies"])
    assert extension["large_model_share"] == last["large_model_share"]
    share = extension["token_models"].count("target") / len(extension["token_models"])
    assert extension["large_model_share"] == share
