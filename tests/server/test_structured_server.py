"""Structured output and tool calling through the official openai client against a real
server: response_format, vLLM's extra fields, tools with every tool_choice, streaming."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from etinfer.bench.structured.schemas import JSON_OBJECT_PROMPT, SCHEMAS, schema_format
from tests.conftest import ON_CUDA
from tests.server.conftest import CHAT, post

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {
                "zone": {"type": "string", "pattern": "^[A-Z][a-z]{2,10}/[A-Z][a-z]{2,10}$"}
            },
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Oslo?"}]


def streamed_chat(client: openai.OpenAI, **kwargs) -> tuple[str, dict[int, dict], str | None]:
    """A streamed reply put back together: its content, its tool calls by index, its finish."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                if call.function is not None:
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.slow
def test_twenty_schemas_validate_mixed_with_free_requests(client, model_name):
    """Every schema twice (one streamed) at temperature 0.7 beside free requests, at once."""

    def constrained(job: tuple[int, bool]) -> tuple[str, str | None]:
        i, stream = job
        name, prompt, schema = SCHEMAS[i]
        kwargs = dict(
            model=model_name,
            messages=[{"role": "user", "content": prompt}],
            temperature=0.7,
            seed=i,
            max_tokens=256,
            response_format=schema_format(name, schema),
        )
        if stream:
            content, _, finish = streamed_chat(client, **kwargs)
            return content, finish
        reply = client.chat.completions.create(**kwargs).choices[0]
        return reply.message.content, reply.finish_reason

    def free(i: int) -> str:
        reply = client.completions.create(
            model=model_name, prompt="Once upon a time", max_tokens=24, seed=i, temperature=1.0
        )
        return reply.choices[0].text

    jobs = [(i, stream) for i in range(len(SCHEMAS)) for stream in (False, True)]
    with ThreadPoolExecutor(16) as pool:
        frees = [pool.submit(free, i) for i in range(8)]
        results = list(pool.map(constrained, jobs))
    for (i, stream), (text, finish) in zip(jobs, results, strict=True):
        assert finish == "stop", (SCHEMAS[i][0], stream, text)
        jsonschema.validate(json.loads(text), SCHEMAS[i][2])
    # The same seed streamed and not: the same JSON, where a row's logits do not depend on its
    # batch (the CPU's kernels; on CUDA cuBLAS picks kernels by the row count, and once an
    # H200 sampled another colour at the last bits' turn).
    if not ON_CUDA:
        for i in range(len(SCHEMAS)):
            assert results[2 * i][0] == results[2 * i + 1][0]
    assert all(f.result() for f in frees)


def test_json_object_and_vllm_extra_fields(client, model_name):
    reply = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": JSON_OBJECT_PROMPT}],
        max_tokens=64,
        temperature=0.0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    telemetry = reply.choices[0].model_extra["etinfer"]
    assert len(telemetry["forced"]) == len(telemetry["entropies"])
    choice = client.completions.create(
        model=model_name,
        prompt="Is the sky blue? Answer:",
        max_tokens=8,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert choice.choices[0].text in ("yes", "no")
    regex = client.completions.create(
        model=model_name,
        prompt="A phone number:",
        max_tokens=12,
        extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}},
    )
    assert len(regex.choices[0].text) == 8 and regex.choices[0].text[3] == "-"


def test_named_tool_choice_streams_the_same_arguments(client, model_name):
    kwargs = dict(
        model=model_name,
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0.0,
        max_tokens=96,
    )
    reply = client.chat.completions.create(**kwargs).choices[0]
    assert reply.finish_reason == "tool_calls"
    (call,) = reply.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
    content, calls, finish = streamed_chat(client, **kwargs)
    assert content == "" and finish == "tool_calls"
    assert calls[0]["name"] == "get_weather"
    assert calls[0]["arguments"] == call.function.arguments


def test_required_tool_choice_gives_calls_whose_arguments_validate(client, model_name):
    kwargs = dict(
        model=model_name,
        messages=[{"role": "user", "content": "What time is it in Europe/Paris?"}],
        tools=TOOLS,
        tool_choice="required",
        temperature=0.0,
        max_tokens=128,
    )
    reply = client.chat.completions.create(**kwargs).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in reply.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    _, calls, finish = streamed_chat(client, **kwargs)
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in reply.message.tool_calls
    ]
    single = client.chat.completions.create(**kwargs, parallel_tool_calls=False).choices[0]
    assert len(single.message.tool_calls) == 1


# What Pydantic writes for a model with a nested one: pydantic-ai sends its output tool so,
# with tool_choice "required".
ORDER_TOOL = {
    "type": "function",
    "function": {
        "name": "final_result",
        "parameters": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 16},
                "address": {"$ref": "#/$defs/Address"},
            },
            "required": ["name", "address"],
            "$defs": {
                "Address": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "maxLength": 16},
                        "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
                    },
                    "required": ["city", "zip"],
                }
            },
        },
    },
}


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_required_calls_keep_a_tools_own_defs_at_any_temperature(client, model_name, temperature):
    """The nested model resolves inside the call list; every reply is a valid call of the tool
    (its complete calls kept where a hot sample lists calls until max_tokens cuts it)."""
    parameters = ORDER_TOOL["function"]["parameters"]
    for seed in range(3):
        reply = client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": "Ship a parcel to Ada in Oslo, 0150."}],
            tools=[ORDER_TOOL, TIME_TOOL],
            tool_choice="required",
            temperature=temperature,
            seed=seed,
            max_tokens=100,
        ).choices[0]
        assert reply.message.tool_calls, reply.message.content
        for call in reply.message.tool_calls:
            assert call.function.name in ("final_result", "get_time")
            if call.function.name == "final_result":
                jsonschema.validate(json.loads(call.function.arguments), parameters)


def test_a_tool_result_is_rendered_and_answered(client, model_name):
    messages = [
        *ASK_WEATHER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": -3, "sky": "snow"}'},
    ]
    reply = client.chat.completions.create(
        model=model_name, messages=messages, tools=TOOLS, max_tokens=24, temperature=0.0
    )
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.prompt_tokens > 100  # the tools' system message and the result


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"response_format": schema_format("x", {"type": "nope"})},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"guided_choice": []}, "guided_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [{**WEATHER_TOOL, "function": {"name": "f", "parameters": {"type": 3}}}]},
            "tools[0].function.parameters",
        ),
        (  # vLLM's whole-output constraint and a forced call cannot both hold
            {
                "tools": TOOLS,
                "tool_choice": "required",
                "structured_outputs": {"json_object": True},
            },
            "structured_outputs",
        ),
        (  # xgrammar does not enforce it: refused, not loosened
            {"response_format": schema_format("x", {"type": "array", "uniqueItems": True})},
            "response_format.json_schema.schema",
        ),
    ],
)
def test_bad_constraints_are_a_400_naming_the_field(server, model_name, body, param):
    reply = post(
        server, CHAT, {"model": model_name, "messages": ASK_WEATHER, "max_tokens": 4, **body}
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_a_forced_call_with_a_response_format_is_the_call(client, model_name):
    """response_format shapes a reply's text; a forced call writes none, so the call's schema
    is the constraint (instructor's Responses mode sends both)."""
    reply = client.chat.completions.create(
        model=model_name,
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice="required",
        response_format={"type": "json_object"},
        max_tokens=100,
        temperature=0,
    )
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name in {t["function"]["name"] for t in TOOLS}
    json.loads(call.function.arguments)


def test_n_choices_each_follow_the_schema(client, model_name):
    name, prompt, schema = SCHEMAS[8]  # weather: an enum, bounded integers
    reply = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": prompt}],
        n=3,
        seed=5,
        temperature=1.0,
        max_tokens=200,
        response_format=schema_format(name, schema),
    )
    assert len(reply.choices) == 3
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
