"""A request's prompts as token ids, without stalling the event loop.

What is free comes first: a text whose size alone shows it cannot fit the context is refused
untokenized (``RequestValidator.check_text_length``). The rest is tokenized on worker threads:
the tokenizer releases the GIL while it works, so health checks, metrics, streams and other
requests keep flowing while a long prompt is encoded. Short and long texts have a worker each,
so a short prompt never waits behind long ones, and each lane queues at most ``max_pending``
requests (past that, 429).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

import jinja2

from etinfer.engine.request_validator import ContextLengthError, RequestValidator
from etinfer.memory import release_freed_memory
from etinfer.model.tokenizer import Message, Tokenizer
from etinfer.server.errors import APIError

T = TypeVar("T")
EncodedPrompt = tuple[str | None, list[int]]
CompletionPrompt = str | list[str] | list[int] | list[list[int]]
# A request with more text than this goes to the long lane. Tokenizing it takes milliseconds
# (up to 0.3 s for the largest text the size bound lets through at 8K tokens) and, for a
# moment, up to tens of MB, which the worker hands back to the system afterwards; a short lane
# request costs at most a few milliseconds, so a queue of them drains quickly.
LONG_TEXT_CHARS = 8192


class _Lane:
    """One worker thread and the requests queued for it."""

    def __init__(self, name: str, *, long: bool) -> None:
        self.name = name
        self.long = long
        self.pending = 0  # requests in or waiting for the worker (event loop only)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=f"etinfer-tokenize-{name}")


class PromptEncoder:
    def __init__(
        self, validator: RequestValidator, tokenizer: Tokenizer, *, max_pending: int
    ) -> None:
        self.validator = validator
        self.tokenizer = tokenizer
        self.max_pending = max_pending  # per lane
        self._short = _Lane("short", long=False)
        self._long = _Lane("long", long=True)

    def close(self) -> None:
        for lane in (self._short, self._long):
            lane.pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def completion_prompts(prompt: CompletionPrompt) -> list[str] | list[list[int]]:
        """One prompt or a batch of them, as a batch."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        return prompt

    async def encode_completion(self, prompts: list[str] | list[list[int]]) -> list[EncodedPrompt]:
        texts = [p for p in prompts if isinstance(p, str)]
        with _refusals("prompt"):
            for text in texts:  # here, before any is queued: O(1) for ASCII text
                self.validator.check_text_length(text)

        def encode() -> list[EncodedPrompt]:
            return [self.validator.encode_prompt(p) for p in prompts]

        return await self._run(encode, "prompt", sum(map(len, texts)))

    async def encode_chat(
        self, messages: list[Message], tools: list[dict] | None = None
    ) -> list[int]:
        def encode() -> list[int]:
            text = self._render(messages, tools, add_generation_prompt=True)
            # Checked once rendered: a template may add text, or leave some out.
            self.validator.check_text_length(text)
            # The template writes BOS itself where the model wants one.
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if not ids:
                raise APIError(400, "messages encode to no tokens", param="messages")
            self.validator.check_length(len(ids))
            return ids

        return await self._run(encode, "messages", _chat_size(messages, tools))

    async def tokenize_text(self, text: str, add_special_tokens: bool) -> list[int]:
        """``text``'s ids, whatever their count (``/tokenize``: its caller compares them with
        the context)."""

        def encode() -> list[int]:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

        return await self._run(encode, "prompt", len(text))

    async def tokenize_chat(
        self,
        messages: list[Message],
        tools: list[dict] | None,
        add_generation_prompt: bool,
        add_special_tokens: bool,
    ) -> list[int]:
        """The conversation as the chat template renders it, in ids, whatever their count."""

        def encode() -> list[int]:
            text = self._render(messages, tools, add_generation_prompt)
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

        return await self._run(encode, "messages", _chat_size(messages, tools))

    def _render(
        self, messages: list[Message], tools: list[dict] | None, add_generation_prompt: bool
    ) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt
            )
        except (ValueError, jinja2.TemplateError) as e:
            # The model's template refuses some conversations (say, roles out of order).
            raise APIError(400, f"chat template: {e}", param="messages") from e

    async def _run(self, work: Callable[[], T], param: str, text_chars: int) -> T:
        lane = self._long if text_chars > LONG_TEXT_CHARS else self._short
        if lane.pending >= self.max_pending:
            raise APIError(
                429,
                f"the server is overloaded: {lane.pending} requests are waiting to be "
                f"tokenized in the {lane.name} lane (at most {self.max_pending}); retry later",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        lane.pending += 1

        def run() -> T:
            try:
                return work()
            finally:
                if lane.long:
                    release_freed_memory()

        try:
            with _refusals(param):
                return await asyncio.get_running_loop().run_in_executor(lane.pool, run)
        finally:
            lane.pending -= 1


def _chat_size(messages: list[Message], tools: list[dict] | None) -> int:
    """Characters of a conversation, for its lane."""
    return sum(len(m["content"]) for m in messages) + len(str(tools or ""))


@contextmanager
def _refusals(param: str) -> Iterator[None]:
    """A prompt check's ValueError as the 400 that names ``param``."""
    try:
        yield
    except ContextLengthError as e:
        raise APIError(400, str(e), param=param, code="context_length_exceeded") from e
    except ValueError as e:
        raise APIError(400, str(e), param=param) from e
