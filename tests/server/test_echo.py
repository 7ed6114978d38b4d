"""What evaluation harnesses send to /v1/completions (lm-evaluation-harness's loglikelihood
requests): echo with logprobs and no token to generate, vLLM's prompt_logprobs, token-id
prompts; through the official openai client against a real server."""

from __future__ import annotations

import openai
import pytest

from etinfer import SamplingParams
from tests.server.conftest import COMPLETIONS, post

CONTEXT, CONTINUATION = "The capital of France is", " Paris"


@pytest.fixture(scope="module")
def expected(make_llm, engine):
    """The prompt's scores from an engine of the server's settings, asked directly."""
    llm = make_llm(max_model_len=engine.max_model_len)
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    return llm.generate([CONTEXT + CONTINUATION], params)[0]


def test_echo_scores_the_prompt_with_no_token_generated(client, model_name, expected):
    prompt = CONTEXT + CONTINUATION
    reply = client.completions.create(
        model=model_name, prompt=prompt, echo=True, logprobs=1, max_tokens=0, temperature=0
    )
    choice = reply.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 0
    ids = expected.prompt_token_ids
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) == reply.usage.prompt_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    for position, value in enumerate(logprobs.token_logprobs[1:], start=1):
        scored = expected.prompt_logprobs[position][ids[position]]
        assert value == pytest.approx(scored.logprob, abs=1e-4)
        assert len(logprobs.top_logprobs[position]) in (1, 2)  # the top 1, and the prompt's token


def test_echo_with_token_ids_and_a_completion(client, model_name, expected):
    """lm-eval sends token ids; echo with tokens to generate returns prompt then completion."""
    ids = expected.prompt_token_ids
    reply = client.completions.create(
        model=model_name, prompt=ids, echo=True, logprobs=2, max_tokens=3, temperature=0
    )
    choice = reply.choices[0]
    assert choice.text.startswith(CONTEXT + CONTINUATION)
    assert len(choice.logprobs.tokens) == len(ids) + reply.usage.completion_tokens
    assert reply.usage.completion_tokens == 3
    assert choice.logprobs.token_logprobs[len(ids) - 1] == pytest.approx(
        expected.prompt_logprobs[-1][ids[-1]].logprob, abs=1e-4
    )


def test_prompt_logprobs_as_vllm_returns_them(server, model_name, expected):
    body = {"model": model_name, "prompt": CONTEXT + CONTINUATION, "max_tokens": 1,
            "prompt_logprobs": 0}  # fmt: skip
    choice = post(server, COMPLETIONS, body).json()["choices"][0]
    scores = choice["prompt_logprobs"]
    ids = expected.prompt_token_ids
    assert scores[0] is None and len(scores) == len(ids)
    for position, entry in enumerate(scores[1:], start=1):
        assert list(entry) == [str(ids[position])]
        value = entry[str(ids[position])]["logprob"]
        assert value == pytest.approx(
            expected.prompt_logprobs[position][ids[position]].logprob, abs=1e-4
        )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"echo": True, "stream": True}, "echo"),
        ({"echo": True, "n": 2}, "echo"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"echo": True, "logprobs": 21}, "logprobs"),
    ],
)
def test_bad_echo_requests_are_a_400_naming_the_field(server, model_name, body, param):
    reply = post(server, COMPLETIONS, {"model": model_name, "prompt": CONTEXT, **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_the_openai_client_sees_echo_refused_when_streamed(client, model_name):
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=model_name, prompt=CONTEXT, echo=True, stream=True)
