"""The Responses API in terms of chat completions: a request becomes the chat request it means
(the same checks, prompt, grammar and engine path), a finished chat choice becomes output items,
and a chat error names the Responses request's own fields."""

from __future__ import annotations

import re
import uuid

from etinfer.server.errors import APIError
from etinfer.server.protocol import (
    EXTENSION_FIELDS,
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCallMessage,
)
from etinfer.server.responses_api.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    NamedFunctionChoice,
    ResponsesRequest,
)

# A chat request's field, as the Responses request names it (a regular expression over the
# error's ``param`` and the same words in its message).
_RESPONSES_NAMES = (
    (re.compile(r"\bmessages\b(\[\d+\])?"), "input"),
    (re.compile(r"\bmax_completion_tokens\b|\bmax_tokens\b"), "max_output_tokens"),
    (re.compile(r"\bresponse_format\b(\.json_schema)?"), "text.format"),
    (re.compile(r"\btools\[(\d+)\]\.function\."), r"tools[\1]."),
)


def chat_request(request: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion a Responses request asks for."""
    tool_choice = request.tool_choice
    if isinstance(tool_choice, NamedFunctionChoice):
        named = NamedFunction(name=tool_choice.name)
        tool_choice = NamedToolChoice(type="function", function=named)
    tools = None
    if request.tools is not None:
        tools = [
            Tool(
                type="function",
                function=FunctionDefinition(
                    name=tool.name,
                    description=tool.description,
                    parameters=tool.parameters,
                    strict=tool.strict,
                ),
            )
            for tool in request.tools
        ]
    extensions = {
        name: getattr(request, name)
        for name in EXTENSION_FIELDS
        if getattr(request, name) is not None
    }
    return ChatCompletionRequest(
        model=request.model,
        messages=chat_messages(request),
        max_completion_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        stream=request.stream,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=request.parallel_tool_calls,
        response_format=_response_format(request),
        priority=request.priority,
        slo=request.slo,
        **extensions,
    )


def chat_messages(request: ResponsesRequest) -> list[ChatMessage]:
    """The conversation: instructions first, then the items in order; an earlier turn's
    calls join the assistant message before them, as a chat template expects."""
    messages = []
    if request.instructions:
        messages.append(ChatMessage(role="system", content=request.instructions))
    items = request.input
    if isinstance(items, str):
        items = []
        messages.append(ChatMessage(role="user", content=request.input))
    for item in items:
        if isinstance(item, FunctionCallItem):
            call = ToolCallMessage(
                id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ChatMessage(role="tool", content=item.text, tool_call_id=item.call_id))
        else:
            messages.append(ChatMessage(role=item.role, content=item.text))
    if not messages:
        raise APIError(400, "input must hold at least one item", param="input")
    return messages


def _response_format(request: ResponsesRequest) -> ResponseFormat | None:
    form = request.text.format if request.text is not None else None
    if form is None or form.type == "text":
        return None
    if form.type == "json_object":
        return ResponseFormat(type="json_object")
    if form.name is None:
        raise APIError(400, "text.format.name is required for json_schema", param="text.format")
    schema = JsonSchemaFormat(
        name=form.name, description=form.description, schema=form.schema_, strict=form.strict
    )
    return ResponseFormat(type="json_schema", json_schema=schema)


def responses_error(error: APIError) -> APIError:
    """``error`` of the chat path, naming the Responses request's fields."""
    param, message = error.param, error.message
    for pattern, name in _RESPONSES_NAMES:
        if param is not None:
            param = pattern.sub(name, param)
        message = pattern.sub(name, message)
    error.param, error.message = param, message
    return error


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, item_id: str, status: str = "completed") -> dict:
    content = [] if status == "in_progress" else [output_text(text)]
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(
    call: dict, item_id: str, arguments: str | None = None, status: str = "completed"
) -> dict:
    """A chat tool call (``{"id", "function": {"name", "arguments"}}``) as an output item."""
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"] if arguments is None else arguments,
        "status": status,
    }


def output_items(message: dict) -> list[dict]:
    """A finished chat message as output items: its text, then each call."""
    items = []
    if message.get("content") or not message.get("tool_calls"):
        items.append(message_item(message.get("content") or "", new_id("msg")))
    for call in message.get("tool_calls") or []:
        items.append(function_call_item(call, new_id("fc")))
    return items


def response_usage(chat_usage: dict) -> dict:
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": chat_usage["prompt_tokens_details"],
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def status_of(finish_reason: str | None) -> tuple[str, dict | None]:
    """The response's status and ``incomplete_details`` for how its choice ended."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None
