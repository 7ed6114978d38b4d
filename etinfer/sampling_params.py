"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from etinfer.validation import check_float, check_int

# OpenAI's limit for top_logprobs; vLLM uses the same default cap.
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to turn each step's logits into a token, and when to stop.

    Filters apply in the order transformers uses: temperature, then top-k, then top-p, then
    min-p (min-p compares against the top probability after temperature, as in its paper).
    ``temperature=0`` is greedy decoding on the raw logits.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 keeps every token
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N log-probabilities per generated token (N <= 20)
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.temperature = check_float("temperature", self.temperature, low=0.0)
        self.top_p = check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        self.top_k = check_int("top_k", self.top_k, low=0)
        self.min_p = check_float("min_p", self.min_p, low=0.0, high=1.0)
        if self.seed is not None:
            self.seed = check_int("seed", self.seed, low=0, high=2**63 - 1)
        self.max_tokens = check_int("max_tokens", self.max_tokens, low=1)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list | tuple) or not all(
            isinstance(s, str) and s for s in self.stop
        ):
            raise ValueError(
                f"stop must be a non-empty string or a list of them, got {self.stop!r}"
            )
        self.stop = list(self.stop)
        if not isinstance(self.stop_token_ids, list | tuple):
            raise ValueError(
                f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}"
            )
        self.stop_token_ids = [check_int("stop_token_ids", t, low=0) for t in self.stop_token_ids]
        if self.logprobs is not None:
            self.logprobs = check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
