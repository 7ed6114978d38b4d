"""Structured-output libraries, their real packages, against the server: instructor (tools,
JSON-schema and JSON modes, streamed partial objects, its Responses tools mode) and pydantic-ai
(tool output and native output, over chat completions and the Responses API; an agent loop
that calls a tool and answers from its result, plain and streamed; tool_choice auto, required
and none). The target is a model with a nested model,
which each library sends as ``$defs`` and ``$ref``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import openai
import pytest

from tests.server.conftest import API_KEY, EXTRACT_PERSON, Person

instructor = pytest.importorskip("instructor")
pydantic_ai = pytest.importorskip("pydantic_ai")

from pydantic_ai import Agent, NativeOutput, ToolOutput  # noqa: E402
from pydantic_ai.capabilities import AbstractCapability  # noqa: E402
from pydantic_ai.direct import model_request_sync  # noqa: E402
from pydantic_ai.messages import ModelRequest, ToolCallPart  # noqa: E402
from pydantic_ai.models import ModelRequestParameters  # noqa: E402
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402
from pydantic_ai.tools import ToolDefinition  # noqa: E402

SETTINGS = {"temperature": 0, "max_tokens": 120}


def test_a_nested_model_has_defs():
    assert "$defs" in Person.model_json_schema()  # what the libraries below send


@pytest.fixture(scope="module")
def patched(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA", "JSON"])
def test_instructor_modes(patched, model_name, mode):
    client = instructor.from_openai(patched, mode=instructor.Mode[mode])
    person = client.chat.completions.create(
        model=model_name,
        response_model=Person,
        messages=[{"role": "user", "content": EXTRACT_PERSON}],
        temperature=0,
        max_retries=0,
    )
    assert person.age == 30 and person.address.city == "Paris"


def test_instructor_streams_partial_objects(patched, model_name):
    client = instructor.from_openai(patched, mode=instructor.Mode.TOOLS)
    partials = list(
        client.chat.completions.create_partial(
            model=model_name,
            response_model=Person,
            messages=[{"role": "user", "content": EXTRACT_PERSON}],
            temperature=0,
            max_retries=0,
        )
    )
    assert len(partials) > 1
    assert partials[-1].age == 30 and partials[-1].address.city == "Paris"


def test_instructor_responses_tools(patched, model_name):
    """It sends the tool forced by name and the same schema as text.format: the call is the
    output, so the format shapes no text and both are accepted."""
    client = instructor.from_openai(patched, mode=instructor.Mode.RESPONSES_TOOLS)
    person = client.responses.create(
        model=model_name, response_model=Person, input=EXTRACT_PERSON, temperature=0, max_retries=0
    )
    assert person.age == 30 and person.address.country == "France"


@pytest.fixture(scope="module", params=[OpenAIChatModel, OpenAIResponsesModel])
def pai_model(request, server, model_name):
    provider = OpenAIProvider(base_url=f"{server.url}/v1", api_key=API_KEY)
    return request.param(model_name, provider=provider)


@pytest.mark.parametrize("output", [ToolOutput, NativeOutput])
def test_pydantic_ai_output_of_a_nested_model(pai_model, output):
    agent = Agent(pai_model, output_type=output(Person), model_settings=SETTINGS)
    person = agent.run_sync(EXTRACT_PERSON).output
    assert person.age == 30 and person.address.city == "Paris"


@dataclass
class LookUpFirst(AbstractCapability):
    """The agent's first step calls the tool (the small model would rarely choose to); the
    next answers with the result in hand."""

    def get_model_settings(self):
        return lambda ctx: {"tool_choice": ["get_city"]} if ctx.run_step <= 1 else {}


@pytest.mark.parametrize("streamed", [False, True])
def test_pydantic_ai_agent_loop_sends_a_tool_result_back(pai_model, streamed):
    calls = []
    agent = Agent(
        pai_model,
        output_type=NativeOutput(Person),
        model_settings=SETTINGS,
        capabilities=[LookUpFirst()],
    )

    @agent.tool_plain
    def get_city(name: str) -> str:
        """The city a person lives in."""
        calls.append(name)
        return "Lyon, France"

    prompt = "Alice is 30. Where does she live? Give the person."

    async def run_streamed():
        async with agent.run_stream(prompt) as run:
            return await run.get_output()

    person = asyncio.run(run_streamed()) if streamed else agent.run_sync(prompt).output
    assert calls == ["Alice"]
    assert person.address.city == "Lyon" and person.age == 30  # read from the result


@pytest.mark.parametrize(
    ("tool_choice", "parts"),
    [
        ("auto", {"TextPart", "ToolCallPart"}),  # the model's choice
        ("required", {"ToolCallPart"}),
        ("none", {"TextPart"}),
    ],
)
def test_pydantic_ai_tool_choice(pai_model, tool_choice, parts):
    tool = ToolDefinition(
        name="get_city",
        description="The city a person lives in.",
        parameters_json_schema={
            "type": "object",
            "properties": {"name": {"type": "string"}},
            "required": ["name"],
        },
    )
    response = model_request_sync(
        pai_model,
        [ModelRequest.user_text_prompt("Where does Alice live? Use the tool.")],
        model_request_parameters=ModelRequestParameters(
            function_tools=[tool], allow_text_output=True
        ),
        model_settings={**SETTINGS, "tool_choice": tool_choice},
    )
    (part,) = response.parts
    assert type(part).__name__ in parts
    if isinstance(part, ToolCallPart):
        assert part.tool_name == "get_city" and part.args_as_dict()["name"]
