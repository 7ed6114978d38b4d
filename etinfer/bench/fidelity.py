"""How closely pruned attention follows dense attention, on real text.

    etinfer bench fidelity --output-dir results/fidelity

**Teacher-forced decoding.** Long human-written text (CPython's ``pydoc_data.topics``, as in
calibration) is prefilled up to ``context`` tokens. The next ``steps`` tokens are then fed as
decode steps, so every one of them is predicted under (sparse) attention. Dense and pruned
engines run side by side on the same texts. Each step gives ``KL(p_dense || p_pruned)``, whether
the two agree on the most likely token, and each side's negative log-likelihood of the true
token; the last gives the perplexity ratio.

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
import pydoc_data.topics
import random
import re
import statistics
from dataclasses import dataclass

import torch

from etinfer.engine.sequence import Sequence
from etinfer.llm import LLM
from etinfer.model.tokenizer import Tokenizer
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
    text = "\n\n".join(pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics))
    return tokenizer.encode(text)


class LogitsRecorder:
    """Log-probabilities of each forced step, keyed by (request id, position predicted)."""

    def __init__(self, llm: LLM) -> None:
        self.rows: dict[tuple[str, int], torch.Tensor] = {}
        llm.engine.runner.logits_hook = self

    def __call__(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        for seq, row in zip(seqs, logits.log_softmax(-1), strict=True):
            self.rows[(seq.request_id, seq.num_tokens)] = row


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

    @property
    def perplexity_ratio(self) -> float:
        return self.perplexity_pruned / self.perplexity_dense


def teacher_forced(
    dense: LLM, pruned: LLM, texts: list[list[int]], context: int, steps: int
) -> FidelityStats:
    """Feed ``texts[i][context : context + steps]`` as decode steps to both engines in lockstep
    and compare their next-token distributions at every decode step."""
    recorders = [LogitsRecorder(dense), LogitsRecorder(pruned)]
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    for llm in (dense, pruned):
        for i, text in enumerate(texts):
            llm.engine.add_request(
                text[:context],
                params,
                request_id=f"text{i}",
                forced_token_ids=text[context : context + steps],
            )
    kl, agree, nll_dense, nll_pruned, kept = [], [], [], [], []
    # Not in lockstep: a prefix cached in one engine shortens its prefill.
    while dense.engine.has_unfinished_requests() or pruned.engine.has_unfinished_requests():
        outputs = dense.engine.step() + pruned.engine.step()
        for (request_id, position), p_dense in list(recorders[0].rows.items()):
            p_pruned = recorders[1].rows.pop((request_id, position), None)
            if p_pruned is None:
                continue
            del recorders[0].rows[(request_id, position)]
            if position == context:  # predicted by the prefill, which is dense in both
                continue
            truth = texts[int(request_id[4:])][position]
            kl.append(torch.sum(p_dense.exp() * (p_dense - p_pruned)).item())
            agree.append(int(p_dense.argmax() == p_pruned.argmax()))
            nll_dense.append(-p_dense[truth].item())
            nll_pruned.append(-p_pruned[truth].item())
        kept += [share for o in outputs if o.blocks_kept for share in o.blocks_kept]
    for llm in (dense, pruned):
        llm.engine.runner.logits_hook = None
    ordered = sorted(kl)
    return FidelityStats(
        steps=len(kl),
        kl_mean=statistics.fmean(kl),
        kl_p99=ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        kl_max=ordered[-1],
        top1_agreement=statistics.fmean(agree),
        perplexity_dense=math.exp(statistics.fmean(nll_dense)),
        perplexity_pruned=math.exp(statistics.fmean(nll_pruned)),
        blocks_kept=statistics.fmean(kept) if kept else 1.0,
    )


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


def passkey_accuracy(llm: LLM, cases: list[PasskeyCase]) -> list[bool]:
    """Whether the first integer of the ten greedy tokens after the question is the key; the
    cases run together, as one batch."""
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
    found = []
    for request_id, case in zip(ids, cases, strict=True):
        answer = llm.tokenizer.decode(outputs[request_id].token_ids[len(case.question) :])
        match = re.search(r"\d+", answer)
        found.append(match is not None and int(match.group()) == case.key)
    return found
