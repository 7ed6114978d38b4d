"""The OpenAI endpoint in front of the engine replicas.

It checks what the single server checks before a body is parsed (API key, body size) and the
body's shape (FastAPI and our pydantic models, so a bad field gets the same 400), then hands
the request's JSON to an engine replica through a deployment handle, where the router picks
the replica. The replica's answer comes back as it would from a single server.

A replica that dies before it answered is no loss: nothing reached the client, so the request
is sent again (Serve routes it to a live replica). One that dies mid-stream ends the stream
with an error event in OpenAI's shape; a whole answer that cannot be had becomes a 503.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from etinfer.cluster import metrics
from etinfer.server.app import guard
from etinfer.server.errors import APIError
from etinfer.server.limits import default_max_request_bytes
from etinfer.server.playground import add_playground
from etinfer.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from etinfer.server.responses_api import ResponsesRequest

# Sends of one request before a 503: each failed one lost a replica that had not answered.
MAX_ATTEMPTS = 3
HEALTH_TIMEOUT_S = 10.0


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


class OpenAIIngress:
    def __init__(
        self,
        engines: DeploymentHandle,
        api_key: str | None,
        max_request_bytes: int | None,
    ) -> None:
        self.engines = engines
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.board = metrics.board()

    async def __serve_build_asgi_app__(self) -> FastAPI:
        limit = self.max_request_bytes
        if limit is None:
            info = await self.engines.limits_info.remote()
            limit = default_max_request_bytes(info["max_model_len"], info["max_token_bytes"])
        app = FastAPI(title="etinfer")
        guard(app, self.api_key, limit)
        add_playground(app)

        @app.get("/health")
        async def health() -> Response:
            try:
                await asyncio.wait_for(self.engines.check_health.remote(), HEALTH_TIMEOUT_S)
            except Exception as e:
                raise APIError(
                    503, f"no engine replica answers: {e}", code="engine_unavailable"
                ) from e
            return Response(status_code=200)

        @app.get("/metrics")
        async def prometheus() -> Response:
            texts = await self.board.snapshot.remote()
            body = metrics.merged_exposition(texts, metrics.ROUTER_METRICS)
            return Response(body, media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models() -> dict:
            return await self.engines.models.remote()

        @app.post("/v1/completions")
        async def completions(request: CompletionRequest, raw: Request) -> Response:
            return await self.forward("completions", raw)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: ChatCompletionRequest, raw: Request) -> Response:
            return await self.forward("chat", raw)

        @app.post("/v1/responses")
        async def responses(request: ResponsesRequest, raw: Request) -> Response:
            return await self.forward("responses", raw)

        # The tokenizer's endpoints: any replica answers (each holds the same tokenizer).
        @app.post("/tokenize")
        async def tokenize(request: TokenizeRequest) -> Response:
            return await self.tokenizer_call("/tokenize", request.model_dump())

        @app.post("/detokenize")
        async def detokenize(request: DetokenizeRequest) -> Response:
            return await self.tokenizer_call("/detokenize", request.model_dump())

        @app.get("/tokenizer_info")
        async def tokenizer_info() -> Response:
            return await self.tokenizer_call("/tokenizer_info", None)

        return app

    async def tokenizer_call(self, path: str, body: dict | None) -> Response:
        status, answer = await self.engines.tokenizer_call.remote(path, body)
        return JSONResponse(answer, status_code=status)

    async def forward(self, kind: str, raw: Request) -> Response:
        """The request's JSON (checked by the route's model) to a replica; its answer back."""
        body = json.loads(await raw.body())
        for _ in range(MAX_ATTEMPTS):
            events = self.engines.options(stream=True).generate.remote(kind, body)
            try:
                head = await events.__anext__()
                break
            except RayActorError:
                metrics.LOST_SENDS.inc()  # it died before answering: send it again
                continue
            except asyncio.CancelledError:
                events.cancel()  # the client left: so does the request
                raise
        else:
            raise APIError(
                503,
                f"the engine replicas failed {MAX_ATTEMPTS} times before answering; retry",
                code="engine_unavailable",
            )
        status, headers = head["status"], head["headers"]
        if head["body"] is not None:
            return Response(head["body"], status_code=status, headers=headers)
        headers.pop("content-length", None)
        return StreamingResponse(self.relay(events), status_code=status, headers=headers)

    async def relay(self, events: DeploymentResponseGenerator) -> AsyncIterator[str]:
        """A stream's events; a replica lost midway ends it with an error event."""
        try:
            async for event in events:
                yield event
        except RayActorError as e:
            error = APIError(
                502, f"the engine replica serving this stream failed: {e}", code="replica_failed"
            )
            yield _sse(error.body())
            yield "data: [DONE]\n\n"
        finally:
            events.cancel()  # a client that left: the replica aborts its requests
