"""How closely pruned attention follows dense attention, on real text.

    python -m studies fidelity --output-dir results/fidelity

**Teacher-forced decoding.** Long human-written text (CPython's ``pydoc_data.topics``, as in
calibration) is prefilled up to ``context`` tokens. The next ``steps`` tokens are then fed as
decode steps, so every one of them is predicted under (sparse) attention. One engine runs the
texts densely, then pruned: prefill is dense either way, so the pruned pass takes its prompts
from the prefix cache and both passes see the same cache. Each step gives
``KL(p_dense || p_pruned)``, whether the two agree on the most likely token, and each side's
negative log-likelihood of the true token; the last gives the perplexity ratio.

**Passkey retrieval** uses the Landmark-attention format:

- an instruction, then filler with the sentence "The pass key is K. Remember it. K is the pass
  key." hidden at a given depth;
- the question "What is the pass key? The pass key is", fed as decode steps so that it runs under
  pruning;
- ten greedy tokens, scored by their first integer.

Two haystacks are used: the repeated sentence of the format, and varied text (the corpus).
"""

from __future__ import annotations

import math
import random
import re
import statistics
from dataclasses import dataclass

import torch

from etinfer.bench.common.stats import percentile
from etinfer.control.block_selection import BlockSelector, PruningConfig
from etinfer.corpus import corpus_text
from etinfer.engine.observer import StepRecord
from etinfer.llm import LLM
from etinfer.model.tokenizer import Tokenizer
from etinfer.outputs import RequestOutput
from etinfer.sampling_params import SamplingParams

INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
    "them. I will quiz you about the important information there."
)
FILLER = (
    " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
QUESTION = " What is the pass key? The pass key is"
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def corpus_tokens(tokenizer: Tokenizer) -> list[int]:
    """The human-written corpus as one token stream, in a fixed order."""
    return tokenizer.encode(corpus_text())


LogProbs = dict[tuple[int, int], torch.Tensor]


@dataclass
class ForcedPass:
    log_probs: LogProbs  # keyed by (text, position predicted)
    blocks_kept: list[float]  # per decode step and sequence: the share of blocks read
    step_ms: float  # median CPU time of a step (this process: use one torch thread)
    outputs: list[RequestOutput]  # in the order of the texts


def forced_log_probs(llm: LLM, texts: list[list[int]], context: int, steps: int) -> ForcedPass:
    """Feed ``texts[i][context : context + steps]`` as decode steps after a prefill of
    ``texts[i][:context]``, and record the next-token log-probabilities of every decode step.
    The token predicted by the prefill is left out: it is dense under any pruning. The steps
    are mostly decode steps, so their median time is a decode step's."""
    rows: dict[tuple[str, int], torch.Tensor] = {}
    seconds: list[float] = []

    def record(step: StepRecord) -> None:
        seconds.append(step.cpu_time)
        if step.logits is None:  # a prompt's chunk that samples nothing
            return
        logprobs = step.logits.log_softmax(-1)
        for i, position, row in zip(step.sampled, step.sampled_positions, logprobs, strict=True):
            if position > context:  # the prefill's prediction is dense under any pruning
                rows[(step.request_ids[i], position)] = row

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    ids = [
        engine.add_request(text[:context], params, forced_token_ids=text[context : context + steps])
        for text in texts
    ]
    kept, finished = [], {}
    with engine.observing(record, logits=True):
        while engine.has_unfinished_requests():
            outputs = engine.step()
            kept += [share for out in outputs for share in out.blocks_kept or ()]
            finished.update((out.request_id, out) for out in outputs if out.finished)
    index = {request_id: i for i, request_id in enumerate(ids)}
    by_text = {(index[request_id], position): row for (request_id, position), row in rows.items()}
    outputs = [finished[request_id] for request_id in ids]
    return ForcedPass(by_text, kept, 1000 * statistics.median(seconds), outputs)


@dataclass
class FidelityStats:
    steps: int
    kl_mean: float
    kl_p99: float
    kl_max: float
    top1_agreement: float
    perplexity_dense: float
    perplexity_pruned: float
    blocks_kept: float  # mean share of (block, KV head) pairs the pruned engine read
    step_ms: float  # median CPU time of a pruned step
    dense_step_ms: float

    @property
    def perplexity_ratio(self) -> float:
        return self.perplexity_pruned / self.perplexity_dense

    @property
    def step_ratio(self) -> float:
        return self.step_ms / self.dense_step_ms


def teacher_forced(
    llm: LLM,
    texts: list[list[int]],
    context: int,
    steps: int,
    pruning: PruningConfig,
    dense: ForcedPass | None = None,
    selector: BlockSelector | None = None,
) -> FidelityStats:
    """Dense against pruned attention on the same forced continuations, in one engine (built
    with pruning on): a dense pass, then a pruned one whose prompts come from the prefix cache.
    Every forced token after the first runs as a decode step. ``dense`` reuses the log-probs of
    an earlier dense pass over the same texts; ``selector`` replaces the entropic one."""
    engine = llm.engine
    if dense is None:
        engine.set_pruning(None)
        dense = forced_log_probs(llm, texts, context, steps)
    engine.set_pruning(pruning, selector)
    pruned = forced_log_probs(llm, texts, context, steps)
    kl, agree = divergences(dense, pruned)
    truths = [texts[i][position] for i, position in dense.log_probs]
    nll_dense = [-row[t].item() for row, t in zip(dense.log_probs.values(), truths, strict=True)]
    nll_pruned = [
        -pruned.log_probs[key][t].item() for key, t in zip(dense.log_probs, truths, strict=True)
    ]
    return FidelityStats(
        steps=len(kl),
        kl_mean=statistics.fmean(kl),
        kl_p99=percentile(kl, 99),
        kl_max=max(kl),
        top1_agreement=statistics.fmean(agree),
        perplexity_dense=math.exp(statistics.fmean(nll_dense)),
        perplexity_pruned=math.exp(statistics.fmean(nll_pruned)),
        blocks_kept=statistics.fmean(pruned.blocks_kept) if pruned.blocks_kept else 1.0,
        step_ms=pruned.step_ms,
        dense_step_ms=dense.step_ms,
    )


def divergences(
    dense: ForcedPass, other: ForcedPass, first_position: int = 0
) -> tuple[list[float], list[int]]:
    """Per forced position from ``first_position`` on: ``KL(p_dense || p_other)`` and whether
    the two agree on the most likely token."""
    kl, agree = [], []
    for key, p_dense in dense.log_probs.items():
        if key[1] < first_position:
            continue
        p_other = other.log_probs[key]
        kl.append(torch.sum(p_dense.exp() * (p_dense - p_other)).item())
        agree.append(int(p_dense.argmax() == p_other.argmax()))
    return kl, agree


@dataclass
class PasskeyCase:
    length: int
    depth: float
    key: int
    prompt: list[int]
    question: list[int]


def passkey_cases(
    tokenizer: Tokenizer, lengths: tuple[int, ...], haystack: str, seed: int = 0
) -> list[PasskeyCase]:
    """One case per (length, depth): about ``length`` tokens with the needle at ``depth``."""
    rng = random.Random(seed)
    intro, question = tokenizer.encode(INTRO), tokenizer.encode(QUESTION)
    if haystack == "repeated":
        unit = tokenizer.encode(FILLER)
        filler = unit * (max(lengths) // len(unit) + 1)
    else:
        filler = corpus_tokens(tokenizer)
    cases = []
    for length in lengths:
        for depth in DEPTHS:
            key = rng.randint(1, 50000)
            needle = tokenizer.encode(
                f" The pass key is {key}. Remember it. {key} is the pass key."
            )
            room = length - len(intro) - len(needle) - len(question)
            offset = 0 if haystack == "repeated" else rng.randrange(len(filler) - room)
            hay = filler[offset : offset + room]
            cut = int(depth * room)
            prompt = intro + hay[:cut] + needle + hay[cut:]
            cases.append(PasskeyCase(length, depth, key, prompt, question))
    return cases


def passkey_answers(llm: LLM, cases: list[PasskeyCase]) -> list[RequestOutput]:
    """Each case's question forced after its prompt, then ten greedy tokens; the cases run
    together, as one batch."""
    engine = llm.engine
    ids = [
        engine.add_request(
            case.prompt,
            SamplingParams(temperature=0, max_tokens=len(case.question) + 10),
            forced_token_ids=case.question,
        )
        for case in cases
    ]
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
    return [outputs[request_id] for request_id in ids]


def passkey_found(
    tokenizer: Tokenizer, cases: list[PasskeyCase], answers: list[RequestOutput]
) -> list[bool]:
    """Whether the first integer of each answer after its question is the case's key."""
    found = []
    for case, answer in zip(cases, answers, strict=True):
        match = re.search(r"\d+", tokenizer.decode(answer.token_ids[len(case.question) :]))
        found.append(match is not None and int(match.group()) == case.key)
    return found


def passkey_accuracy(llm: LLM, cases: list[PasskeyCase]) -> list[bool]:
    """Whether the first integer of the ten greedy tokens after the question is the key."""
    return passkey_found(llm.tokenizer, cases, passkey_answers(llm, cases))


def logit_agreement(logits: torch.Tensor, expected: torch.Tensor) -> dict[str, float]:
    """Top-1 agreement and mean KL(expected || logits) of two engines' logits at the same
    positions [positions, vocab]."""
    kl = torch.nn.functional.kl_div(
        logits.log_softmax(-1), expected.log_softmax(-1), log_target=True, reduction="none"
    )
    return {
        "top1_agreement": (logits.argmax(-1) == expected.argmax(-1)).float().mean().item(),
        "kl_mean": kl.sum(-1).mean().item(),
    }
