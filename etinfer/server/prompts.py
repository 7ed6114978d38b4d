"""A request's prompts as token ids, without stalling the event loop.

What is free comes first: a text whose size alone shows it cannot fit the context is refused
untokenized (``RequestValidator.check_text_length``). The rest is tokenized on worker threads:
the tokenizer releases the GIL while it works, so health checks, metrics, streams and other
requests keep flowing while a long prompt is encoded. Short and long texts have a worker each,
so a short prompt never waits behind long ones, and long ones queue at most ``max_pending``
deep (past that, 429).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import jinja2

from etinfer.engine.request_validator import ContextLengthError, RequestValidator
from etinfer.model.tokenizer import Message, Tokenizer
from etinfer.server.errors import APIError
from etinfer.server.memory import release_freed_memory

T = TypeVar("T")
EncodedPrompt = tuple[str | None, list[int]]
CompletionPrompt = str | list[str] | list[int] | list[list[int]]
# A text longer than this goes to the long lane: tokenizing it takes milliseconds (a text the
# size bound lets through at 8K tokens, up to 0.3 s), and tens of MB for a moment, which the
# worker then hands back to the system.
LONG_TEXT_CHARS = 1 << 16


class PromptEncoder:
    def __init__(
        self, validator: RequestValidator, tokenizer: Tokenizer, *, max_pending: int
    ) -> None:
        self.validator = validator
        self.tokenizer = tokenizer
        self.max_pending = max_pending
        self.pending = 0  # long requests in or waiting for their worker (event loop only)
        self._short = ThreadPoolExecutor(1, thread_name_prefix="etinfer-tokenize-short")
        self._long = ThreadPoolExecutor(1, thread_name_prefix="etinfer-tokenize-long")

    def close(self) -> None:
        for pool in (self._short, self._long):
            pool.shutdown(wait=False, cancel_futures=True)

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

        def encode() -> list[EncodedPrompt]:
            for text in texts:  # every text's size is checked before any is tokenized
                self.validator.check_text_length(text)
            return [self.validator.encode_prompt(p) for p in prompts]

        return await self._run(encode, "prompt", sum(map(len, texts)))

    async def encode_chat(self, messages: list[Message]) -> list[int]:
        def encode() -> list[int]:
            try:
                text = self.tokenizer.apply_chat_template(messages)
            except (ValueError, jinja2.TemplateError) as e:
                # The model's template refuses some conversations (say, roles out of order).
                raise APIError(400, f"chat template: {e}", param="messages") from e
            self.validator.check_text_length(text)
            # The template writes BOS itself where the model wants one.
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if not ids:
                raise APIError(400, "messages encode to no tokens", param="messages")
            self.validator.check_length(len(ids))
            return ids

        size = sum(len(m["content"]) for m in messages)
        return await self._run(encode, "messages", size)

    async def _run(self, work: Callable[[], T], param: str, text_chars: int) -> T:
        long = text_chars > LONG_TEXT_CHARS
        if long and self.pending >= self.max_pending:
            raise APIError(
                429,
                f"the server is overloaded: {self.pending} long prompts are waiting to be "
                f"tokenized (at most {self.max_pending}); retry later",
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        self.pending += long

        def run() -> T:
            try:
                return work()
            finally:
                if long:
                    release_freed_memory()

        try:
            pool = self._long if long else self._short
            return await asyncio.get_running_loop().run_in_executor(pool, run)
        except ContextLengthError as e:
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from e
        except ValueError as e:
            raise APIError(400, str(e), param=param) from e
        finally:
            self.pending -= long
