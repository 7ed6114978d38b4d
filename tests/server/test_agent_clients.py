"""Agent libraries, their real packages, against the server: the ``openai-agents`` SDK's tool
loop (a function tool called, its result sent back, a final answer) in its chat-completions
mode and its Responses mode, plain and streamed; ``langchain-openai``'s structured output and
bound tools, over chat completions and the Responses API."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.server.conftest import API_KEY, EXTRACT_PERSON, Person

agents = pytest.importorskip("agents")
langchain_openai = pytest.importorskip("langchain_openai")

from langchain_core.tools import tool  # noqa: E402


@pytest.fixture
def async_client(server) -> openai.AsyncOpenAI:
    """One per test: its connections belong to the event loop of the test's asyncio.run."""
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def weather_agent(model, calls: list[str]):
    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        calls.append(city)
        return f"Snowing and -3 degrees in {city}."

    # The call is forced at the first turn; the SDK then lets the model answer (it resets the
    # tool choice after a call).
    settings = agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=60)
    return agents.Agent(
        name="weather",
        instructions="Answer with the tools.",
        model=model,
        tools=[get_weather],
        model_settings=settings,
    )


@pytest.mark.parametrize("mode", ["OpenAIChatCompletionsModel", "OpenAIResponsesModel"])
@pytest.mark.parametrize("streamed", [False, True])
def test_openai_agents_tool_loop(async_client, model_name, mode, streamed):
    agents.set_tracing_disabled(True)
    calls: list[str] = []
    model = getattr(agents, mode)(model=model_name, openai_client=async_client)
    agent = weather_agent(model, calls)

    async def run():
        if not streamed:
            return await agents.Runner.run(agent, "What is the weather in Paris?")
        result = agents.Runner.run_streamed(agent, "What is the weather in Paris?")
        kinds = {event.type async for event in result.stream_events()}
        assert "raw_response_event" in kinds
        return result

    result = asyncio.run(run())
    assert calls == ["Paris"]
    items = [item.type for item in result.new_items]
    assert items[:2] == ["tool_call_item", "tool_call_output_item"]
    assert items[-1] == "message_output_item"
    # The answer reads the tool's result (the small model paraphrases it).
    assert any(word in result.final_output.lower() for word in ("snow", "-3", "cold"))


@pytest.fixture(scope="module", params=[False, True], ids=["chat", "responses"])
def chat_model(request, server, model_name):
    return langchain_openai.ChatOpenAI(
        model=model_name,
        base_url=f"{server.url}/v1",
        api_key=API_KEY,
        temperature=0,
        max_retries=0,
        max_tokens=200,
        use_responses_api=request.param,
    )


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output(chat_model, method):
    person = chat_model.with_structured_output(Person, method=method).invoke(EXTRACT_PERSON)
    assert person.age == 30 and person.address.city == "Paris"


@pytest.mark.parametrize("tool_choice", ["get_weather", "any"])
def test_langchain_bound_tools(chat_model, tool_choice):
    @tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        return "sunny"

    message = chat_model.bind_tools([get_weather], tool_choice=tool_choice).invoke(
        "What is the weather in Paris?"
    )
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Paris"}


def test_langchain_text(chat_model):
    message = chat_model.invoke("Name a colour.")
    assert message.text
