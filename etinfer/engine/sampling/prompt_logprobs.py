"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``, vLLM's meaning): for each
prompt token after the first, its log-probability under the model (temperature 1, no filter)
and its top-N alternatives, what evaluation harnesses score a model by.

They come from the prefill step's own rows, with no second pass: each row of a chunk predicts
the next prompt token, so the output head runs over those rows besides the last one it runs
over anyway. Chunked prefill scores each chunk as it runs; a prompt asking for them is never
served from the prefix cache (``KVCacheManager.cached_prefix``); a prompt computed again after
a preemption scores only positions it has not scored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from etinfer.engine.sampling.sampler import SampledLogprobs, Sampler
from etinfer.engine.sequence import Sequence


@dataclass
class PromptScores:
    """A chunk's scores for one sequence, on the device until ``record``."""

    seq: Sequence
    targets: list[int]  # the prompt tokens the rows predict
    logprobs: SampledLogprobs

    def record(self, token_text) -> None:
        """Into the sequence, on the host (one transfer)."""
        count = self.seq.params.prompt_logprobs
        rows = self.logprobs.to_host(self.targets, [count] * len(self.targets), token_text)
        self.seq.prompt_logprobs.extend(rows)


def score_prompts(
    hidden: torch.Tensor, chunks: list, seqs: list[Sequence], compute_logits
) -> list[PromptScores]:
    """Scores of the step's prefill ``chunks`` (``AttentionMetadata.prefills``, of ``seqs``)
    whose sequences ask for prompt log-probabilities, from the step's final ``hidden`` rows."""
    scores = []
    for chunk, seq in zip(chunks, seqs, strict=True):
        if seq.prompt_logprobs is None:
            continue
        # The row at position q predicts the token at q + 1, a prompt token below the prompt's
        # end (the last prompt row predicts the first output, which sampling takes). Only
        # tokens not scored yet: a prompt computed again after a preemption is scored once.
        start = seq.num_computed_tokens
        low = max(len(seq.prompt_logprobs), start + 1)
        high = min(start + chunk.length + 1, seq.num_prompt_tokens)
        if high <= low:
            continue
        rows = hidden[chunk.start + low - 1 - start : chunk.start + high - 1 - start]
        logp = compute_logits(rows).float().log_softmax(-1)
        targets = seq.token_ids[low:high]
        index = torch.tensor(targets, device=logp.device)
        count = seq.params.prompt_logprobs
        scores.append(PromptScores(seq, targets, Sampler.logprobs_of(logp, index, count)))
    return scores
