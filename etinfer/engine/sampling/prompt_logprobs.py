"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``, vLLM's meaning): for each
prompt token after the first, its log-probability under the model (temperature 1, no filter)
and its top-N alternatives, what evaluation harnesses score a model by.

They come from the prefill step's own rows, with no second pass: each row of a chunk predicts
the next prompt token, so the output head runs over those rows besides the last one it runs
over anyway; where the head allows (``LlamaModel.score_tokens``) its logits are scored as its
kernel makes them and never written out. Chunked prefill scores each chunk as it runs; a prompt
asking for them is never served from the prefix cache (``KVCacheManager.cached_prefix``); a
prompt computed again after a preemption scores only positions it has not scored.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from etinfer.engine.sampling.sampler import SampledLogprobs, Sampler
from etinfer.engine.sequence import Sequence
from etinfer.model import native_kernels

# Prompt rows scored at once: where the logits are written out, a vocabulary-wide float32 row
# is 1 MiB on Gemma 3 (262,144 entries), so a 1,024-token chunk at once held over 1 GiB. What
# scoring written logits costs beyond the output head is one pass of native/row_scores.c over
# each row: under a tenth of the head's time on Gemma 3 (torch's log-sum-exp, comparison and
# top-k took as long again as the head).
ROWS_AT_ONCE = 128


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
    hidden: torch.Tensor, chunks: list, seqs: list[Sequence], model
) -> list[PromptScores]:
    """Scores of the step's prefill ``chunks`` (``AttentionMetadata.prefills``, of ``seqs``)
    whose sequences ask for prompt log-probabilities, from the step's final ``hidden`` rows
    through ``model``'s output head."""
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
        targets = seq.token_ids[low:high]
        index = torch.tensor(targets, device=rows.device)
        count = seq.params.prompt_logprobs
        pieces = [
            _rows_scored(model, rows[at : at + ROWS_AT_ONCE], index[at : at + ROWS_AT_ONCE], count)
            for at in range(0, len(targets), ROWS_AT_ONCE)
        ]
        joined = SampledLogprobs(
            *(torch.cat([getattr(p, f.name) for p in pieces]) for f in fields(SampledLogprobs))
        )
        scores.append(PromptScores(seq, targets, joined))
    return scores


def _rows_scored(model, rows: torch.Tensor, targets: torch.Tensor, count: int) -> SampledLogprobs:
    """``rows``' scores through the head fused where it can be, else from its written logits."""
    fused = model.score_tokens(rows, targets, count)
    if fused is not None:
        return SampledLogprobs(*fused)
    return _scored(model.compute_logits(rows), targets, count)


def _scored(logits: torch.Tensor, targets: torch.Tensor, count: int) -> SampledLogprobs:
    """Each row's log-probability and rank of its target and its top ``count``: on the CPU in
    one pass over each row (``native/row_scores.c``), elsewhere as torch operations on
    log-probabilities made in place (no second vocabulary-wide tensor)."""
    logits = logits.float()
    native = native_kernels.library() if logits.device.type == "cpu" else None
    if native is None:
        logits -= logits.logsumexp(-1, keepdim=True)
        return Sampler.logprobs_of(logits, targets, count)
    logits, targets = logits.contiguous(), targets.to(torch.int64).contiguous()
    rows, vocab = logits.shape
    scores = SampledLogprobs(
        token_logprob=torch.empty(rows),
        token_rank=torch.empty(rows, dtype=torch.int64),
        top_ids=torch.empty(rows, count, dtype=torch.int64),
        top_logprobs=torch.empty(rows, count),
    )
    done = native.score_rows(
        logits.data_ptr(), rows, vocab, targets.data_ptr(), count, torch.get_num_threads(),
        *(getattr(scores, f.name).data_ptr() for f in fields(SampledLogprobs)),
    )  # fmt: skip
    if done != 0:
        raise ValueError(f"prompt tokens outside the {vocab}-entry vocabulary, or {count} > 64")
    return scores
