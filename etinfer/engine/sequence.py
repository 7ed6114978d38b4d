"""One request as the engine tracks it: its tokens, its KV blocks, and what it has produced."""

from __future__ import annotations

import enum
import math
from typing import NamedTuple

import torch

from etinfer.control.entropy_profile import EntropyProfile
from etinfer.control.sparse_prefill import AttentionProfile
from etinfer.control.switching import SwitchState
from etinfer.control.temperature import temperature_law
from etinfer.engine.detokenizer import Detokenizer
from etinfer.engine.sampling.sampler import SamplerOutput
from etinfer.outputs import Logprob, RequestMetrics, RequestOutput
from etinfer.sampling_params import SamplingParams
from etinfer.structured.backend import Matcher
from etinfer.structured.masks import ConstraintTrace


class StopRule(NamedTuple):
    """What ends every request of an engine, besides its own sampling parameters."""

    eos_token_ids: tuple[int, ...]
    max_model_len: int


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request_id: str,
        arrival_index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        detokenizer: Detokenizer,
        *,
        prompt: str | None,
        arrival_time: float,
        stream: bool,
        delta: bool = False,
        forced_token_ids: list[int] | None = None,
        priority: int = 0,
        slo: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.arrival_index = arrival_index
        self.arrival_time = arrival_time
        self.arrival_step = 0  # the scheduler's step count when it was added
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)  # shared by every output: never changed
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.detokenizer = detokenizer
        self.stream = stream  # an output after every step that extends it
        self.delta = delta  # those outputs carry only what their step added
        self._sent_tokens = self._sent_blocks = 0  # what earlier deltas carried
        # Tokens appended as if sampled, one per step, before sampling takes over (teacher
        # forcing: scoring text under decode, feeding a question as decode steps).
        self.forced = list(reversed(forced_token_ids or []))  # a stack: next one last
        self.status = SequenceStatus.WAITING
        self.priority = priority  # lower value first, as in vLLM
        self.slo = slo  # seconds from arrival within which it wants to finish, if any

        self.num_computed_tokens = 0  # tokens whose keys and values are in the cache
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # content hashes of full blocks, computed as needed
        self.num_registered_blocks = 0  # leading blocks published in the prefix cache
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.steps_since_admitted = 0  # steps scheduled since it last entered the running set

        self.entropies: list[float] = []
        self.tempered_entropies: list[float] = []
        self.temperatures: list[float] = []
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.error: str | None = None  # with finish_reason "error": what failed
        self.metrics = RequestMetrics(arrival_time)
        self.generator: torch.Generator | None = None  # set by the runner for seeded requests
        # Control state carried from step to step (the engine writes it, the laws read it
        # through the step's ControlRecord): the predictive entropy measured so far, the
        # temperature law's state (log T, or Mirostat's mu) and the blocks kept last step.
        self.profile = EntropyProfile()
        self.temperature_state = temperature_law(params).initial_state(params)
        self.block_budget: int | None = None
        self.blocks_kept: list[float] = []  # per generated token, when pruning is on
        self.dropped_mass: list[float] = []
        # Speculative decoding: the heuristic schedule's next draft length, and the totals.
        self.draft_length: int | None = None  # None: the configured length
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # Entropy Adaptive Decoding: which model writes the next token (None: switching off),
        # which wrote each output token, and where the small model's current stretch began
        # (the layers above its exit hold nothing from there on).
        self.switch: SwitchState | None = None
        # Sparse prefill: attention entropy and budgets per segment, and the work skipped.
        self.attention_profile: AttentionProfile | None = None
        # KV compression: the queries that rank the cache, until it is compressed; then how
        # many fewer cache entries than positions the sequence has (position - kv_offset is
        # the cache index of a position after the compression).
        self.voting_queries: torch.Tensor | None = None
        self.voted: torch.Tensor | None = None  # which voters' queries were computed
        self.kv_compressed = False
        self.kv_offset = 0
        self.token_models: list[str] = []
        self.exit_start: int | None = None
        # Structured output: the grammar's matcher (set when the grammar is compiled; every
        # sampled token goes through it) and what its masks did, per generated token.
        self.constraint: Matcher | None = None
        self.constraint_trace = ConstraintTrace() if params.structured is not None else None

    def append_sampled(
        self,
        out: SamplerOutput,
        row: int,
        logprobs: dict[int, Logprob] | None,
        now: float,
        stop: StopRule,
    ) -> None:
        """Take the token this step sampled for it (row ``row`` of ``out``), with what the
        sampler measured (the entropy signal into the profile, the temperature law's state),
        and finish if the token ends the request."""
        token = out.token_ids[row]
        if self.forced:
            self.forced.pop()  # the sampler already put it in place of a sampled token
        if self.constraint is not None and not self.constraint.accept(token):
            self.finish_reason = "grammar_dead_end"  # its mask allowed nothing
            return
        if self.constraint_trace is not None and out.masked_entropies is not None:
            self.constraint_trace.append(
                out.masked_entropies[row], out.removed_mass[row], out.allowed_counts[row]
            )
        self.token_ids.append(token)
        self.entropies.append(out.entropies[row])
        self.tempered_entropies.append(out.tempered_entropies[row])
        self.temperatures.append(out.temperatures[row])
        self.profile.update(out.predictive_entropy[row], out.predictive_entropy_upper[row])
        if not math.isnan(out.states[row]):
            self.temperature_state = out.states[row]
        if self.logprobs is not None:
            self.logprobs.append(logprobs)
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        params = self.params
        if (
            self.detokenizer.append(token)  # a stop string
            or token in params.stop_token_ids
            or (not params.ignore_eos and token in stop.eos_token_ids)
            or (self.constraint is not None and self.constraint.is_terminated)
        ):
            self.finish_reason = "stop"
        elif self.num_output_tokens >= params.max_tokens or self.num_tokens >= stop.max_model_len:
            self.finish_reason = "length"

    def record_attention(self, kept: float, total: float, dropped_mass: float) -> None:
        """One generated token's decode attention: (block, KV head) pairs kept and in context
        over all layers, and the bound on the attention mass any layer dropped."""
        self.blocks_kept.append(kept / total if total else 1.0)
        self.dropped_mass.append(dropped_mass)

    def _trace_since(self, start: int) -> ConstraintTrace | None:
        return None if self.constraint_trace is None else self.constraint_trace.since(start)

    def draft_room(self, max_model_len: int) -> int:
        """How many tokens may be drafted after the next one: what ``max_tokens`` and the
        context leave (the next one itself counts)."""
        return min(
            self.params.max_tokens - self.num_output_tokens - 1, max_model_len - self.num_tokens - 1
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def writes_models(self) -> bool:
        """Whether outputs name the model that wrote each token: under switching, and under
        speculation (which records every sampled token's writer)."""
        return self.switch is not None or bool(self.token_models)

    @property
    def num_full_tokens(self) -> int:
        """Tokens whose keys and values are in the cache in every layer."""
        if self.exit_start is None:
            return self.num_computed_tokens
        return min(self.num_computed_tokens, self.exit_start)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def next_forced(self) -> int | None:
        return self.forced[-1] if self.forced else None

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def step_output(self) -> RequestOutput:
        """What a stream gets after a step: a delta, or the whole output so far."""
        return self.next_delta() if self.delta else self.output()

    def next_delta(self) -> RequestOutput:
        """What this sequence produced since its previous delta. It copies only that, so a
        stream costs the same per step however long it grows (the prompt ids are shared)."""
        tokens, blocks = self._sent_tokens, self._sent_blocks
        self._sent_tokens, self._sent_blocks = self.num_output_tokens, len(self.blocks_kept)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            text=self.detokenizer.new_text(self.is_finished),
            token_ids=self.token_ids[self.num_prompt_tokens + tokens :],
            entropies=self.entropies[tokens:],
            tempered_entropies=self.tempered_entropies[tokens:],
            temperatures=self.temperatures[tokens:],
            logprobs=None if self.logprobs is None else self.logprobs[tokens:],
            finish_reason=self.finish_reason,
            error=self.error,
            metrics=RequestMetrics(**vars(self.metrics)),
            num_cached_tokens=self.num_cached_tokens,
            num_preemptions=self.num_preemptions,
            entropic_time=self.profile.entropic_time,
            blocks_kept=self.blocks_kept[blocks:] or None,
            dropped_mass=self.dropped_mass[blocks:] or None,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            token_models=self.token_models[tokens:] if self.writes_models else None,
            attention_profile=self.attention_profile,
            constraint=self._trace_since(tokens),
            delta=True,
        )

    def output(self) -> RequestOutput:
        """The whole output so far, a snapshot: later steps do not change it."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            text=self.detokenizer.visible_text(self.is_finished),
            token_ids=self.output_token_ids,
            entropies=list(self.entropies),
            tempered_entropies=list(self.tempered_entropies),
            temperatures=list(self.temperatures),
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=self.finish_reason,
            error=self.error,
            metrics=RequestMetrics(**vars(self.metrics)),
            num_cached_tokens=self.num_cached_tokens,
            num_preemptions=self.num_preemptions,
            entropic_time=self.profile.entropic_time,
            blocks_kept=list(self.blocks_kept) or None,
            dropped_mass=list(self.dropped_mass) or None,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            token_models=list(self.token_models) if self.writes_models else None,
            attention_profile=self.attention_profile,
            constraint=self._trace_since(0),
        )
