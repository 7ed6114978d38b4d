"""What one request may cost the server before the engine sees it.

A body over the size limit is refused before it is parsed (413), and every list a request
carries is bounded (400 naming the field and the limit), so that no client can make the others
wait by sending much: parsing, tokenizing and stop matching all stay within these bounds.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from etinfer.server.errors import APIError
from etinfer.server.protocol import ChatCompletionRequest, GenerationRequest

MiB = 1 << 20
# The worst JSON escaping of one byte of text: a control character written as \u00XX.
JSON_BYTES_PER_TEXT_BYTE = 6
# Room for the fields beside the prompt (sampling options, stop strings, a chat's roles).
OTHER_FIELDS_BYTES = MiB
# A token's bytes where the tokenizer gives no bound (byte-level BPE vocabularies top out
# between 64 and 128).
FALLBACK_TOKEN_BYTES = 128
# OpenAI's own limit on a conversation's messages.
MAX_MESSAGES = 2048
# OpenAI accepts 4 stop strings; local clients pass a few more (chat-format markers). Matching
# costs a step the same whatever their number (engine/stop_strings.py); the bounds keep the
# automaton small, and a stream holds back at most MAX_STOP_LENGTH - 1 characters.
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_STOP_TOKEN_IDS = 64


def default_max_request_bytes(max_model_len: int, max_token_bytes: int | None) -> int:
    """Room for one prompt that fills the context, at the worst JSON escaping, and 1 MiB for
    the other fields, in whole MiB (5 MiB for the default model: 8,192 tokens of at most 81
    bytes)."""
    prompt = max_model_len * (max_token_bytes or FALLBACK_TOKEN_BYTES) * JSON_BYTES_PER_TEXT_BYTE
    return -(-(prompt + OTHER_FIELDS_BYTES) // MiB) * MiB


def too_large(limit: int, size: int | None = None) -> APIError:
    given = f"has {size} bytes" if size is not None else f"is larger than {limit} bytes"
    return APIError(
        413,
        f"The request body {given}; this server accepts at most {limit} bytes "
        "(its --max-request-bytes)",
        code="request_too_large",
    )


class BodySizeLimit:
    """Reads a request's body, up to ``max_bytes``, before the app parses it; a larger one is
    answered 413 at once: unread when its Content-Length says so, else once the limit is
    passed. Plain ASGI, like the API key check, so streaming responses still see their
    client's disconnect.

    What the client still sends after the 413 is read and dropped by uvicorn, so the client
    gets the answer instead of a reset connection."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await too_large(self.max_bytes, int(declared)).response()(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before it finished sending
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await too_large(self.max_bytes).response()(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        del chunks
        replayed = False

        async def replay() -> Message:
            # The body once, whole; then the client's own messages (its disconnect).
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def check_lists(request: GenerationRequest) -> None:
    """Refuse a list over its bound, naming it, in OpenAI's words."""
    stop = [request.stop] if isinstance(request.stop, str) else request.stop or []
    _check_array("stop", stop, MAX_STOP_STRINGS)
    for i, text in enumerate(stop):
        if len(text) > MAX_STOP_LENGTH:
            name = "stop" if isinstance(request.stop, str) else f"stop[{i}]"
            raise APIError(
                400,
                f"Invalid '{name}': string too long. Expected a string with maximum length "
                f"{MAX_STOP_LENGTH}, but got a string with length {len(text)} instead.",
                param=name,
                code="string_above_max_length",
            )
    _check_array("stop_token_ids", request.stop_token_ids or [], MAX_STOP_TOKEN_IDS)
    if isinstance(request, ChatCompletionRequest):
        _check_array("messages", request.messages, MAX_MESSAGES)


def _check_array(name: str, items: Sequence[object], limit: int) -> None:
    if len(items) > limit:
        raise APIError(
            400,
            f"Invalid '{name}': array too long. Expected an array with maximum length {limit}, "
            f"but got an array with length {len(items)} instead.",
            param=name,
            code="array_above_max_length",
        )
