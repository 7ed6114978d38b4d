"""The FastAPI application: routes, API key, and the engine loop's lifetime."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

from etinfer.engine.llm_engine import LLMEngine
from etinfer.memory import release_freed_memory
from etinfer.model.catalog import default_model_path
from etinfer.server.engine_loop import EngineLoop
from etinfer.server.errors import APIError, install_handlers
from etinfer.server.limits import BodySizeLimit, default_max_request_bytes
from etinfer.server.metrics import ServerMetrics
from etinfer.server.playground import add_playground
from etinfer.server.prompts import PromptEncoder
from etinfer.server.protocol import ChatCompletionRequest, CompletionRequest
from etinfer.server.responses_api import ResponsesRequest, ResponsesServing
from etinfer.server.serving import OpenAIServing
from etinfer.server.tokenizer_routes import (
    TOKENIZER_PATHS,
    TokenizerService,
    add_tokenizer_routes,
)

DEFAULT_MAX_WAITING_REQUESTS = 256
GUARDED_PATHS = ("/v1", *TOKENIZER_PATHS)


def default_model_name(engine: LLMEngine) -> str:
    """The model's file or folder name, without ``.gguf`` (``SmolLM2-135M-Instruct.Q4_1``)."""
    path = Path(engine.config.model) if engine.config.model else default_model_path()
    return path.name.removesuffix(".gguf")


class APIKeyMiddleware:
    """401 for ``/v1`` and tokenizer requests without ``Authorization: Bearer <key>``, before
    the body is read. A plain ASGI middleware: Starlette's BaseHTTPMiddleware would hide client
    disconnects from the streaming responses behind it."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(GUARDED_PATHS):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                error = APIError(
                    401,
                    "Incorrect API key provided; pass it as 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ServingStack:
    """What serves one engine: its metrics, the engine loop, the prompt encoder and the OpenAI
    serving logic. The single server and each Ray Serve replica hold one."""

    def __init__(self, engine: LLMEngine, model_name: str, max_waiting_requests: int) -> None:
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be at least 1, got {max_waiting_requests}")
        self.metrics = ServerMetrics(model_name)
        self.loop = EngineLoop(engine, self.metrics, max_waiting_requests=max_waiting_requests)
        self.encoder = PromptEncoder(
            engine.validator, engine.tokenizer, max_pending=max_waiting_requests
        )
        self.serving = OpenAIServing(self.loop, self.encoder, model_name)
        self.responses = ResponsesServing(self.serving)
        self.tokenizer = TokenizerService(self.encoder, model_name, engine.max_model_len)

    def start(self) -> None:
        """On the event loop that will serve."""
        release_freed_memory()  # what reading the model left behind
        self.loop.start()

    async def stop(self) -> None:
        self.encoder.close()
        await self.loop.stop()


def guard(app: FastAPI, api_key: str | None, max_request_bytes: int) -> None:
    """The error handlers, the body size limit and the API key, in the order they must run."""
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be at least 1, got {max_request_bytes}")
    install_handlers(app)
    # The last added runs first: the key is checked before a body is read.
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)


def create_app(
    engine: LLMEngine,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
    max_request_bytes: int | None = None,
) -> FastAPI:
    """An OpenAI-compatible server over ``engine``, which it then owns: nothing else may call
    the engine while the app runs. ``max_request_bytes``: the largest body accepted (by
    default room for one prompt that fills the context, see ``default_max_request_bytes``)."""
    if max_request_bytes is None:
        max_request_bytes = default_max_request_bytes(
            engine.max_model_len, engine.tokenizer.max_token_bytes
        )
    stack = ServingStack(engine, model_name or default_model_name(engine), max_waiting_requests)
    loop, metrics, serving = stack.loop, stack.metrics, stack.serving

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        stack.start()
        try:
            yield
        finally:
            await stack.stop()

    app = FastAPI(title="etinfer", lifespan=lifespan)
    app.state.loop = loop
    app.state.metrics = metrics
    guard(app, api_key, max_request_bytes)
    add_playground(app)

    @app.get("/health")
    async def health() -> Response:
        if not loop.alive:
            raise APIError(503, "the engine loop is not running", code="engine_unavailable")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return serving.models()

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request) -> Response:
        return await serving.completions(request, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.chat(request, raw)

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw: Request) -> Response:
        return await stack.responses.create(request, raw)

    add_tokenizer_routes(app, stack.tokenizer)
    return app


def serve(
    engine: LLMEngine,
    *,
    host: str,
    port: int,
    log_level: str = "info",
    **app_kwargs,
) -> None:
    """Run the server until interrupted. ``app_kwargs`` are those of ``create_app``."""
    app = create_app(engine, **app_kwargs)
    # Streams still open at shutdown get a few seconds, then are cut (and their requests freed).
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
