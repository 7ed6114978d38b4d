"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from etinfer.control.entropy import ESTIMATORS
from etinfer.structured.params import StructuredOutputsParams
from etinfer.validation import check_choice, check_float, check_int

# OpenAI's limit for top_logprobs; vLLM uses the same default cap.
MAX_LOGPROBS = 20
# Feedback gain per nat of entropy error. The loop gain is this times the varentropy V at the
# operating point; on SmolLM2-135M at 2 nats V is mostly 2-6 nats^2 (python -m studies sampling),
# so 0.25 keeps gain * V inside the stable range (0, 2) for nearly every step.
DEFAULT_ENTROPY_GAIN = 0.25
# The temperature laws that regulate the entropy to entropy_target, by their names in
# etinfer.control.temperature.TEMPERATURE_LAWS (which reads requests, so the names live here).
ENTROPY_CONTROLS = ("feedback", "lagged", "exact")


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
    # vLLM's: the log-probability of each prompt token after the first, with its top-N
    # alternatives (N <= 20), computed in prefill; the prompt is then not served from the
    # prefix cache, whose positions would have no logits.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Structured output: a grammar every generated token must follow (a JSON schema, any JSON
    # object, a regex, an EBNF grammar, a choice); a dict is read as StructuredOutputsParams.
    structured: StructuredOutputsParams | None = None

    # Entropy-stabilised sampling, on when entropy_target (nats) is set; `temperature` is then
    # the starting temperature. "feedback" is the paper's law in log-temperature, measuring the
    # entropy at the carried-over temperature on this step's logits before sampling; "lagged" is
    # the paper's literal ordering (measured on the sampled distribution, applied from the next
    # step); "exact" solves H(softmax(z / T)) = target on each step's logits.
    entropy_target: float | None = None
    entropy_control: str = "feedback"
    entropy_gain: float = DEFAULT_ENTROPY_GAIN
    temperature_min: float = 0.1
    temperature_max: float = 1.5  # high temperature wrecks accuracy: keep the ceiling sane
    temperature_rate_limit: float = 0.5  # largest change of log T per step (feedback)
    # How the entropy the controllers read is measured: "exact", "topk" (renormalised top-k) or
    # "tail" (top-k with tail bounds; the midpoint).
    entropy_estimator: str = "exact"
    entropy_topk: int = 64

    # Reference samplers, for comparison. Mirostat v2 (llama.cpp's rule; tau and mu in bits) and
    # EDT: T = temperature * edt_base ** (edt_theta / H), kept within the temperature bounds (the
    # published rule has none, and underflows to T = 0 on a near-certain step).
    mirostat_tau: float | None = None
    mirostat_eta: float = 0.1
    edt_theta: float | None = None
    edt_base: float = 0.8

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
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, check_int(name, getattr(self, name), low=0, high=MAX_LOGPROBS))
        if isinstance(self.structured, dict):
            self.structured = StructuredOutputsParams(**self.structured)
        if self.structured is not None and not isinstance(self.structured, StructuredOutputsParams):
            raise ValueError(
                f"structured must be StructuredOutputsParams or a dict, got {self.structured!r}"
            )
        self._check_controllers()

    def _check_controllers(self) -> None:
        if self.entropy_target is not None:
            self.entropy_target = check_float(
                "entropy_target", self.entropy_target, low=0.0, low_open=True
            )
        check_choice("entropy_control", self.entropy_control, ENTROPY_CONTROLS)
        self.entropy_gain = check_float("entropy_gain", self.entropy_gain, low=0.0, low_open=True)
        self.temperature_min = check_float(
            "temperature_min", self.temperature_min, low=0.0, low_open=True
        )
        self.temperature_max = check_float(
            "temperature_max", self.temperature_max, low=self.temperature_min
        )
        self.temperature_rate_limit = check_float(
            "temperature_rate_limit", self.temperature_rate_limit, low=0.0, low_open=True
        )
        check_choice("entropy_estimator", self.entropy_estimator, ESTIMATORS)
        self.entropy_topk = check_int("entropy_topk", self.entropy_topk, low=1)
        if self.mirostat_tau is not None:
            self.mirostat_tau = check_float(
                "mirostat_tau", self.mirostat_tau, low=0.0, low_open=True
            )
        self.mirostat_eta = check_float("mirostat_eta", self.mirostat_eta, low=0.0, low_open=True)
        if self.edt_theta is not None:
            self.edt_theta = check_float("edt_theta", self.edt_theta, low=0.0, low_open=True)
        self.edt_base = check_float(
            "edt_base", self.edt_base, low=0.0, high=1.0, low_open=True, high_open=True
        )
        chosen = [
            name
            for name in ("entropy_target", "mirostat_tau", "edt_theta")
            if getattr(self, name) is not None
        ]
        if len(chosen) > 1:
            raise ValueError(f"{' and '.join(chosen)} choose different samplers; set only one")
        if chosen and self.greedy:
            raise ValueError(
                f"{chosen[0]} needs temperature > 0 (its starting or base temperature)"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def controller(self) -> str:
        """The temperature law that sets this request's temperature each step (by its name in
        ``etinfer.control.temperature.TEMPERATURE_LAWS``)."""
        if self.entropy_target is not None:
            return self.entropy_control
        if self.mirostat_tau is not None:
            return "mirostat"
        if self.edt_theta is not None:
            return "edt"
        return "fixed"
