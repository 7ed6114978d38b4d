"""What a request must satisfy before an engine queues it: a prompt it can encode, room to
generate within the context, a KV footprint the pool can ever hold, sane scheduling fields."""

from __future__ import annotations

from collections.abc import Sequence

from etinfer.engine.kv_cache.manager import KVCacheManager
from etinfer.model.tokenizer import Tokenizer
from etinfer.sampling_params import SamplingParams
from etinfer.validation import check_float, check_int

Prompt = str | Sequence[int]


class ContextLengthError(ValueError):
    """A prompt longer than the context allows (what OpenAI calls context_length_exceeded)."""


class RequestValidator:
    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_model_len: int,
        kv: KVCacheManager,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.kv = kv
        self.max_token_bytes = tokenizer.max_token_bytes

    def encode_prompt(
        self, prompt: Prompt, *, max_prompt_tokens: int | None = None
    ) -> tuple[str | None, list[int]]:
        """Validate a prompt of at most ``max_prompt_tokens`` tokens (by default what leaves
        room to generate) and return (text or None, token ids). A text that cannot fit is
        refused from its size, before tokenizing it."""
        if isinstance(prompt, str):
            self.check_text_length(prompt, max_prompt_tokens)
            ids = self.tokenizer.encode(prompt) if prompt else []
            if not ids:
                raise ValueError("prompt must not be empty (it encodes to no tokens)")
            self.check_length(len(ids), max_prompt_tokens)
            return prompt, ids
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        # The length first: a list far over the context is refused without reading it.
        self.check_length(len(prompt), max_prompt_tokens)
        ids = list(prompt)
        vocab = self.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab - 1}]")
        return None, ids

    def check_text_length(self, text: str, max_prompt_tokens: int | None = None) -> None:
        """Refuse, without tokenizing it, a text that is bound to exceed ``max_prompt_tokens``
        tokens (by default: what leaves room to generate): no token covers more of a text's
        bytes than the tokenizer's longest entry. Where the tokenizer gives no such bound, only
        that the text can be encoded at all is checked."""
        size = _utf8_size(text)
        if self.max_token_bytes is None:
            return
        limit = self.max_model_len - 1 if max_prompt_tokens is None else max_prompt_tokens
        least = -(-size // self.max_token_bytes)
        if least > limit:
            raise self._too_long(
                f"at least {least} tokens ({size} bytes; no token covers more than "
                f"{self.max_token_bytes} bytes)"
            )

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Refuse what could never finish: a prompt without room to generate, or a request the
        whole KV pool cannot hold (it would be preempted forever)."""
        n = len(prompt_token_ids)
        self.check_length(n)
        self.kv.check_holds(n, params.max_tokens, self.max_model_len)

    def blocks_needed(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """KV blocks of one sequence at its longest, within this engine's context."""
        return self.kv.blocks_at_longest(num_prompt_tokens, max_tokens, self.max_model_len)

    def check_length(self, num_tokens: int, max_prompt_tokens: int | None = None) -> None:
        """Refuse a prompt of more than ``max_prompt_tokens`` tokens (by default: what leaves
        room to generate)."""
        limit = self.max_model_len - 1 if max_prompt_tokens is None else max_prompt_tokens
        if num_tokens > limit:
            room = f" (at most {limit}, to leave room to generate)"
            raise self._too_long(
                f"{num_tokens} tokens" + (room if limit < self.max_model_len else "")
            )

    def _too_long(self, prompt: str) -> ContextLengthError:
        return ContextLengthError(
            f"This model's maximum context length is {self.max_model_len} tokens "
            f"(max_model_len), but the prompt has {prompt}"
        )

    @staticmethod
    def check_scheduling(priority: int, slo: float | None) -> None:
        check_int("priority", priority)
        if slo is not None:
            check_float("slo", slo, low=0.0, low_open=True)


def _utf8_size(text: str) -> int:
    """The text's size in UTF-8; ValueError for a lone surrogate (valid JSON, "\\ud800", that
    no tokenizer can encode)."""
    if text.isascii():  # an ASCII string's length is its size, known without encoding it
        return len(text)
    try:
        return len(text.encode())
    except UnicodeEncodeError as e:
        raise ValueError(
            f"prompt is not valid Unicode: a lone surrogate {text[e.start]!r} at character "
            f"{e.start}"
        ) from None
