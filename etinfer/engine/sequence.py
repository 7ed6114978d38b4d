"""One request as the engine tracks it: its tokens, its KV blocks, the entropy signal and what it
has produced; each optional layer keeps its state of the request in an object of its own, hung
here under the layer's name."""

from __future__ import annotations

import enum
import math
from typing import NamedTuple

import torch

from etinfer.control.drafting import SpeculationState
from etinfer.control.entropy_profile import EntropyProfile
from etinfer.control.kv_compression import KVCompressionState
from etinfer.control.pruning_state import PruningState
from etinfer.control.sparse_prefill import AttentionProfile
from etinfer.control.switching import SwitchingState
from etinfer.control.temperature import temperature_law
from etinfer.engine.detokenizer import Detokenizer
from etinfer.engine.sampling.sampler import SamplerOutput
from etinfer.outputs import Logprob, RequestMetrics, RequestOutput
from etinfer.sampling_params import SamplingParams
from etinfer.structured.backend import Matcher
from etinfer.structured.masks import StructuredState


class StopRule(NamedTuple):
    """What ends every request of an engine, besides its own sampling parameters."""

    eos_token_ids: tuple[int, ...]
    max_model_len: int


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    # Each optional layer's state of this request, set by the layer when the request enters
    # (``engine/layers.py``); None where the layer is off for it. The core reads what it must
    # through the accessors below.
    pruning: PruningState | None = None
    speculation: SpeculationState | None = None
    switching: SwitchingState | None = None
    # Sparse prefill's selector sets it where a long prompt's prefill begins (a fresh one where
    # it restarts: the old one stays with the outputs that hold it).
    sparse_prefill: AttentionProfile | None = None
    kv_compression: KVCompressionState | None = None
    structured: StructuredState | None = None

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
        self._sent_tokens = 0  # what earlier deltas carried
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
        # Per prompt token, None for the first (nothing precedes it); filled as prefill runs.
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        # Which model wrote each output token, where a smaller model writes some: speculation
        # (accepted drafts) and switching both append to it, neither touching the other's state.
        self.token_models: list[str] = []
        self.finish_reason: str | None = None
        self.error: str | None = None  # with finish_reason "error": what failed
        self.metrics = RequestMetrics(arrival_time)
        self.generator: torch.Generator | None = None  # set by the runner for seeded requests
        # The entropy signal every law reads, whatever layers are on (the engine writes it,
        # the laws read it through the step's ControlRecord): the predictive entropy measured
        # so far, and the temperature law's state (log T, or Mirostat's mu).
        self.profile = EntropyProfile()
        self.temperature_state = temperature_law(params).initial_state(params)

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
        matcher = self.matcher
        if matcher is not None and not matcher.accept(token):
            self.finish_reason = "grammar_dead_end"  # its mask allowed nothing
            return
        if self.structured is not None and out.masked_entropies is not None:
            self.structured.trace.append(
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
            or (matcher is not None and matcher.is_terminated)
        ):
            self.finish_reason = "stop"
        elif self.num_output_tokens >= params.max_tokens or self.num_tokens >= stop.max_model_len:
            self.finish_reason = "length"

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
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def next_forced(self) -> int | None:
        return self.forced[-1] if self.forced else None

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    # -- what the core and the control record read of the layers' state ------------------

    @property
    def num_full_tokens(self) -> int:
        """Tokens whose keys and values are in the cache in every layer (switching's small
        model fills only its own from where its stretch began)."""
        exit_start = None if self.switching is None else self.switching.exit_start
        if exit_start is None:
            return self.num_computed_tokens
        return min(self.num_computed_tokens, exit_start)

    @property
    def kv_offset(self) -> int:
        """Cache entries KV compression dropped: the cache holds computed tokens - offset."""
        return 0 if self.kv_compression is None else self.kv_compression.offset

    @property
    def kv_compressed(self) -> bool:
        """Whether its blocks hold a selection of positions rather than a prefix."""
        return self.kv_compression is not None and self.kv_compression.compressed

    @property
    def block_budget(self) -> int | None:
        return None if self.pruning is None else self.pruning.block_budget

    @property
    def last_blocks_kept(self) -> float:
        """The share of the context decode attention read last step (1: all)."""
        return 1.0 if self.pruning is None else self.pruning.last_share

    @property
    def draft_length(self) -> int | None:
        if self.speculation is None:
            return None
        return self.speculation.next_length(self.num_output_tokens)

    @property
    def matcher(self) -> Matcher | None:
        """Its grammar's matcher, once compiled (None: unconstrained)."""
        return None if self.structured is None else self.structured.matcher

    @property
    def writes_models(self) -> bool:
        """Whether outputs name the model that wrote each token: under switching, and under
        speculation (which records every sampled token's writer)."""
        return self.switching is not None or bool(self.token_models)

    # -- outputs ---------------------------------------------------------------------------

    def step_output(self) -> RequestOutput:
        """What a stream gets after a step: a delta, or the whole output so far."""
        return self.next_delta() if self.delta else self.output()

    def next_delta(self) -> RequestOutput:
        """What this sequence produced since its previous delta. It copies only that, so a
        stream costs the same per step however long it grows (the prompt ids are shared)."""
        tokens, self._sent_tokens = self._sent_tokens, self.num_output_tokens
        blocks, pruning = 0, self.pruning
        if pruning is not None:
            blocks, pruning.reported = pruning.reported, len(pruning.blocks_kept)
        return self._output(tokens, blocks, delta=True)

    def output(self) -> RequestOutput:
        """The whole output so far, a snapshot: later steps do not change it."""
        return self._output(0, 0, delta=False)

    def _output(self, tokens: int, blocks: int, *, delta: bool) -> RequestOutput:
        """The output from output token ``tokens`` and pruning entry ``blocks`` on (copies):
        the whole output from (0, 0), or a delta that shares the prompt ids."""
        pruning, speculation, structured = self.pruning, self.speculation, self.structured
        detokenizer, finished = self.detokenizer, self.is_finished
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids if delta else list(self.prompt_token_ids),
            text=detokenizer.new_text(finished) if delta else detokenizer.visible_text(finished),
            token_ids=self.token_ids[self.num_prompt_tokens + tokens :],
            entropies=self.entropies[tokens:],
            tempered_entropies=self.tempered_entropies[tokens:],
            temperatures=self.temperatures[tokens:],
            logprobs=None if self.logprobs is None else self.logprobs[tokens:],
            # Complete before any output (prefill scores it): a delta shares it, as the ids.
            prompt_logprobs=self.prompt_logprobs
            if delta or self.prompt_logprobs is None
            else list(self.prompt_logprobs),
            finish_reason=self.finish_reason,
            error=self.error,
            metrics=RequestMetrics(**vars(self.metrics)),
            num_cached_tokens=self.num_cached_tokens,
            num_preemptions=self.num_preemptions,
            entropic_time=self.profile.entropic_time,
            blocks_kept=None if pruning is None else (pruning.blocks_kept[blocks:] or None),
            dropped_mass=None if pruning is None else (pruning.dropped_mass[blocks:] or None),
            num_draft_tokens=0 if speculation is None else speculation.num_draft_tokens,
            num_accepted_tokens=0 if speculation is None else speculation.num_accepted_tokens,
            token_models=self.token_models[tokens:] if self.writes_models else None,
            attention_profile=self.sparse_prefill,
            constraint=None if structured is None else structured.trace.since(tokens),
            delta=delta,
        )
