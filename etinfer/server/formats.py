"""Engine outputs in OpenAI's response shapes, whole or as streamed chunks.

A choice is rendered from a cursor (how much of it was already sent): a whole response is one
delta from an empty cursor, so both paths share the same code. Each choice also carries an
``etinfer`` object with the entropy signal of the tokens it covers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from etinfer.model.tokenizer import Tokenizer
from etinfer.outputs import Logprob, RequestOutput
from etinfer.server.tool_calls import ToolCalling, ToolCallStream

# OpenAI's floor for a log-probability (what -inf is reported as).
MIN_LOGPROB = -9999.0


@dataclass
class Cursor:
    """How much of one choice has been sent."""

    text: int = 0  # characters
    tokens: int = 0
    blocks: int = 0  # entries of blocks_kept
    text_offset: int = 0  # completions logprobs: characters of the token strings so far


@dataclass
class Delta:
    text: str
    tokens: range
    blocks: slice


def advance(cursor: Cursor, out: RequestOutput, *, every_token: bool) -> Delta | None:
    """What ``out`` adds to what was sent, moving the cursor; None when there is nothing to send
    yet. Tokens whose text has not appeared (an unfinished character, a possible stop string)
    wait for the next delta unless ``every_token`` (their logprobs are asked for)."""
    text = out.text[cursor.text :]
    if not text and not out.finished and not (every_token and len(out.token_ids) > cursor.tokens):
        return None
    blocks_kept = out.blocks_kept or []
    delta = Delta(
        text,
        range(cursor.tokens, len(out.token_ids)),
        slice(cursor.blocks, len(blocks_kept)),
    )
    cursor.text = max(cursor.text, len(out.text))
    cursor.tokens = len(out.token_ids)
    cursor.blocks = len(blocks_kept)
    return delta


def whole_delta(out: RequestOutput) -> Delta:
    """All of a finished choice, as one delta from nothing sent."""
    return advance(Cursor(), out, every_token=True)


def telemetry(out: RequestOutput, delta: Delta, attention_entropy: bool = False) -> dict:
    """The ``etinfer`` object of a choice: the entropy signal of the delta's tokens; with
    ``attention_entropy``, the finished reply also carries the prompt's attention profile."""
    a, b = delta.tokens.start, delta.tokens.stop
    fields = {
        "entropies": _finite(out.entropies[a:b]),
        "tempered_entropies": _finite(out.tempered_entropies[a:b]),
        "temperatures": _finite(out.temperatures[a:b]),
    }
    if out.blocks_kept is not None:
        fields["blocks_kept"] = _finite(out.blocks_kept[delta.blocks])
    if out.token_models is not None:
        fields["token_models"] = out.token_models[a:b]
    if out.constraint is not None:
        # Under a grammar: what the mask did to each token (the entropies above are the
        # model's own, before it).
        trace = out.constraint.since(a)
        fields["masked_entropies"] = _finite(trace.masked_entropies[: b - a])
        fields["forced"] = trace.forced[: b - a]
    if out.finished:
        fields["entropic_time"] = out.entropic_time if math.isfinite(out.entropic_time) else None
        if out.token_models is not None:
            fields["large_model_share"] = out.large_model_share
        if out.attention_profile is not None:
            fields["prefill_attention_skipped"] = out.metrics.prefill_attention_skipped
            if attention_entropy:
                fields["attention_profile"] = _attention_profile(out)
        if out.num_draft_tokens:
            fields["num_draft_tokens"] = out.num_draft_tokens
            fields["num_accepted_tokens"] = out.num_accepted_tokens
    return fields


def _attention_profile(out: RequestOutput) -> dict:
    """[segments][layers][KV heads] entropy (nats) and budget (tokens; null: dense or not
    estimated) over the segments the prompt spans."""
    profile = out.attention_profile
    segments = -(-len(out.prompt_token_ids) // profile.segment_size)

    def nested(values) -> list:
        return [[_finite(head) for head in layer] for layer in values[:segments].tolist()]

    return {
        "segment_size": profile.segment_size,
        "entropy": nested(profile.entropy),
        "budgets": nested(profile.budgets),
    }


def _finite(values: list[float]) -> list[float | None]:
    """JSON has no NaN or infinity (and Starlette refuses to write them): null instead."""
    return [v if math.isfinite(v) else None for v in values]


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def _chat_entry(lp: Logprob) -> dict:
    return {"token": lp.token, "logprob": _logprob(lp.logprob), "bytes": list(lp.token.encode())}


def chat_logprobs(out: RequestOutput, tokens: range, top_n: int) -> dict:
    content = []
    for j in tokens:
        entry = out.logprobs[j]
        # The top-N come first, in rank order; the sampled token follows when outside them.
        top = list(entry.values())[:top_n]
        content.append(
            {
                **_chat_entry(entry[out.token_ids[j]]),
                "top_logprobs": [_chat_entry(lp) for lp in top],
            }
        )
    return {"content": content}


def completion_logprobs(out: RequestOutput, tokens: range, cursor: Cursor) -> dict:
    return legacy_logprobs(((out.token_ids[j], out.logprobs[j]) for j in tokens), cursor)


def legacy_logprobs(
    scored: Iterable[tuple[int, dict[int, Logprob] | None]],
    cursor: Cursor,
    token_text: Callable[[int], str] | None = None,
) -> dict:
    """OpenAI's legacy completions logprobs of ``scored`` tokens (each with its entry, or None
    for an echoed prompt's first token, which nothing precedes; ``token_text`` then names it):
    each token's text and logprob, the top-N and the token by text, text offsets from
    ``cursor``."""
    strings, values, tops, offsets = [], [], [], []
    for token, entry in scored:
        chosen = None if entry is None else entry[token]
        strings.append(token_text(token) if chosen is None else chosen.token)
        values.append(None if chosen is None else _logprob(chosen.logprob))
        tops.append(
            None if entry is None else {lp.token: _logprob(lp.logprob) for lp in entry.values()}
        )
        offsets.append(cursor.text_offset)
        cursor.text_offset += len(strings[-1])
    return {
        "tokens": strings,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _joined(first: dict, second: dict) -> dict:
    return {key: first[key] + second[key] for key in first}


def usage(outputs: list[RequestOutput], n: int) -> dict:
    """Token counts of a request whose prompts each had ``n`` choices (a prompt counts once)."""
    firsts = outputs[::n]
    prompt = sum(len(out.prompt_token_ids) for out in firsts)
    completion = sum(len(out.token_ids) for out in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(out.num_cached_tokens for out in firsts)},
    }


def vllm_prompt_logprobs(out: RequestOutput) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` of a choice: per prompt token, by token id, its logprob, rank
    and text."""
    return [
        None
        if entry is None
        else {
            str(token): {
                "logprob": _logprob(lp.logprob),
                "rank": lp.rank,
                "decoded_token": lp.token,
            }
            for token, lp in entry.items()
        }
        for entry in out.prompt_logprobs
    ]


class CompletionFormat:
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(
        self,
        logprobs: int | None,
        attention_entropy: bool = False,
        *,
        echo: Tokenizer | None = None,
        prompt_logprobs: bool = False,
        prompt_only: bool = False,
    ) -> None:
        """``echo``: the tokenizer that writes the prompt back, where the request echoes it;
        ``prompt_only``: nothing was asked to be generated (echo with max_tokens 0)."""
        self.logprobs = logprobs
        self.with_logprobs = logprobs is not None
        self.attention_entropy = attention_entropy
        self.echo, self.prompt_logprobs, self.prompt_only = echo, prompt_logprobs, prompt_only

    def reported(self, out: RequestOutput) -> RequestOutput:
        """A whole output as it is reported: with ``prompt_only``, without the token computed
        only to end the request."""
        if not self.prompt_only:
            return out
        return dataclasses.replace(
            out, text="", token_ids=[], entropies=[], tempered_entropies=[], temperatures=[],
            logprobs=None if out.logprobs is None else [], finish_reason="length",
        )  # fmt: skip

    def choice(self, index: int, out: RequestOutput, cursor: Cursor, delta: Delta) -> dict:
        text, logprobs = delta.text, None
        if self.echo is not None:
            prompt = out.prompt
            if prompt is None:
                prompt = self.echo.decode(out.prompt_token_ids, skip_special_tokens=False)
            text = prompt + text
            if self.logprobs is not None:
                prompt_scores = zip(out.prompt_token_ids, out.prompt_logprobs, strict=True)
                logprobs = legacy_logprobs(prompt_scores, cursor, self.echo.token_text)
        if self.logprobs is not None:
            generated = completion_logprobs(out, delta.tokens, cursor)
            logprobs = generated if logprobs is None else _joined(logprobs, generated)
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": out.finish_reason,
            "etinfer": telemetry(out, delta, self.attention_entropy),
        }
        if self.prompt_logprobs:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(out)
        return choice

    chunk_choice = choice

    def opening_chunk_choices(self, num_choices: int) -> list[dict]:
        return []


class ChatFormat:
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def reported(self, out: RequestOutput) -> RequestOutput:
        return out

    def __init__(
        self,
        top_logprobs: int | None,
        attention_entropy: bool = False,
        tools: ToolCalling | None = None,
    ) -> None:
        self.top_logprobs = top_logprobs  # None: no logprobs
        self.with_logprobs = top_logprobs is not None
        self.attention_entropy = attention_entropy
        self.tools = tools
        self._streams: dict[int, ToolCallStream] = {}  # per streamed choice, under tools

    def _logprobs(self, out: RequestOutput, delta: Delta) -> dict | None:
        if self.top_logprobs is None:
            return None
        return chat_logprobs(out, delta.tokens, self.top_logprobs)

    def choice(self, index: int, out: RequestOutput, cursor: Cursor, delta: Delta) -> dict:
        message: dict = {"role": "assistant", "content": delta.text}
        finish_reason = out.finish_reason
        if self.tools is not None:
            content, calls = self.tools.parse(out.text)
            message["content"] = content
            if calls:
                message["tool_calls"] = [call.as_dict() for call in calls]
                finish_reason = _tool_finish(finish_reason)
        return {
            "index": index,
            "message": message,
            "logprobs": self._logprobs(out, delta),
            "finish_reason": finish_reason,
            "etinfer": telemetry(out, delta, self.attention_entropy),
        }

    def chunk_choice(self, index: int, out: RequestOutput, cursor: Cursor, delta: Delta) -> dict:
        finish_reason = out.finish_reason
        if self.tools is None:
            fields = {"content": delta.text} if delta.text else {}
        else:
            stream = self._streams.setdefault(index, ToolCallStream(self.tools))
            fields = stream.delta(out.text, out.finished)
            if stream.calls:
                finish_reason = _tool_finish(finish_reason)
        return {
            "index": index,
            "delta": fields,
            "logprobs": self._logprobs(out, delta),
            "finish_reason": finish_reason,
            "etinfer": telemetry(out, delta, self.attention_entropy),
        }

    def opening_chunk_choices(self, num_choices: int) -> list[dict]:
        """OpenAI opens a chat stream with the role of each choice, before any token."""
        return [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(num_choices)
        ]


def _tool_finish(reason: str | None) -> str | None:
    """A reply that ended by itself in calls finishes with "tool_calls", as OpenAI's do."""
    return "tool_calls" if reason == "stop" else reason
