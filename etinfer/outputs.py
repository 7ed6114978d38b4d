"""What a request produces: its text and tokens, the entropy signal per token, and timings."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from etinfer.control.record import TARGET_MODEL
from etinfer.control.sparse_prefill import AttentionProfile
from etinfer.structured.masks import ConstraintTrace

# "stop", "length" or "abort"; "grammar_dead_end" when a structured output's grammar left no
# token to emit, "error" when it could not be compiled.
FINISH_REASONS = ("stop", "length", "abort", "grammar_dead_end", "error")


@dataclass
class RequestMetrics:
    """Wall-clock instants (``time.perf_counter()``) of one request's life, durations, and the
    KV blocks it held at the end."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # KV-cache blocks the request held when it finished (0 if it never ran): what it cost the
    # pool at the end, with or without anything that compresses the cache.
    kv_blocks: int = 0
    # Sparse prefill: the share of dense prefill attention's (query, key) pairs it skipped.
    prefill_attention_skipped: float = 0.0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def total_time(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass(frozen=True)
class Logprob:
    """Log-probability of one token under the model's own distribution (temperature 1)."""

    logprob: float
    rank: int  # 1 for the most likely token
    token: str


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    # One value per generated token. `entropies` is the model's own uncertainty (temperature 1,
    # before any filtering, nats); `tempered_entropies` is the entropy of the distribution the
    # token was actually drawn from (after temperature and top-k/top-p/min-p; 0 when greedy).
    entropies: list[float]
    tempered_entropies: list[float]
    temperatures: list[float]
    # Per generated token: the sampled token and the top-N, by token id (None unless requested).
    logprobs: list[dict[int, Logprob]] | None
    # One of FINISH_REASONS; None while running.
    finish_reason: str | None
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    # Sum of the irreversible entropy reductions max(0, H[t-1] - H[t]) of the control signal.
    entropic_time: float = 0.0
    # With pruning on, per decode step (one fewer than generated tokens: the first comes from the
    # prefill): the share of the context's (block, KV head) pairs decode attention read, and an
    # upper bound of the attention mass it dropped.
    blocks_kept: list[float] | None = None
    dropped_mass: list[float] | None = None
    # Speculative decoding: tokens drafted for this request and those the model accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Entropy Adaptive Decoding: per generated token, the model that wrote it ("target" or
    # "exit"); None when switching is off.
    token_models: list[str] | None = None
    # Sparse prefill (long prompts): attention entropy and budget per segment, layer and KV
    # head; None where the prompt attended densely throughout (sparse prefill off, or short).
    attention_profile: AttentionProfile | None = None
    # With finish_reason "error": what failed (a grammar that did not compile, a step that
    # raised, naming its stage).
    error: str | None = None
    # Structured output: per generated token, what the grammar's mask did (None without one).
    constraint: ConstraintTrace | None = None
    # With SamplingParams.prompt_logprobs: per prompt token (None for the first), its
    # log-probability and the top-N, by token id; complete once the prompt is prefilled.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # A delta (streamed with delta=True) carries only what its step added: the per-token lists
    # and the text cover the new tokens, everything else is the request's state now.
    delta: bool = False

    @classmethod
    def accumulating(cls, first: RequestOutput) -> RequestOutput:
        """A whole output to ``merge`` deltas into, starting from the first delta (copied: the
        caller may hold it)."""
        return dataclasses.replace(
            first,
            token_ids=list(first.token_ids),
            entropies=list(first.entropies),
            tempered_entropies=list(first.tempered_entropies),
            temperatures=list(first.temperatures),
            logprobs=None if first.logprobs is None else list(first.logprobs),
            blocks_kept=None if first.blocks_kept is None else list(first.blocks_kept),
            dropped_mass=None if first.dropped_mass is None else list(first.dropped_mass),
            constraint=None if first.constraint is None else first.constraint.since(0),
            delta=False,
        )

    def merge(self, delta: RequestOutput) -> None:
        """Extend this output, in place, by a later delta of the same request. The per-token
        lists grow by what the delta carries; the text is concatenated, a copy of the text so
        far (CPython cannot extend a string held by an attribute in place), which at a few
        bytes per token stays far below the step that produced it."""
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.entropies += delta.entropies
        self.tempered_entropies += delta.tempered_entropies
        self.temperatures += delta.temperatures
        if self.logprobs is not None:
            self.logprobs += delta.logprobs
        if delta.blocks_kept:
            if self.blocks_kept is None:
                self.blocks_kept, self.dropped_mass = [], []
            self.blocks_kept += delta.blocks_kept
            self.dropped_mass += delta.dropped_mass
        self.prompt_logprobs = delta.prompt_logprobs
        self.finish_reason = delta.finish_reason
        self.error = delta.error
        self.metrics = delta.metrics
        self.num_cached_tokens = delta.num_cached_tokens
        self.num_preemptions = delta.num_preemptions
        self.entropic_time = delta.entropic_time
        self.num_draft_tokens = delta.num_draft_tokens
        self.num_accepted_tokens = delta.num_accepted_tokens
        self.attention_profile = delta.attention_profile
        if delta.constraint is not None:
            self.constraint = (self.constraint or ConstraintTrace()).extended(delta.constraint)
        if delta.token_models is not None:
            self.token_models = (self.token_models or []) + delta.token_models

    @property
    def collapse_rate(self) -> float:
        """Entropic time per generated token."""
        return self.entropic_time / len(self.token_ids) if self.token_ids else 0.0

    @property
    def large_model_share(self) -> float | None:
        """With switching on: the share of the generated tokens the large model wrote."""
        if not self.token_models:
            return None
        return self.token_models.count(TARGET_MODEL) / len(self.token_models)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
