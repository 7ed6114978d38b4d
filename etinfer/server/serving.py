"""Completions and chat completions: validate, submit to the engine loop, answer or stream.

Everything a request can get wrong is found before it is queued, so a 400 never leaves work
behind; once queued, the request is aborted (its KV blocks freed) whenever its client goes away.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from etinfer.outputs import RequestOutput
from etinfer.sampling_params import SamplingParams
from etinfer.server.engine_loop import (
    EngineError,
    EngineLoop,
    EngineRequest,
    QueueFull,
    RequestGroup,
)
from etinfer.server.errors import APIError, invalid_value
from etinfer.server.limits import check_lists
from etinfer.server.playground import control_layers
from etinfer.server.prompts import EncodedPrompt, PromptEncoder
from etinfer.server.protocol import (
    DEFAULT_COMPLETION_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
)
from etinfer.server.responses import ChatFormat, CompletionFormat, Cursor, advance, usage

# A request's SamplingParams field names, as the request spells them.
FIELDS = {f.name: f.name for f in dataclasses.fields(SamplingParams)}
MAX_SEED = 2**63


def _dumps(body: dict) -> str:
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
        self._check(request)
        prompts = self.encoder.completion_prompts(request.prompt)
        self._check_choices(len(prompts) * request.n)
        max_tokens = request.max_tokens
        if max_tokens is None:
            max_tokens = DEFAULT_COMPLETION_TOKENS
        params = self._params(request, max_tokens, request.logprobs, FIELDS)
        encoded = await self.encoder.encode_completion(prompts)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        requests = self._engine_requests(request_id, encoded, params, request, arrival)
        return await self._answer(
            request,
            raw,
            request_id,
            requests,
            CompletionFormat(request.logprobs, request.return_attention_entropy),
        )

    async def chat(self, request: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.perf_counter()
        self._check(request)
        self._check_choices(request.n)
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
        params = self._params(request, max_tokens, logprobs, fields)
        ids = await self.encoder.encode_chat([m.as_template_message() for m in request.messages])
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        requests = self._engine_requests(
            request_id,
            [(None, ids)],
            params,
            request,
            arrival,
            max_tokens_param=fields["max_tokens"],
            to_context_end=max_tokens is None,
        )
        chat = ChatFormat(logprobs, request.return_attention_entropy)
        return await self._answer(request, raw, request_id, requests, chat)

    # -- validation -----------------------------------------------------------------------

    def _check(self, request: GenerationRequest) -> None:
        if request.model is not None and request.model != self.model_name:
            raise APIError(
                400,
                f"The model `{request.model}` does not exist; this server serves "
                f"`{self.model_name}`",
                param="model",
                code="model_not_found",
            )
        name = request.unsupported_field()
        if name is not None:
            raise APIError(
                400, f"{name} is not supported", param=name, code="unsupported_parameter"
            )
        if request.stream_options is not None and not request.stream:
            raise APIError(
                400, "stream_options is only allowed when stream is true", param="stream_options"
            )
        check_lists(request)

    def _check_choices(self, count: int) -> None:
        """Before any prompt is tokenized: a request with more choices than the queue holds
        could never be accepted."""
        if count > self.loop.max_waiting_requests:
            raise APIError(
                400,
                f"the request has {count} choices (prompts times n) but the server queues at "
                f"most {self.loop.max_waiting_requests}",
                param="n",
            )

    @staticmethod
    def _params(
        request: GenerationRequest,
        max_tokens: int | None,
        logprobs: int | None,
        fields: dict[str, str],
    ) -> SamplingParams:
        # Without max_tokens the limit depends on each prompt's length; 1 stands in for now.
        try:
            return request.sampling_params(1 if max_tokens is None else max_tokens, logprobs)
        except ValueError as e:
            raise invalid_value(e, fields) from e

    def _engine_requests(
        self,
        request_id: str,
        prompts: list[EncodedPrompt],
        params: SamplingParams,
        request: GenerationRequest,
        arrival: float,
        *,
        max_tokens_param: str = "max_tokens",
        to_context_end: bool = False,
    ) -> list[EngineRequest]:
        """One engine request per choice (``request.n`` per prompt), each with the request's
        scheduling fields. Each prompt already fits the context (the encoder checked);
        ``to_context_end``: no max_tokens was given, so each may generate up to its end.
        Together the choices must fit the KV pool: one request may not claim more than the
        whole pool, preempting everyone else."""
        validator = self.engine.validator
        limit = self.engine.max_model_len
        requests = []
        blocks = 0
        for p, (text, ids) in enumerate(prompts):
            length = len(ids)
            prompt_params = params
            if to_context_end:
                prompt_params = dataclasses.replace(params, max_tokens=limit - length)
            elif length + params.max_tokens > limit:
                raise APIError(
                    400,
                    f"This model's maximum context length is {limit} tokens. However, you "
                    f"requested {length + params.max_tokens} tokens ({length} in the prompt, "
                    f"{params.max_tokens} for the completion). Lower {max_tokens_param} or "
                    f"shorten the prompt.",
                    param=max_tokens_param,
                    code="context_length_exceeded",
                )
            try:
                validator.check_request(ids, prompt_params)
            except ValueError as e:
                raise APIError(400, str(e), param=max_tokens_param) from e
            blocks += request.n * validator.blocks_needed(length, prompt_params.max_tokens)
            for i in range(request.n):
                choice_params = prompt_params
                if params.seed is not None and i:
                    # Distinct draws per choice, reproducible from the one seed.
                    choice_params = dataclasses.replace(
                        prompt_params, seed=(params.seed + i) % MAX_SEED
                    )
                requests.append(
                    EngineRequest(
                        f"{request_id}-{p}-{i}",
                        text,
                        ids,
                        choice_params,
                        arrival,
                        priority=request.priority,
                        slo=request.slo,
                    )
                )
        pool = self.engine.kv.pool.num_blocks
        if blocks > pool:
            # Counted without prefix sharing: choices admitted in the same step share nothing.
            raise APIError(
                400,
                f"the request's {len(requests)} choices ({len(prompts)} prompts x n={request.n}) "
                f"need {blocks} KV blocks at their longest (prompt + {max_tokens_param}) but the "
                f"pool holds {pool}; lower n or {max_tokens_param}, or send fewer prompts",
                param="n" if request.n > 1 else max_tokens_param,
            )
        return requests

    # -- running --------------------------------------------------------------------------

    async def _answer(
        self,
        request: GenerationRequest,
        raw: Request,
        request_id: str,
        requests: list[EngineRequest],
        fmt: CompletionFormat | ChatFormat,
    ) -> Response:
        try:
            group = self.loop.submit(requests)
        except QueueFull as e:
            # Too many requests, as OpenAI answers: its clients retry after Retry-After.
            raise APIError(429, str(e), code="queue_full", headers={"Retry-After": "1"}) from e
        except EngineError as e:
            raise APIError(503, str(e), code="engine_unavailable") from e
        header = {
            "id": request_id,
            "created": int(time.time()),
            "model": self.model_name,
        }
        if request.stream:
            return StreamingResponse(
                self._stream(group, fmt, header, request.n, request.include_usage),
                media_type="text/event-stream",
            )
        try:
            outputs = await _until_done_or_gone(group, raw)
        finally:
            self.loop.abort(group)  # the client left, or we failed: free its blocks
        if outputs is None:
            # Nobody reads this; 499 is what proxies log for a client that closed first.
            return JSONResponse({}, status_code=499)
        choices = [
            fmt.choice(i, out, cursor := Cursor(), advance(cursor, out, every_token=True))
            for i, out in enumerate(outputs)
        ]
        return JSONResponse(
            {**header, "object": fmt.object, "choices": choices, "usage": usage(outputs, request.n)}
        )

    async def _stream(
        self,
        group: RequestGroup,
        fmt: CompletionFormat | ChatFormat,
        header: dict,
        n: int,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        """Server-sent events; a client that disconnects cancels this generator, which aborts
        its requests (the finally clause)."""
        chunk = {**header, "object": fmt.chunk_object}
        if include_usage:
            chunk["usage"] = None
        cursors = [Cursor() for _ in group.request_ids]
        try:
            opening = fmt.opening_chunk_choices(len(cursors))
            if opening:
                yield f"data: {_dumps({**chunk, 'choices': opening})}\n\n"
            try:
                async for fresh in group.updates():
                    choices = []
                    for i in fresh:
                        out = group.outputs[i]
                        delta = advance(cursors[i], out, every_token=fmt.with_logprobs)
                        if delta is not None:
                            choices.append(fmt.chunk_choice(i, out, cursors[i], delta))
                    if choices:
                        yield f"data: {_dumps({**chunk, 'choices': choices})}\n\n"
            except EngineError as e:
                error = APIError(500, str(e), code="engine_error")
                yield f"data: {_dumps(error.body())}\n\n"
            else:
                if include_usage:
                    body = {**chunk, "choices": [], "usage": usage(group.outputs, n)}
                    yield f"data: {_dumps(body)}\n\n"
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
