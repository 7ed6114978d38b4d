"""Completions and chat completions: validate, submit to the engine loop, answer or stream.

Everything a request can get wrong is found before it is queued, so a 400 never leaves work
behind; once queued, the request is aborted (its KV blocks freed) whenever its client goes away.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from etinfer.outputs import RequestOutput
from etinfer.server.admission import (
    FIELDS,
    check_choices,
    check_echo,
    check_request,
    engine_requests,
    sampling_params,
)
from etinfer.server.engine_loop import (
    EngineError,
    EngineLoop,
    EngineRequest,
    QueueFull,
    RequestGroup,
)
from etinfer.server.errors import APIError
from etinfer.server.formats import (
    ChatFormat,
    CompletionFormat,
    Cursor,
    advance,
    usage,
    whole_delta,
)
from etinfer.server.playground import control_layers
from etinfer.server.prompts import PromptEncoder
from etinfer.server.protocol import (
    DEFAULT_COMPLETION_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
)
from etinfer.server.structured_outputs import (
    compiled,
    constraint_params,
    requested_constraint,
    with_constraint,
)
from etinfer.server.tool_calls import ToolCalling, template_messages

Format = CompletionFormat | ChatFormat


@dataclass
class Prepared:
    """A checked request's engine requests (one per choice), not yet queued."""

    request_id: str
    requests: list[EngineRequest]
    fmt: Format


def dumps(body: dict) -> str:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


class OpenAIServing:
    def __init__(self, loop: EngineLoop, encoder: PromptEncoder, model_name: str) -> None:
        self.loop = loop
        self.engine = loop.engine
        self.encoder = encoder
        self.model_name = model_name
        self.created = int(time.time())

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "etinfer",
                    "max_model_len": self.engine.max_model_len,
                    "etinfer": {"control": control_layers(self.engine.config)},
                }
            ],
        }

    # -- endpoints ------------------------------------------------------------------------

    async def completions(self, request: CompletionRequest, raw: Request) -> Response:
        arrival = time.perf_counter()
        check_request(request, self.model_name)
        prompts = self.encoder.completion_prompts(request.prompt)
        check_choices(len(prompts) * request.n, self.loop.max_waiting_requests)
        max_tokens = request.max_tokens
        if max_tokens is None:
            max_tokens = DEFAULT_COMPLETION_TOKENS
        check_echo(request)
        # Nothing to generate (echo alone): one token is computed and not reported.
        prompt_only = max_tokens == 0
        scored = request.prompt_logprobs
        if scored is None and request.echo:
            scored = request.logprobs  # the echoed prompt's logprobs, as many as the output's
        computed = 1 if prompt_only else max_tokens
        params = sampling_params(request, computed, request.logprobs, FIELDS, scored)
        params = await self._constrained(request, params, None)
        encoded = await self.encoder.encode_completion(prompts)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        requests = engine_requests(self.engine, request_id, encoded, params, request, arrival)
        tokenizer = self.engine.tokenizer
        fmt = CompletionFormat(
            request.logprobs,
            request.return_attention_entropy,
            echo=tokenizer if request.echo else None,
            prompt_logprobs=request.prompt_logprobs is not None,
            prompt_only=prompt_only,
        )
        return await self._answer(request, raw, Prepared(request_id, requests, fmt))

    async def chat(self, request: ChatCompletionRequest, raw: Request) -> Response:
        return await self._answer(request, raw, await self.prepare_chat(request))

    async def prepare_chat(self, request: ChatCompletionRequest) -> Prepared:
        """Every check of a chat request, its prompt encoded and its engine requests built;
        nothing queued yet (the Responses API runs its requests through here too)."""
        arrival = time.perf_counter()
        check_request(request, self.model_name)
        check_choices(request.n, self.loop.max_waiting_requests)
        fields = dict(FIELDS, logprobs="top_logprobs")
        max_tokens = request.max_tokens
        if request.max_completion_tokens is not None:
            if max_tokens is not None and max_tokens != request.max_completion_tokens:
                raise APIError(
                    400,
                    "max_tokens and max_completion_tokens disagree; set only one",
                    param="max_completion_tokens",
                )
            max_tokens = request.max_completion_tokens
            fields["max_tokens"] = "max_completion_tokens"
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = sampling_params(request, max_tokens, logprobs, fields)
        tools = ToolCalling.of(request.tools, request.tool_choice, request.parallel_tool_calls)
        params = await self._constrained(request, params, tools)
        messages, template_tools = template_messages(
            request.messages, tools, self.engine.tokenizer.template_knows_tools
        )
        ids = await self.encoder.encode_chat(messages, template_tools)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        requests = engine_requests(
            self.engine,
            request_id,
            [(None, ids)],
            params,
            request,
            arrival,
            max_tokens_param=fields["max_tokens"],
            to_context_end=max_tokens is None,
        )
        chat = ChatFormat(logprobs, request.return_attention_entropy, tools)
        return Prepared(request_id, requests, chat)

    async def _constrained(self, request: GenerationRequest, params, tools: ToolCalling | None):
        """``params`` with the request's output constraint (its structured-output fields, or
        the tool choice's), once compiled; a 400 naming the field when it cannot be."""
        asked = requested_constraint(request)
        constraint = None if tools is None else tools.constraint()
        if asked is not None and constraint is not None and asked[0].startswith("response_format"):
            # OpenAI's response_format shapes the reply's text, and a forced call (named or
            # required) writes none: the call's schema is the one constraint (instructor's
            # Responses mode sends both, the same schema twice).
            asked = None
        if asked is not None and constraint is not None:
            raise APIError(
                400, f"{asked[0]} and tool_choice both constrain the output", param=asked[0]
            )
        param = "tools"
        if asked is not None:
            param, fields = asked
            constraint = constraint_params(param, fields)
        params = with_constraint(params, constraint)
        await compiled(self.engine.grammars.compiler, params, param)
        return params

    # -- running --------------------------------------------------------------------------

    def submit(self, requests: list[EngineRequest]) -> RequestGroup:
        try:
            return self.loop.submit(requests)
        except QueueFull as e:
            # Too many requests, as OpenAI answers: its clients retry after Retry-After.
            raise APIError(429, str(e), code="queue_full", headers={"Retry-After": "1"}) from e
        except EngineError as e:
            raise APIError(503, str(e), code="engine_unavailable") from e

    async def finished(self, group: RequestGroup, raw: Request) -> list[RequestOutput] | None:
        """The group's final outputs, or None if the client went away first (its requests
        are aborted, their blocks freed)."""
        try:
            return await _until_done_or_gone(group, raw)
        finally:
            self.loop.abort(group)  # the client left, or we failed: free its blocks

    @staticmethod
    def whole_choices(fmt: Format, outputs: list[RequestOutput]) -> list[dict]:
        return [fmt.choice(i, out, Cursor(), whole_delta(out)) for i, out in enumerate(outputs)]

    async def chunk_choices(self, group: RequestGroup, fmt: Format) -> AsyncIterator[list[dict]]:
        """The streamed choices of each update: what each step added to each choice. Raises
        ``EngineError`` if the engine could not run them."""
        cursors = [Cursor() for _ in group.request_ids]
        async for fresh in group.updates():
            choices = []
            for i in fresh:
                out = group.outputs[i]
                delta = advance(cursors[i], out, every_token=fmt.with_logprobs)
                if delta is not None:
                    choices.append(fmt.chunk_choice(i, out, cursors[i], delta))
            if choices:
                yield choices

    async def _answer(
        self, request: GenerationRequest, raw: Request, prepared: Prepared
    ) -> Response:
        group = self.submit(prepared.requests)
        fmt = prepared.fmt
        header = {
            "id": prepared.request_id,
            "created": int(time.time()),
            "model": self.model_name,
        }
        if request.stream:
            return StreamingResponse(
                self._stream(group, fmt, header, request.n, request.include_usage),
                media_type="text/event-stream",
            )
        outputs = await self.finished(group, raw)
        if outputs is None:
            # Nobody reads this; 499 is what proxies log for a client that closed first.
            return JSONResponse({}, status_code=499)
        outputs = [fmt.reported(out) for out in outputs]
        choices = self.whole_choices(fmt, outputs)
        return JSONResponse(
            {**header, "object": fmt.object, "choices": choices, "usage": usage(outputs, request.n)}
        )

    async def _stream(
        self, group: RequestGroup, fmt: Format, header: dict, n: int, include_usage: bool
    ) -> AsyncIterator[str]:
        """Server-sent events; a client that disconnects cancels this generator, which aborts
        its requests (the finally clause)."""
        chunk = {**header, "object": fmt.chunk_object}
        if include_usage:
            chunk["usage"] = None
        try:
            opening = fmt.opening_chunk_choices(len(group.request_ids))
            if opening:
                yield f"data: {dumps({**chunk, 'choices': opening})}\n\n"
            try:
                async for choices in self.chunk_choices(group, fmt):
                    yield f"data: {dumps({**chunk, 'choices': choices})}\n\n"
            except EngineError as e:
                error = APIError(500, str(e), code="engine_error")
                yield f"data: {dumps(error.body())}\n\n"
            else:
                if include_usage:
                    body = {**chunk, "choices": [], "usage": usage(group.outputs, n)}
                    yield f"data: {dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.loop.abort(group)


async def _until_done_or_gone(group: RequestGroup, raw: Request) -> list[RequestOutput] | None:
    """The group's final outputs, or None if the client disconnected first."""

    async def finish() -> None:
        async for _ in group.updates():
            pass

    async def disconnect() -> None:
        # The body has been read, so the next message is the disconnect (vLLM does the same).
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    done_task = asyncio.ensure_future(finish())
    gone_task = asyncio.ensure_future(disconnect())
    try:
        await asyncio.wait({done_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        done_task.cancel()
        gone_task.cancel()
    if done_task.done() and not done_task.cancelled():
        try:
            done_task.result()
        except EngineError as e:
            raise APIError(500, str(e), code="engine_error") from e
        return list(group.outputs)
    return None
