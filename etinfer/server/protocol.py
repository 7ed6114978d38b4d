"""Request bodies of the OpenAI-compatible API.

Types are strict ("0.5" is not a number, 1 is not a boolean) and unknown fields are refused, so
a mistyped field is a 400 that names it rather than a knob silently ignored. Ranges are left to
``SamplingParams``, the one place that knows them; its ``ValueError`` names the field too.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from etinfer.sampling_params import SamplingParams

# OpenAI's own limit on choices per request, and its default max_tokens for completions.
MAX_N = 128
DEFAULT_COMPLETION_TOKENS = 16
# vLLM takes any integer priority; ours are bounded to a 32-bit range so that the policy's
# urgency, which is linear in it, stays a finite float.
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingExtensions(_Strict):
    """etinfer's sampling fields that OpenAI has no name for (every other ``SamplingParams``
    field); ``None`` keeps the ``SamplingParams`` default."""

    top_k: int | None = None
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    entropy_target: float | None = None
    entropy_control: str | None = None
    entropy_gain: float | None = None
    temperature_min: float | None = None
    temperature_max: float | None = None
    temperature_rate_limit: float | None = None
    entropy_estimator: str | None = None
    entropy_topk: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    edt_theta: float | None = None
    edt_base: float | None = None


EXTENSION_FIELDS = frozenset(SamplingExtensions.model_fields)


class GenerationRequest(SamplingExtensions):
    """What completions and chat completions share."""

    model: str | None = None  # None: the one model served
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted for compatibility; not used
    # Accepted only at their neutral values: OpenAI clients may send them, and any other value
    # would be silently ignored by an engine that does not implement them.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Scheduling, read by the entropy policy (FCFS ignores them): lower priority first, as in
    # vLLM's extra parameter; slo in seconds from arrival within which the request wants to end.
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    slo: float | None = Field(None, gt=0, allow_inf_nan=False)
    # With sparse prefill on: the finished reply's ``etinfer`` object carries the prompt's
    # attention entropy and budgets per segment, layer and KV head (for plots).
    return_attention_entropy: bool = False

    def unsupported_field(self) -> str | None:
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0):
                return name
        return "logit_bias" if self.logit_bias else None

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises ``ValueError`` naming the field for a value out of range."""
        fields = {
            name: value
            for name, value in self.model_dump(include=EXTENSION_FIELDS).items()
            if value is not None
        }
        for name in ("temperature", "top_p", "seed", "stop"):
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **fields)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationRequest):
    # One prompt (text or token ids) or a batch of them; each gets n choices.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None  # None: DEFAULT_COMPLETION_TOKENS, as OpenAI does
    logprobs: int | None = None  # top-N per token, as in OpenAI's legacy completions


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_message(self) -> dict[str, str]:
        content = (
            self.content
            if isinstance(self.content, str)
            else "".join(part.text for part in self.content)
        )
        # Chat templates of open models know "system"; "developer" is OpenAI's newer name.
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content}


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    # None: up to the end of the context. max_completion_tokens is OpenAI's newer name.
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
