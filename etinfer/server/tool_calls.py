"""Tool calling: tools into the prompt, ``tool_choice`` into a constraint, calls out of text.

``tool_choice`` decides how the model's reply becomes calls, as vLLM does it:

- a named function: the output is constrained to that function's parameter schema, and the
  whole output is its arguments;
- ``"required"``: the output is constrained to a JSON array of ``{"name", "arguments"}``
  objects, each following one tool's schema (at most one with ``parallel_tool_calls: false``);
- ``"auto"`` (the default with tools): the model writes freely and its calls are parsed from
  the text by the chat template family's parser (Hermes' ``<tool_call>{json}</tool_call>``);
- ``"none"``: tools are neither shown nor parsed.

A template that knows tools renders them itself; for one that does not (SmolLM2's), the
tools go into a Hermes-style system message and earlier calls and results into text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from etinfer.server.errors import APIError
from etinfer.server.protocol import ChatMessage, NamedToolChoice, Tool
from etinfer.structured.params import StructuredOutputsParams
from etinfer.structured.schema_support import hoisted

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_SPACE = re.compile(r"\s*")
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_SYSTEM = (
    "You are a function calling AI model. You may call one or more functions to assist with "
    "the user query. Here are the available tools: <tools>{tools}</tools>\n"
    "For each function call, return a JSON object with the function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, '
    '"arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self, index: int | None = None) -> dict:
        entry = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return entry if index is None else {"index": index, **entry}


@dataclass
class ToolCalling:
    """How one request's replies become tool calls."""

    tools: list[Tool]
    mode: str  # "auto", "required" or "named"
    name: str | None = None  # the named function
    parallel: bool = True

    @classmethod
    def of(
        cls,
        tools: list[Tool] | None,
        choice: str | NamedToolChoice | None,
        parallel: bool | None,
    ) -> ToolCalling | None:
        if choice is not None and not tools and choice != "none":
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        if not tools or choice == "none":
            return None
        for i, tool in enumerate(tools):
            if tool.function.parameters is not None:
                try:
                    StructuredOutputsParams(json=tool.function.parameters)
                except ValueError as e:
                    raise APIError(400, str(e), param=f"tools[{i}].function.parameters") from e
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in tools]
            if choice.function.name not in names:
                raise APIError(
                    400,
                    f"tool_choice names {choice.function.name!r}, which is not among the "
                    f"tools ({', '.join(names)})",
                    param="tool_choice",
                )
            return cls(tools, "named", choice.function.name, parallel is not False)
        return cls(tools, choice or "auto", None, parallel is not False)

    def constraint(self) -> StructuredOutputsParams | None:
        if self.mode == "named":
            return StructuredOutputsParams(json=_parameters(self._tool(self.name)))
        if self.mode == "required":
            # Each tool's parameters are a definition of the list's root, their own $defs
            # beside them: references resolve from the root wherever the list puts them.
            defs: dict = {}
            calls = []
            for i, tool in enumerate(self.tools):
                defs.update(hoisted(_parameters(tool), f"tool{i}"))
                calls.append(_call_schema(tool, {"$ref": f"#/$defs/tool{i}"}))
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, "$defs": defs}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=schema)
        return None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The reply's content and calls, from its whole text."""
        if self.mode == "named":
            return None, [ToolCall(self.name, text)]
        if self.mode == "required":
            calls = [ToolCall(i["name"], json.dumps(i["arguments"])) for i in _whole_items(text)]
            return (None, calls) if calls else (text, [])
        return self._parse_hermes(text)

    def _parse_hermes(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(TOOL_CALL_START)
        if start < 0:
            return text, []
        names = {t.function.name for t in self.tools}
        calls = []
        for body in _HERMES_CALL.findall(text[start:]):
            try:
                call = json.loads(body)
                arguments = call.get("arguments", call.get("parameters", {}))
                if call["name"] not in names:
                    return text, []
            except (ValueError, TypeError, KeyError, AttributeError):
                return text, []  # not a call we can report: the text stays content
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            calls.append(ToolCall(call["name"], arguments))
        content = text[:start].strip()
        return content or None, calls

    def _tool(self, name: str | None) -> Tool:
        return next(t for t in self.tools if t.function.name == name)


def _parameters(tool: Tool) -> dict:
    return tool.function.parameters or {"type": "object"}


def _call_schema(tool: Tool, arguments: dict) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": arguments},
        "required": ["name", "arguments"],
    }


def _whole_items(text: str) -> list[dict]:
    """The complete call objects of a JSON array of calls (the grammar's), in order: all of
    them, or those written before ``max_tokens`` cut the array (a model sampling hot can list
    calls until the limit; the calls it finished are still calls)."""
    decoder, items = json.JSONDecoder(), []
    at = _SPACE.match(text).end()
    if not text.startswith("[", at):
        return []
    while True:
        try:
            item, at = decoder.raw_decode(text, _SPACE.match(text, at + 1).end())
        except ValueError:
            return items
        if not (isinstance(item, dict) and "name" in item and "arguments" in item):
            return items
        items.append(item)
        at = _SPACE.match(text, at).end()
        if not text.startswith(",", at):
            return items


class ToolCallStream:
    """One streamed choice's deltas under tool calling: text as content until a call begins,
    a named function's arguments as they are written, every other call once it is whole."""

    def __init__(self, calling: ToolCalling) -> None:
        self.calling = calling
        self.sent = 0  # characters of the text already sent (as content or arguments)
        self.call_id = f"call_{uuid.uuid4().hex[:24]}"
        self.calls = 0

    def delta(self, text: str, finished: bool) -> dict:
        if self.calling.mode == "named":
            piece, self.sent = text[self.sent :], len(text)
            if not piece and self.calls:
                return {}
            entry: dict = {"index": 0, "function": {"arguments": piece}}
            if not self.calls:
                self.calls = 1
                entry = ToolCall(self.calling.name, piece, self.call_id).as_dict(0)
            return {"tool_calls": [entry]}
        if not finished:
            if self.calling.mode == "required":
                return {}
            end = _content_end(text)
            piece, self.sent = text[self.sent : end], max(self.sent, end)
            return {"content": piece} if piece else {}
        content, calls = self.calling.parse(text)
        delta: dict = {}
        rest = (content or "")[self.sent :] if calls else text[self.sent :]
        if rest:
            delta["content"] = rest
        if calls:
            delta["tool_calls"] = [c.as_dict(i) for i, c in enumerate(calls)]
            self.calls = len(calls)
        self.sent = len(text)
        return delta


def _content_end(text: str) -> int:
    """How much of ``text`` is surely content: up to a call's start, holding back a tail that
    may be the start of one."""
    start = text.find(TOOL_CALL_START)
    if start >= 0:
        return start
    for keep in range(min(len(TOOL_CALL_START) - 1, len(text)), 0, -1):
        if TOOL_CALL_START.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


def template_messages(
    messages: list[ChatMessage], calling: ToolCalling | None, template_knows_tools: bool
) -> tuple[list[dict], list[dict] | None]:
    """The messages as the chat template takes them, and the tools to hand it (None: the
    tools went into a system message)."""
    tools = None if calling is None else [t.model_dump(exclude_none=True) for t in calling.tools]
    rendered = []
    for m in messages:
        # Chat templates of open models know "system"; "developer" is OpenAI's newer name.
        entry: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.text}
        if template_knows_tools:
            if m.tool_calls:
                entry["tool_calls"] = [
                    {"type": "function", "function": _template_call(c.function)}
                    for c in m.tool_calls
                ]
            if m.tool_call_id is not None:
                entry["tool_call_id"] = m.tool_call_id
        elif m.tool_calls:
            calls = "\n".join(
                f"{TOOL_CALL_START}\n{json.dumps(_template_call(c.function))}\n{TOOL_CALL_END}"
                for c in m.tool_calls
            )
            entry["content"] = f"{m.text}\n{calls}".strip()
        elif m.role == "tool":
            entry["content"] = f"<tool_response>\n{m.text}\n</tool_response>"
        rendered.append(entry)
    if tools is None or template_knows_tools:
        return rendered, tools
    system = _SYSTEM.format(tools=json.dumps(tools, ensure_ascii=False))
    if rendered and rendered[0]["role"] == "system":
        rendered[0] = {"role": "system", "content": f"{rendered[0]['content']}\n\n{system}"}
    else:
        rendered.insert(0, {"role": "system", "content": system})
    return rendered, None


def _template_call(function) -> dict:
    try:
        arguments = json.loads(function.arguments)
    except ValueError:
        arguments = function.arguments
    return {"name": function.name, "arguments": arguments}
