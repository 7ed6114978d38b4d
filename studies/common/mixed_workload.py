"""The ablation's workload: one seeded, heterogeneous mix of requests arriving over time.

The paper (section 6.3) samples prompts "from a heterogeneous mixture of instruction-following,
long-context reasoning, and free-form generation tasks". Here, five tasks, all from text that
ships with Python or with this package (nothing is downloaded):

- ``retrieval``: passkey retrieval in the Landmark format of ``bench/common/fidelity.py`` (the key
  in 2K-3K tokens of its repeated filler, at a depth that cycles). The question runs as forced
  decode steps, so it is answered under pruning; ten greedy tokens follow, scored by their first
  integer. The repeated filler, not varied text: on varied text the dense baseline itself missed
  every key at these lengths (SmolLM2-135M), which leaves nothing to compare.
- Documents: 2K-3K tokens of human-written text (CPython's ``pydoc_data.topics``), each read by
  two requests, as several requests over one document would:
  - ``continuation``: continued greedily; its reference is the text that really follows the
    window in the corpus, written by people and shipped by CPython;
  - ``free``: continued by sampling (free-form generation).
- ``instruction``: a chat-templated instruction from ``bench/common/prompts.py``, answered greedily
  (a base model without a chat template, such as Gemma 3 270M, reads it as "Question: ...
  Answer:").
- ``chat``: another instruction of that kind, answered by sampling.

Requests that share a document, and retrieval prompts up to their needles, share a prefix, so
the prefix cache prefills most long text once. That puts the long-context cost where the
paper's regime has it, in decoding over long contexts: on two CPU cores prefill runs at 150-300
tokens/s, and re-reading each document per request would bury every other cost under prefill.

Greedy requests stay greedy under every configuration (the sampling layer only takes over
sampled requests), so their answers can be compared with the baseline's. Sampled requests sample
at temperature 1 unless the sampling layer regulates them, each with its own seed, which changes
from repeat to repeat: configurations compare on the same draws, repeats on different ones.

Every request decodes exactly ``max_tokens`` tokens (EOS ignored, as in vLLM's serving
benchmark), so every configuration does the same work; quality reads the text up to the first
EOS.

The ``long`` workload is the paper's regime (its argument rests on decode attention being a
large share of a step): only retrieval and documents, 4K-7.5K tokens each, every document its
own window of the corpus, decodes of 128 (continuation) and 512 tokens (free generation).

``long-scored`` is the same regime with enough scored cases to tell arms apart (66, where
``long`` has 12): 30 passkeys (six at each depth) and 18 documents, each read by a continuation
(ROUGE-L against the human text that follows) and by a ``likelihood`` request, which is fed
that human text as forced decode steps and scores the log-probability the model gave each of
its tokens: teacher-forced, under whatever attention the arm reads. No sampled request: every
case compares with the baseline's on the same tokens. Its runs are long (prefill of some 230K
tokens an arm); run it at a concurrency rather than at arrival times.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from etinfer.bench.common.driver import Request
from etinfer.bench.common.fidelity import DEPTHS, corpus_tokens, passkey_cases
from etinfer.bench.common.prompts import instructions
from etinfer.bench.common.workload import arrival_times
from etinfer.model.tokenizer import Tokenizer
from etinfer.sampling_params import SamplingParams

REFERENCE_SOURCE = "CPython's pydoc_data.topics (the Python Language Reference)"
SAMPLED_TEMPERATURE = 1.0  # the baseline's fixed temperature

# Per workload: retrieval requests, documents (each read by a continuation and a free request)
# and short requests of each task.
MIXES: dict[str, dict[str, int]] = {
    "mixed": {"retrieval": 4, "documents": 4, "instruction": 8, "chat": 8},
    "long": {"retrieval": 6, "documents": 6},
    "long-scored": {"retrieval": 30, "scored_documents": 18},
    "chat": {"instruction": 12, "chat": 12},
    "retrieval": {"retrieval": 12},
}


@dataclass(frozen=True)
class Sizes:
    """How long prompts and outputs are, and how fast requests arrive."""

    document_tokens: tuple[int, int]  # a long prompt's length, drawn uniformly in this range
    max_tokens: dict[str, int]  # tokens generated per task (retrieval: after the question)
    rate: float  # requests per second (Poisson); infinite: all at once
    cap: int | None = None  # at most this many of each kind (retrieval, documents, short tasks)


# Arrivals just above capacity, so that queues form and drain and ordering matters. The float32
# engine served this mix at about 0.28 req/s (one thread, CPU clock, 2026-11-21), when the rate
# was 0.3; today's engine (4-bit weights, a float16 cache, two threads) stepped 80.5 of a
# 96.6-second run at 0.3 req/s (2026-11-26): about 0.35 req/s of capacity.
FULL = Sizes(
    document_tokens=(2048, 3072),
    max_tokens={"retrieval": 10, "continuation": 64, "free": 128, "instruction": 64, "chat": 96},
    rate=0.36,
)
# The paper's regime: distinct documents of 4-7.5K tokens (the model's context is
# 8,192, and each request must fit with its output), passkeys at the same lengths, decodes of
# 128 and 512 tokens. At 0.04 req/s the baseline engine stepped 379 of the run's 455 CPU-clock
# seconds (two threads, 2026-11-26): its capacity is about 0.047 req/s, so requests arrive a
# little faster than that and queues form.
LONG = Sizes(
    document_tokens=(4096, 7680),
    max_tokens={"retrieval": 10, "continuation": 128, "free": 512, "likelihood": 64},
    rate=0.05,
)
# Small enough for a test: one request of each task, long prompts of 384-512 tokens (pruned
# because quick mode lowers PruningConfig.min_context to 256; their prefill is most of a quick
# run), all arriving at once so that the scheduler has a queue to order.
QUICK = Sizes(
    document_tokens=(384, 512),
    max_tokens={
        "retrieval": 6,
        "continuation": 12,
        "free": 16,
        "likelihood": 12,
        "instruction": 12,
        "chat": 16,
    },
    rate=math.inf,
    cap=1,
)
SIZES = {"full": FULL, "long": LONG, "long-scored": LONG, "quick": QUICK}


@dataclass(frozen=True, kw_only=True)
class AblationRequest(Request):
    """A request of the driver (its prompt: token ids), with its task and what scores it."""

    task: str
    key: int | None = None  # retrieval: the pass key
    reference: list[int] | None = None  # continuation: the human-written text that follows

    @property
    def greedy(self) -> bool:
        return self.params.greedy


def build(tokenizer: Tokenizer, mix: str, sizes: Sizes, seed: int) -> list[AblationRequest]:
    """The requests of one run, in arrival order (sampling seeds for repeat 0)."""
    rng = np.random.default_rng(seed)
    counts = {kind: min(n, sizes.cap or n) for kind, n in MIXES[mix].items()}
    makers = _Makers(tokenizer, sizes, rng, counts)
    requests = [makers.retrieval() for _ in range(counts.get("retrieval", 0))]
    requests += [r for _ in range(counts.get("documents", 0)) for r in makers.document()]
    requests += [
        r for _ in range(counts.get("scored_documents", 0)) for r in makers.document(scored=True)
    ]
    requests += [makers.instruction(task) for task in ("instruction", "chat")
                 for _ in range(counts.get(task, 0))]  # fmt: skip
    order = rng.permutation(len(requests))
    arrivals = arrival_times(len(requests), sizes.rate, 1.0, rng)
    return [
        dataclasses.replace(requests[i], arrival_s=float(a))
        for i, a in zip(order, arrivals, strict=True)
    ]


def for_repeat(requests: list[AblationRequest], repeat: int) -> list[AblationRequest]:
    """The same requests with the sampling seeds of ``repeat``."""
    return [
        r
        if r.greedy
        else dataclasses.replace(r, params=dataclasses.replace(r.params, seed=1000 * repeat + i))
        for i, r in enumerate(requests)
    ]


def answers(
    requests: Sequence[AblationRequest], outputs: Sequence, eos: tuple[int, ...]
) -> list[list[int]]:
    """What each request answered: its output's tokens after the forced ones, up to the first
    EOS."""
    found = []
    for request, output in zip(requests, outputs, strict=True):
        tokens = output.token_ids[len(request.forced) :]
        ends = [i for i, t in enumerate(tokens) if t in eos]
        found.append(tokens[: ends[0]] if ends else tokens)
    return found


class _Makers:
    """Builds the requests of each task; keeps the corpus and the depth counter."""

    def __init__(
        self, tokenizer: Tokenizer, sizes: Sizes, rng: np.random.Generator, counts: dict[str, int]
    ) -> None:
        self.tokenizer, self.sizes, self.rng = tokenizer, sizes, rng
        documents = counts.get("documents", 0) + counts.get("scored_documents", 0)
        self.corpus = corpus_tokens(tokenizer) if documents else []
        # Greedy and sampled instructions are different prompts (topic-major order).
        self.instructions = iter(instructions(counts.get("instruction", 0) + counts.get("chat", 0)))
        self.retrievals = 0

    def _params(self, task: str, greedy: bool, extra: int = 0, **more) -> SamplingParams:
        return SamplingParams(
            temperature=0.0 if greedy else SAMPLED_TEMPERATURE,
            max_tokens=self.sizes.max_tokens[task] + extra,
            ignore_eos=True,
            seed=None if greedy else 0,
            **more,
        )

    def retrieval(self) -> AblationRequest:
        """A passkey prompt, the needle at the next depth in turn from a quarter of the way."""
        low, high = self.sizes.document_tokens
        length = int(self.rng.integers(low, high + 1))
        seed = int(self.rng.integers(2**31))
        self.retrievals += 1
        cases = passkey_cases(self.tokenizer, (length,), "repeated", seed)  # one per depth
        case = cases[self.retrievals % len(DEPTHS)]
        params = self._params("retrieval", True, extra=len(case.question))
        return AblationRequest(
            0.0, case.prompt, params, forced=case.question, task="retrieval", key=case.key
        )

    def document(self, scored: bool = False) -> list[AblationRequest]:
        """A window of the corpus, and its continuation request and its free one (or, when
        ``scored``, its likelihood request: the human text that follows, forced)."""
        low, high = self.sizes.document_tokens
        length = int(self.rng.integers(low, high + 1))
        follow = self.sizes.max_tokens["continuation"]
        start = int(self.rng.integers(0, len(self.corpus) - length - follow))
        prompt = self.corpus[start : start + length]
        reference = self.corpus[start + length : start + length + follow]
        continuation = AblationRequest(
            0.0,
            prompt,
            self._params("continuation", True),
            task="continuation",
            reference=reference,
        )
        if not scored:
            return [
                continuation,
                AblationRequest(0.0, prompt, self._params("free", False), task="free"),
            ]
        forced = reference[: self.sizes.max_tokens["likelihood"]]  # every token it decodes
        params = self._params("likelihood", True, logprobs=0)
        return [
            continuation,
            AblationRequest(0.0, prompt, params, forced=forced, task="likelihood"),
        ]

    def instruction(self, task: str) -> AblationRequest:
        content = next(self.instructions)
        if self.tokenizer.chat_template is None:
            prompt = self.tokenizer.encode(f"Question: {content}\nAnswer:")
        else:
            prompt = self.tokenizer.encode_chat([{"role": "user", "content": content}])
        return AblationRequest(0.0, prompt, self._params(task, task == "instruction"), task=task)
