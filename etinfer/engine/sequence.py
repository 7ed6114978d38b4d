"""One request as the engine tracks it: its tokens, its KV blocks, and what it has produced."""

from __future__ import annotations

import enum

import torch

from etinfer.control.entropy_profile import EntropyProfile
from etinfer.engine.detokenizer import Detokenizer
from etinfer.outputs import Logprob, RequestMetrics, RequestOutput
from etinfer.sampling_params import SamplingParams


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
        forced_token_ids: list[int] | None = None,
        priority: int = 0,
        slo: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.arrival_index = arrival_index
        self.arrival_time = arrival_time
        self.arrival_step = 0  # the scheduler's step count when it was added
        self.prompt = prompt
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.detokenizer = detokenizer
        self.stream = stream
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
        self.metrics = RequestMetrics(arrival_time)
        self.generator: torch.Generator | None = None  # set by the runner for seeded requests
        self.profile = EntropyProfile()
        self.control_state = params.initial_control_state()  # log T, or Mirostat's mu
        self.pruning_entropy: float | None = None  # upper side of the latest entropy estimate
        self.block_budget: int | None = None  # blocks kept last step, for the rate limit
        self.blocks_kept: list[float] = []  # per generated token, when pruning is on
        self.dropped_mass: list[float] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

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

    def output(self) -> RequestOutput:
        """A snapshot: later steps do not change it."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.token_ids[: self.num_prompt_tokens],
            text=self.detokenizer.visible_text(self.is_finished),
            token_ids=self.output_token_ids,
            entropies=list(self.entropies),
            tempered_entropies=list(self.tempered_entropies),
            temperatures=list(self.temperatures),
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=self.finish_reason,
            metrics=RequestMetrics(**vars(self.metrics)),
            num_cached_tokens=self.num_cached_tokens,
            num_preemptions=self.num_preemptions,
            entropic_time=self.profile.entropic_time,
            blocks_kept=list(self.blocks_kept) or None,
            dropped_mass=list(self.dropped_mass) or None,
        )
