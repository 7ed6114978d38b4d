"""The Responses API (/v1/responses) through the official client: text, function tools and a
tool's result sent back, a JSON schema as the text format, the stream's typed events (whose
final response equals the whole one), and a 400 naming the field for what is not served."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather of a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
QUESTION = "What is the weather in Paris?"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "address": {"$ref": "#/$defs/Address"},
    },
    "required": ["name", "age", "address"],
    "$defs": {
        "Address": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        }
    },
}


def test_text_whole(client, model_name):
    response = client.responses.create(
        model=model_name,
        instructions="Answer in one short sentence.",
        input="Name a colour.",
        max_output_tokens=24,
        temperature=0,
        metadata={"case": "text"},
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete")
    assert response.output_text and response.output[0].type == "message"
    usage = response.usage
    assert 0 < usage.output_tokens <= 24
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert response.metadata == {"case": "text"} and response.store is False
    extra = response.model_extra["etinfer"]
    assert len(extra["entropies"]) == usage.output_tokens


def test_max_output_tokens_makes_it_incomplete(client, model_name):
    response = client.responses.create(
        model=model_name, input="Tell me a long story.", max_output_tokens=5, temperature=0
    )
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 5


def test_a_required_call_and_its_result_sent_back(client, model_name):
    first = client.responses.create(
        model=model_name, input=QUESTION, tools=[WEATHER], tool_choice="required", temperature=0
    )
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] == "Paris"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    second = client.responses.create(
        model=model_name,
        input=[
            {"role": "user", "content": QUESTION},
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "Snowing, -3 C"},
        ],
        tools=[WEATHER],
        max_output_tokens=40,
        temperature=0,
    )
    assert second.output[0].type == "message"
    text = second.output_text.lower()
    assert "snow" in text or "-3" in text  # the tool's result reached the model


def test_stream_events_end_in_the_whole_response(client, model_name):
    kwargs = {"model": model_name, "input": "Say hello.", "max_output_tokens": 200}
    # Once before, so both runs below find the prompt in the prefix cache: a prompt computed
    # whole or from the cache takes other kernels, whose last bits can flip a greedy token.
    client.responses.create(temperature=0, **kwargs)
    with client.responses.stream(temperature=0, **kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    whole = client.responses.create(temperature=0, **kwargs)
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.output[0].id == events[2].item.id  # the item streamed is the one reported
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_named_call_streams_its_arguments(client, model_name):
    with client.responses.stream(
        model=model_name,
        input=QUESTION,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    (call,) = final.output
    assert len(pieces) > 1 and "".join(pieces) == done.arguments == call.arguments
    assert done.name == call.name == "get_weather"
    assert json.loads(call.arguments)["city"] == "Paris"


def test_a_json_schema_text_format_is_kept(client, model_name):
    response = client.responses.create(
        model=model_name,
        input="Alice is 30 and lives in Paris. Give the person as JSON.",
        text={
            "format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
        },
        temperature=0.7,
        max_output_tokens=200,
    )
    jsonschema.validate(json.loads(response.output_text), PERSON)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "store": True}, "store"),
        ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
        ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
        ({"input": []}, "input"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
    ],
)
def test_what_is_not_served_is_refused_by_name(client, model_name, body, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.post("/responses", body={"model": model_name, **body}, cast_to=object)
    assert refused.value.body["param"] == param
