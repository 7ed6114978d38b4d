"""``POST /v1/responses``: a Responses request runs as the chat completion it means (the same
checks, chat template, tool calling, grammars and engine requests) and is answered in the
Responses API's shapes, whole or as its stream of typed events."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from etinfer.outputs import RequestOutput
from etinfer.server.engine_loop import EngineError, RequestGroup
from etinfer.server.errors import APIError
from etinfer.server.formats import ChatFormat, telemetry, whole_delta
from etinfer.server.formats import usage as chat_usage
from etinfer.server.responses_api.events import ResponseEvents
from etinfer.server.responses_api.protocol import ResponsesRequest
from etinfer.server.responses_api.translate import (
    chat_request,
    new_id,
    output_items,
    response_usage,
    responses_error,
    status_of,
)
from etinfer.server.serving import OpenAIServing, Prepared, dumps


class ResponsesServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, request: ResponsesRequest, raw: Request) -> Response:
        try:
            prepared = await self.serving.prepare_chat(chat_request(request))
            group = self.serving.submit(prepared.requests)
        except APIError as e:
            raise responses_error(e) from e
        body = self._skeleton(request)
        if request.stream:
            events = ResponseEvents(body)
            return StreamingResponse(
                self._stream(group, prepared, events), media_type="text/event-stream"
            )
        outputs = await self.serving.finished(group, raw)
        if outputs is None:
            return JSONResponse({}, status_code=499)  # nobody reads it
        choice = self.serving.whole_choices(prepared.fmt, outputs)[0]
        body.update(_ending(outputs, prepared.fmt), output=output_items(choice["message"]))
        return JSONResponse(body)

    async def _stream(
        self, group: RequestGroup, prepared: Prepared, events: ResponseEvents
    ) -> AsyncIterator[str]:
        """Server-sent events, each named by its type; a client that goes away cancels this
        generator, which aborts the request (the finally clause)."""
        fmt = prepared.fmt
        try:
            for event in events.start():
                yield _sse(event)
            try:
                async for choices in self.serving.chunk_choices(group, fmt):
                    for event in events.delta(choices[0]["delta"]):
                        yield _sse(event)
            except EngineError as e:
                yield _sse(events.error("engine_error", str(e)))
                return
            for event in events.finish(_ending(group.outputs, fmt)):
                yield _sse(event)
        finally:
            self.serving.loop.abort(group)

    def _skeleton(self, request: ResponsesRequest) -> dict:
        """The response's fields that do not depend on what the model writes."""
        tool_choice = request.tool_choice or ("auto" if request.tools else "none")
        text_format = {"type": "text"}
        if request.text is not None and request.text.format is not None:
            text_format = request.text.format.model_dump(by_alias=True, exclude_none=True)
        return {
            "id": new_id("resp"),
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "model": self.serving.model_name,
            "output": [],
            "error": None,
            "incomplete_details": None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {},
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "tool_choice": tool_choice
            if isinstance(tool_choice, str)
            else tool_choice.model_dump(),
            "tools": [tool.model_dump() for tool in request.tools or []],
            "text": {"format": text_format},
            "truncation": "disabled",
            "store": False,
            "usage": None,
        }


def _ending(outputs: list[RequestOutput], fmt: ChatFormat) -> dict:
    """The finished response's fields that its one choice decides: status, usage, telemetry."""
    out = outputs[0]
    status, incomplete = status_of(out.finish_reason)
    return {
        "status": status,
        "incomplete_details": incomplete,
        "usage": response_usage(chat_usage(outputs, 1)),
        "etinfer": telemetry(out, whole_delta(out), fmt.attention_entropy),
    }


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {dumps(event)}\n\n"
