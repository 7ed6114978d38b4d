"""What a request's structured output asks for, checked before any compute is spent on it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from etinfer.validation import check_int

# Limits on a constraint's size, so that one request cannot make the server compile (or hold)
# something unbounded. OpenAI's strict mode allows 5 levels of nesting and 100 properties; we
# allow more, but not without bound.
MAX_SPEC_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 32
MAX_CHOICES = 1024
# Consecutive whitespace characters allowed between JSON tokens: a small model can otherwise
# loop on spaces or newlines until max_tokens. 16 fits an object nested 7 deep indented by 2.
DEFAULT_MAX_WHITESPACE = 16

KINDS = ("json", "json_object", "regex", "grammar", "choice")
# The grammar libraries an engine may compile constraints with (EngineConfig.structured_backend).
BACKENDS = ("xgrammar", "llguidance")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on what a request may generate; set exactly one of the first five.

    The shape follows vLLM's ``StructuredOutputsParams``: ``json`` is a JSON schema (a dict or
    its text), ``json_object`` any JSON object, ``regex`` a regular expression the whole output
    matches, ``grammar`` an EBNF grammar (GBNF style, root rule ``root``), ``choice`` one of the
    strings. ``max_whitespace`` caps runs of whitespace inside JSON (None: no cap)."""

    json: dict[str, Any] | bool | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    max_whitespace: int | None = DEFAULT_MAX_WHITESPACE
    _key: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        chosen = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(
                "structured output needs exactly one of "
                f"{', '.join(KINDS)}; got {', '.join(chosen) or 'none'}"
            )
        if self.max_whitespace is not None:
            check_int("structured.max_whitespace", self.max_whitespace, low=0, high=1024)
        kind = chosen[0]
        spec = getattr(self, kind)
        if kind == "json":
            spec = _checked_schema(spec)
            object.__setattr__(self, "json", spec)
        elif kind == "choice":
            spec = _checked_choices(spec)
            object.__setattr__(self, "choice", spec)
        elif kind in ("regex", "grammar") and (not isinstance(spec, str) or not spec):
            raise ValueError(f"structured.{kind} must be a non-empty string")
        text = spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True)
        if len(text.encode()) > MAX_SPEC_BYTES:
            raise ValueError(
                f"structured.{kind} is {len(text.encode())} bytes; the limit is {MAX_SPEC_BYTES}"
            )
        object.__setattr__(self, "_key", f"{kind}:{self.max_whitespace}:{text}")

    @property
    def kind(self) -> str:
        return self._key.split(":", 1)[0]

    @property
    def key(self) -> str:
        """What two requests share when they ask for the same compiled grammar."""
        return self._key


def _checked_schema(spec: object) -> dict[str, Any] | bool:
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as error:
            raise ValueError(f"structured.json is not valid JSON: {error}") from None
    if not isinstance(spec, dict | bool):
        raise ValueError(f"structured.json must be a JSON schema object, got {type(spec).__name__}")
    depth = _depth(spec)
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(
            f"structured.json nests {depth} levels deep; the limit is {MAX_SCHEMA_DEPTH}"
        )
    # The meta-schema check names what is wrong (a "type" that is not a type, a negative
    # "minItems") before the grammar compiler sees it.
    import jsonschema

    try:
        jsonschema.validators.validator_for(spec).check_schema(spec)
    except jsonschema.SchemaError as error:
        where = "/".join(map(str, error.absolute_path)) or "(root)"
        raise ValueError(
            f"structured.json is not a valid JSON schema at {where}: {error.message}"
        ) from None
    return spec


def _checked_choices(spec: object) -> tuple[str, ...]:
    if not isinstance(spec, list | tuple) or not spec:
        raise ValueError("structured.choice must be a non-empty list of strings")
    if len(spec) > MAX_CHOICES:
        raise ValueError(f"structured.choice has {len(spec)} strings; the limit is {MAX_CHOICES}")
    if not all(isinstance(s, str) and s for s in spec):
        raise ValueError("structured.choice must hold non-empty strings only")
    return tuple(spec)


def _depth(value: object, level: int = 0) -> int:
    """How deeply ``value``'s containers nest (iteratively: a hostile schema must not overflow
    the stack that checks it)."""
    deepest, stack = level, [(value, level)]
    while stack:
        item, at = stack.pop()
        deepest = max(deepest, at)
        if deepest > MAX_SCHEMA_DEPTH:
            return deepest
        children = (
            item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        )
        stack.extend((child, at + 1) for child in children)
    return deepest
