"""Request bodies of OpenAI's Responses API (``POST /v1/responses``), as strict as the chat
API's: an item, tool or part of a type we do not serve is a 400 naming it and listing those we
do. Responses are not stored, so what only a stored response can honour (``store: true``,
``previous_response_id``, ``conversation``, ``background``) is refused rather than ignored."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator

from etinfer.server.protocol import PRIORITY_MAX, PRIORITY_MIN, SamplingExtensions, _Strict

NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class ContentPart(_Strict):
    """Text of a message: what a user wrote (``input_text``) or what the model did, sent back
    with the conversation (``output_text``, its annotations and logprobs as OpenAI wrote them)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return _text(self.content)


class FunctionCallItem(_Strict):
    """A call the model made in an earlier turn."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    """A tool's result, answering a call by its ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return _text(self.output)


def _text(content: str | list[ContentPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


ITEM_TYPES = {
    "message": "Message",
    "function_call": "FunctionCall",
    "function_call_output": "FunctionCallOutput",
}


def _item_tag(value: Any) -> str | None:
    """An item's model, by its ``type`` (a message may come without one: OpenAI's "easy input
    message"). The tags are capitalised so an error's field path leaves them out."""
    kind = value.get("type", "message") if isinstance(value, dict) else value.type
    return ITEM_TYPES.get(kind)


InputItem = Annotated[
    Annotated[MessageItem, Tag("Message")]
    | Annotated[FunctionCallItem, Tag("FunctionCall")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")],
    Discriminator(_item_tag),
]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None


class ResponsesRequest(SamplingExtensions):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None  # etinfer's, as in chat completions
    stream: bool = False
    # What the response carries back (metadata) or what only names the caller (user, the
    # cache key: our prefix cache finds shared prefixes by itself).
    metadata: dict[str, str] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    # Accepted at the only values this server honours.
    store: Literal[False] | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    # The chat API's etinfer fields that shape the reply.
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    slo: float | None = Field(None, gt=0, allow_inf_nan=False)

    @field_validator("input", mode="before")
    @classmethod
    def _served_item_types(cls, value: Any) -> Any:
        for i, item in enumerate(value if isinstance(value, list) else []):
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind is not None and kind not in ITEM_TYPES:
                raise ValueError(
                    f"input[{i}] is of type {kind!r}; this server takes items of type "
                    + ", ".join(ITEM_TYPES)
                )
        return value

    @field_validator("include")
    @classmethod
    def _nothing_extra(cls, value: list[str] | None) -> list[str] | None:
        if value:
            raise ValueError(
                f"no additional output data can be included (asked for {', '.join(value)})"
            )
        return value
