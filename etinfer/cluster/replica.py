"""One engine as a Ray Serve replica.

It holds what the single server holds (``ServingStack``: engine loop, prompt encoder, OpenAI
serving, metrics) and answers the ingress through a streaming deployment handle instead of
HTTP: the first item is the reply's head (status, headers and, for a whole JSON answer, its
body), the rest are a stream's server-sent events. The answers are the single server's, byte
for byte, errors included, because the same code writes them.

A client that leaves cancels the ingress's call, Serve cancels this generator, and the serving
code's own cleanup aborts the requests, freeing their KV blocks, as on a single server.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import torch
from ray import serve
from starlette.responses import StreamingResponse

from etinfer.calibrate import build_engine
from etinfer.cluster import metrics
from etinfer.config import EngineConfig
from etinfer.server.app import ServingStack, default_model_name
from etinfer.server.errors import APIError
from etinfer.server.protocol import ChatCompletionRequest, CompletionRequest
from etinfer.server.responses_api import ResponsesRequest

METRICS_PUSH_S = 1.0  # how stale a scrape of /metrics may be


class _NeverDisconnects:
    """The serving code's view of the client. A replica learns of a departed client by
    cancellation, never by a message, so the wait for one is endless."""

    async def receive(self) -> dict:
        await asyncio.Future()
        raise AssertionError("unreachable")


class EngineReplica:
    # Async, so that Serve runs it on the event loop the replica's calls will run on, where
    # the engine loop must start.
    async def __init__(
        self,
        engine_kwargs: dict,
        model_name: str | None,
        max_waiting_requests: int,
        num_threads: int,
    ) -> None:
        torch.set_num_threads(num_threads)
        engine = build_engine(EngineConfig(**engine_kwargs))
        name = model_name or default_model_name(engine)
        self.stack = ServingStack(engine, name, max_waiting_requests)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.limits = {
            "max_model_len": engine.max_model_len,
            "max_token_bytes": engine.tokenizer.max_token_bytes,
        }
        self.stack.start()
        self._pusher = asyncio.create_task(self._push_metrics())

    async def generate(self, kind: str, body: dict) -> AsyncIterator[dict | str]:
        """One OpenAI request (``kind``: ``"completions"``, ``"chat"`` or ``"responses"``,
        ``body``: its JSON, already validated by the ingress): the reply's head, then a
        stream's events."""
        stack, client = self.stack, _NeverDisconnects()
        try:
            if kind == "chat":
                request = ChatCompletionRequest.model_validate(body)
                response = await stack.serving.chat(request, client)
            elif kind == "responses":
                request = ResponsesRequest.model_validate(body)
                response = await stack.responses.create(request, client)
            else:
                request = CompletionRequest.model_validate(body)
                response = await stack.serving.completions(request, client)
        except APIError as e:
            response = e.response()
        head = {"status": response.status_code, "headers": dict(response.headers)}
        if not isinstance(response, StreamingResponse):
            yield {**head, "body": bytes(response.body)}
            return
        yield {**head, "body": None}
        events = response.body_iterator
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()  # a cancelled stream: the serving code aborts its requests

    async def tokenizer_call(self, path: str, body: dict | None) -> tuple[int, dict]:
        """A tokenizer endpoint's status and answer (``tokenizer_routes.TOKENIZER_PATHS``)."""
        try:
            return 200, await self.stack.tokenizer.call(path, body)
        except APIError as e:
            return e.status, e.body()

    async def models(self) -> dict:
        return self.stack.serving.models()

    async def limits_info(self) -> dict:
        return self.limits

    async def check_health(self) -> None:
        """Serve's health check: a replica whose engine thread died is restarted."""
        if not self.stack.loop.alive:
            raise RuntimeError("the engine loop is not running")

    async def record_routing_stats(self) -> dict:
        """What the router weighs (Serve polls it): the work left of every request this
        replica holds, and its KV blocks free. On the event loop, which owns the requests."""
        loop = self.stack.loop
        return {
            "time": time.time(),
            "work_left": loop.work_left(),
            "kv_free_blocks": loop.stats.kv_free_blocks,
            "num_running": loop.stats.num_running,
            "num_waiting": loop.num_waiting,
        }

    async def _push_metrics(self) -> None:
        """Hand this replica's Prometheus text to the board the ingress scrapes, every
        second: the ingress cannot address one replica through a handle."""
        board = metrics.board()
        while True:
            with contextlib.suppress(Exception):  # a board restarting: the next push retries
                await board.put.remote(self.replica_id, self.stack.metrics.render())
            await asyncio.sleep(METRICS_PUSH_S)

    async def __del__(self) -> None:
        self._pusher.cancel()
        await self.stack.stop()
