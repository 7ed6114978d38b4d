"""The Hermes tool-call parser and its streaming, on text a model could write (mechanics: the
real model's calls are checked in test_structured_server.py)."""

from __future__ import annotations

import json

from etinfer.server.protocol import Tool
from etinfer.server.tool_calls import ToolCalling, ToolCallStream, template_messages

TOOLS = [
    Tool.model_validate(
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    )
]
REPLY = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Bergen"}}</tool_call>'
)


def test_auto_mode_parses_hermes_calls_and_keeps_the_content():
    calling = ToolCalling.of(TOOLS, "auto", None)
    content, calls = calling.parse(REPLY)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_weather", {"city": "Bergen"}),
    ]
    assert calling.parse("No tools needed.") == ("No tools needed.", [])
    # A call to an unknown function, or one that does not parse, stays text.
    for text in ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', "<tool_call>{oops"):
        assert calling.parse(text) == (text, [])


def test_streaming_holds_back_a_possible_call_start_and_ends_with_whole_calls():
    stream = ToolCallStream(ToolCalling.of(TOOLS, "auto", None))
    sent, calls = "", []
    for end in range(1, len(REPLY) + 1):
        delta = stream.delta(REPLY[:end], finished=end == len(REPLY))
        sent += delta.get("content", "")
        calls += delta.get("tool_calls", [])
        assert "<" not in sent  # never a piece of the call markup as content
    assert sent == "Let me check.\n"
    assert [c["index"] for c in calls] == [0, 1]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Bergen"}
    plain = ToolCallStream(ToolCalling.of(TOOLS, "auto", None))
    text = "Sunny <b>today</b>"
    pieces = [plain.delta(text[:e], finished=e == len(text)) for e in range(1, len(text) + 1)]
    assert "".join(p.get("content", "") for p in pieces) == text


def test_a_template_without_tools_gets_them_in_a_system_message():
    calling = ToolCalling.of(TOOLS, "auto", None)
    from etinfer.server.protocol import ChatMessage

    messages = [ChatMessage(role="user", content="Weather?")]
    rendered, tools = template_messages(messages, calling, template_knows_tools=False)
    assert tools is None
    assert rendered[0]["role"] == "system" and "get_weather" in rendered[0]["content"]
    rendered, tools = template_messages(messages, calling, template_knows_tools=True)
    assert tools[0]["function"]["name"] == "get_weather" and rendered[0]["role"] == "user"
    assert ToolCalling.of(TOOLS, "none", None) is None
