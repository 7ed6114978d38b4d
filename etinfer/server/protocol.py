"""Request bodies of the OpenAI-compatible API.

Types are strict ("0.5" is not a number, 1 is not a boolean) and unknown fields are refused, so
a mistyped field is a 400 that names it rather than a knob silently ignored. Ranges are left to
``SamplingParams``, the one place that knows them; its ``ValueError`` names the field too.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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


class JsonSchemaFormat(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON that follows a
    schema (constrained by a grammar, so it always parses and validates)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Strict):
    """vLLM's ``structured_outputs`` extra field (one of its constraint kinds)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    max_whitespace: int | None = None


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
    # Structured output: OpenAI's response_format, and vLLM's extra fields (its newer
    # structured_outputs object and its older guided_* names). At most one may be set.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def unsupported_field(self) -> str | None:
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0):
                return name
        return "logit_bias" if self.logit_bias else None

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
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
        return SamplingParams(
            max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs, **fields
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationRequest):
    # One prompt (text or token ids) or a batch of them; each gets n choices.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None  # None: DEFAULT_COMPLETION_TOKENS, as OpenAI does
    logprobs: int | None = None  # top-N per token, as in OpenAI's legacy completions
    # The prompt before the completion, and with logprobs the prompt tokens' too (0 tokens to
    # generate allowed): how evaluation harnesses score a text by the model.
    echo: bool = False
    # vLLM's: each prompt token's log-probability and top-N, as the choice's prompt_logprobs
    prompt_logprobs: int | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallMessage(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: which call it answers

    @property
    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    # None: up to the end of the context. max_completion_tokens is OpenAI's newer name.
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(_Strict):
    """A text (``prompt``) or a conversation (``messages``, rendered by the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    # vLLM's defaults: special tokens (BOS) for a text; none for a conversation, whose template
    # writes its own.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
