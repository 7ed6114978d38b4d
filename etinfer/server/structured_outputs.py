"""A request's structured-output fields as one engine constraint, compiled before it queues.

OpenAI's ``response_format`` and vLLM's extra fields (``structured_outputs``, ``guided_*``)
all become one ``StructuredOutputsParams``; asking for two is a 400, as is a schema that does
not parse or compile, named by the field it came from. Compilation is awaited here, off the
event loop's thread and the engine's, so a bad or slow schema costs no engine step.
"""

from __future__ import annotations

import asyncio
import dataclasses

from etinfer.sampling_params import SamplingParams
from etinfer.server.errors import APIError
from etinfer.server.protocol import GenerationRequest
from etinfer.structured.compiler import DEFAULT_COMPILE_TIMEOUT, GrammarCompiler
from etinfer.structured.params import StructuredOutputsParams


def requested_constraint(request: GenerationRequest) -> tuple[str, dict] | None:
    """(the field that asked, StructuredOutputsParams' arguments), or None."""
    asked: list[tuple[str, dict]] = []
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(
                400,
                "response_format of type json_schema needs a json_schema object",
                param="response_format.json_schema",
            )
        schema = fmt.json_schema.schema_
        asked.append(
            ("response_format.json_schema.schema", {"json": True if schema is None else schema})
        )
    if request.structured_outputs is not None:
        fields = request.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        asked.append(("structured_outputs", fields))
    for name, kind in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(request, name)
        if value is not None:
            asked.append((name, {kind: value}))
    if len(asked) > 1:
        raise APIError(
            400,
            f"{' and '.join(a for a, _ in asked)} each constrain the output; set only one",
            param=asked[1][0],
        )
    return asked[0] if asked else None


def constraint_params(param: str, fields: dict) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except (TypeError, ValueError) as e:
        raise APIError(400, str(e), param=param) from e


async def compiled(
    compiler: GrammarCompiler,
    params: SamplingParams,
    param: str,
    timeout: float = DEFAULT_COMPILE_TIMEOUT,
) -> None:
    """Wait for ``params``' grammar to compile; a 400 naming ``param`` when it cannot."""
    if params.structured is None:
        return
    future = asyncio.wrap_future(compiler.submit(params.structured))
    try:
        await asyncio.wait_for(asyncio.shield(future), timeout)
    except TimeoutError:
        raise APIError(
            400,
            f"{param} took over {timeout:g} s to compile; simplify it",
            param=param,
        ) from None
    except ValueError as e:
        raise APIError(400, str(e), param=param) from e


def with_constraint(
    params: SamplingParams, constraint: StructuredOutputsParams | None
) -> SamplingParams:
    return params if constraint is None else dataclasses.replace(params, structured=constraint)
