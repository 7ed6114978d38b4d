"""From an API request to engine requests: every check a request can fail before it is queued
(so a 400 never leaves work behind), then one engine request per choice."""

from __future__ import annotations

import dataclasses

from etinfer.engine.llm_engine import LLMEngine
from etinfer.sampling_params import SamplingParams
from etinfer.server.engine_loop import EngineRequest
from etinfer.server.errors import APIError, invalid_value
from etinfer.server.limits import check_lists
from etinfer.server.prompts import EncodedPrompt
from etinfer.server.protocol import CompletionRequest, GenerationRequest

# A request's SamplingParams field names, as the request spells them.
FIELDS = {f.name: f.name for f in dataclasses.fields(SamplingParams)}
MAX_SEED = 2**63


def check_model(model: str | None, model_name: str) -> None:
    """A request's ``model``, where it names one, is the served one."""
    if model is not None and model != model_name:
        raise APIError(
            400,
            f"The model `{model}` does not exist; this server serves `{model_name}`",
            param="model",
            code="model_not_found",
        )


def check_echo(request: CompletionRequest) -> None:
    """``echo`` returns whole choices: one each (no ``n``), not streamed; and only with echo
    may a completion generate nothing."""
    if request.echo:
        if request.stream:
            raise APIError(400, "echo is not supported with stream: true", param="echo")
        if request.n > 1:
            raise APIError(400, f"echo takes n = 1, got n = {request.n}", param="echo")
    elif request.max_tokens == 0:
        raise APIError(
            400, "max_tokens must be at least 1 (0 only with echo: true)", param="max_tokens"
        )


def check_request(request: GenerationRequest, model_name: str) -> None:
    """The checks every generation request passes before its prompt is read."""
    check_model(request.model, model_name)
    name = request.unsupported_field()
    if name is not None:
        raise APIError(400, f"{name} is not supported", param=name, code="unsupported_parameter")
    if request.stream_options is not None and not request.stream:
        raise APIError(
            400, "stream_options is only allowed when stream is true", param="stream_options"
        )
    check_lists(request)


def check_choices(count: int, max_waiting_requests: int) -> None:
    """Before any prompt is tokenized: a request with more choices than the queue holds
    could never be accepted."""
    if count > max_waiting_requests:
        raise APIError(
            400,
            f"the request has {count} choices (prompts times n) but the server queues at "
            f"most {max_waiting_requests}",
            param="n",
        )


def sampling_params(
    request: GenerationRequest,
    max_tokens: int | None,
    logprobs: int | None,
    fields: dict[str, str],
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    # Without max_tokens the limit depends on each prompt's length; 1 stands in for now.
    try:
        limit = 1 if max_tokens is None else max_tokens
        return request.sampling_params(limit, logprobs, prompt_logprobs)
    except ValueError as e:
        raise invalid_value(e, fields) from e


def engine_requests(
    engine: LLMEngine,
    request_id: str,
    prompts: list[EncodedPrompt],
    params: SamplingParams,
    request: GenerationRequest,
    arrival: float,
    *,
    max_tokens_param: str = "max_tokens",
    to_context_end: bool = False,
) -> list[EngineRequest]:
    """One engine request per choice (``request.n`` per prompt), each with the request's
    scheduling fields. Each prompt already fits the context (the encoder checked);
    ``to_context_end``: no max_tokens was given, so each may generate up to its end.
    Together the choices must fit the KV pool: one request may not claim more than the
    whole pool, preempting everyone else."""
    validator = engine.validator
    limit = engine.max_model_len
    requests = []
    blocks = 0
    for p, (text, ids) in enumerate(prompts):
        length = len(ids)
        prompt_params = params
        if to_context_end:
            prompt_params = dataclasses.replace(params, max_tokens=limit - length)
        elif length + params.max_tokens > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {length + params.max_tokens} tokens ({length} in the prompt, "
                f"{params.max_tokens} for the completion). Lower {max_tokens_param} or "
                f"shorten the prompt.",
                param=max_tokens_param,
                code="context_length_exceeded",
            )
        try:
            validator.check_request(ids, prompt_params)
        except ValueError as e:
            raise APIError(400, str(e), param=max_tokens_param) from e
        blocks += request.n * validator.blocks_needed(length, prompt_params.max_tokens)
        for i in range(request.n):
            choice_params = prompt_params
            if params.seed is not None and i:
                # Distinct draws per choice, reproducible from the one seed.
                choice_params = dataclasses.replace(
                    prompt_params, seed=(params.seed + i) % MAX_SEED
                )
            requests.append(
                EngineRequest(
                    f"{request_id}-{p}-{i}",
                    text,
                    ids,
                    choice_params,
                    arrival,
                    priority=request.priority,
                    slo=request.slo,
                )
            )
    pool = engine.kv.pool.num_blocks
    if blocks > pool:
        # Counted without prefix sharing: choices admitted in the same step share nothing.
        raise APIError(
            400,
            f"the request's {len(requests)} choices ({len(prompts)} prompts x n={request.n}) "
            f"need {blocks} KV blocks at their longest (prompt + {max_tokens_param}) but the "
            f"pool holds {pool}; lower n or {max_tokens_param}, or send fewer prompts",
            param="n" if request.n > 1 else max_tokens_param,
        )
    return requests
