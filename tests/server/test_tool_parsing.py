"""The Hermes tool-call parser and its streaming, on text a model could write (mechanics: the
real model's calls are checked in test_structured_server.py)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string as accepts

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


def test_required_mode_returns_the_calls_written_before_a_cut():
    """A reply cut by max_tokens inside its array of calls still returns the whole calls."""
    calling = ToolCalling.of(TOOLS, "required", None)
    call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    for text, count in (
        (f"[{call}]", 1),
        (f" [ {call} ,\n {call} ]", 2),
        (f"[{call}, {call}, {call[:30]}", 2),
        (f"[{call}", 1),
        (f"[{call[:12]}", 0),
        ("", 0),
    ):
        content, calls = calling.parse(text)
        assert len(calls) == count, text
        assert all(json.loads(c.arguments) == {"city": "Oslo"} for c in calls)
        assert content == (None if count else text)


# What Pydantic writes for a model with a nested one (pydantic-ai's output tool sends it so).
NESTED = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "address": {"$ref": "#/$defs/Address"}},
    "required": ["name", "address"],
    "$defs": {
        "Address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "next": {"$ref": "#/$defs/Address"}},
            "required": ["city"],
        }
    },
}


def test_required_mode_keeps_each_tools_defs_in_the_call_list():
    """Two tools whose parameters define the same name: each call's arguments follow its own
    tool's definitions, recursive ones included, wherever the list places them."""
    other = {
        "type": "object",
        "properties": {"address": {"$ref": "#/$defs/Address"}},
        "$defs": {"Address": {"type": "integer"}},
    }
    tools = [
        Tool.model_validate({"type": "function", "function": {"name": n, "parameters": p}})
        for n, p in (("save", NESTED), ("count", other))
    ]
    schema = ToolCalling.of(tools, "required", None).constraint().json
    valid = [
        {
            "name": "save",
            "arguments": {"name": "a", "address": {"city": "x", "next": {"city": "y"}}},
        },
        {"name": "count", "arguments": {"address": 3}},
    ]
    jsonschema.validate(valid, schema)
    for wrong in (
        [{"name": "save", "arguments": {"name": "a", "address": 3}}],
        [{"name": "save", "arguments": {"name": "a", "address": {"city": "x", "next": {}}}}],
        [{"name": "count", "arguments": {"address": {"city": "x"}}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True)
    assert accepts(grammar, json.dumps(valid))
    assert not accepts(grammar, json.dumps([{"name": "count", "arguments": {"address": "x"}}]))
