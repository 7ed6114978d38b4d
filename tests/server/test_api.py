"""The OpenAI API on a real server: models, chat, streaming, n, logprobs, stop, extra body
fields, with the official ``openai`` client."""

from __future__ import annotations

import openai
import pytest

from etinfer.model.loader import LoadedModel
from etinfer.server.protocol import SamplingExtensions
from etinfer.server.serving import FIELDS
from tests.server.conftest import GREEDY_PROMPT, MAX_MODEL_LEN, MESSAGES


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct.Q4_1"]
    assert models[0].owned_by == "etinfer"
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_every_sampling_field_is_a_request_field() -> None:
    openai_named = {"temperature", "top_p", "seed", "max_tokens", "stop", "logprobs"}
    # A constraint comes from response_format, tools or vLLM's structured-output fields.
    constraint = {"structured"}
    # Completions alone return the prompt's scores (CompletionRequest.prompt_logprobs, echo).
    completions_only = {"prompt_logprobs"}
    named = openai_named | constraint | completions_only
    assert set(FIELDS) - named == set(SamplingExtensions.model_fields)


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
