"""A step's sampling, column by column: every sampled sequence at its last known token, then at
each of its drafts while the model draws them. A plain step is the first column alone; with
speculative decoding (engine/speculative/) the later columns verify the drafts, through the
same sampler and with the same control state as plain steps would have, so the emitted tokens,
their entropies and temperatures are those plain decoding would produce."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import torch

from etinfer.engine.sampling.sampler import SamplerOutput
from etinfer.engine.scheduler import ScheduledBatch
from etinfer.engine.sequence import Sequence

SampleFn = Callable[[torch.Tensor, list[Sequence], list[float | None]], SamplerOutput]


TakeFn = Callable[[list[Sequence], SamplerOutput], None]


@dataclass
class Emitted:
    """What a step's sampling produced, column by column."""

    outputs: list[SamplerOutput]  # one per column, a row per sequence still verifying
    batch_indices: list[int]  # per emitted token, in that order: its sequence in the batch
    logits_rows: list[int]  # and its row of the step's logits
    counts: list[int]  # per sampled sequence: tokens emitted
    accepted: list[int]  # per sampled sequence: drafts accepted

    def merged(self) -> SamplerOutput | None:
        """One output over every emitted token (logprobs only when there was one column: the
        columns' top-N widths may differ, and the sequences' outputs carry them anyway)."""
        if len(self.outputs) <= 1:
            return self.outputs[0] if self.outputs else None
        lists = [[v for o in self.outputs for v in getattr(o, name)] for name in _ROW_FIELDS]
        masked = {
            name: [v for o in self.outputs for v in _or_nan(getattr(o, name), len(o.token_ids))]
            for name in _MASK_FIELDS
        }
        if all(getattr(o, _MASK_FIELDS[0]) is None for o in self.outputs):
            masked = {}
        return SamplerOutput(*lists, logprobs=None, **masked)


_ROW_FIELDS = (
    "token_ids",
    "entropies",
    "tempered_entropies",
    "temperatures",
    "predictive_entropy",
    "predictive_entropy_upper",
    "states",
)
_MASK_FIELDS = ("masked_entropies", "removed_mass", "allowed_counts")


def _or_nan(values: list[float] | None, rows: int) -> list[float]:
    return [math.nan] * rows if values is None else values


def _rows_of(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits[rows]`` for strictly increasing ``rows``: a view where they follow on (every
    plain step; then the last is the first plus their count less one), which needs no index
    copied to the device, a copy the host waits for (an H200's profile counted it as one of a
    decode step's two waits). Nothing downstream writes to its logits in place."""
    first, count = rows[0], len(rows)
    if rows[-1] == first + count - 1:
        return logits[first : first + count]
    return logits[rows]


def sample_verified(
    batch: ScheduledBatch,
    logits: torch.Tensor,
    states: list[float | None],
    sample: SampleFn,
    take: TakeFn,
) -> Emitted:
    """Sample the batch's sampled sequences (``states``: their temperature laws' states), each
    at its last known token and then at each draft while the drafts before it were drawn.
    ``take`` appends a column's tokens to their sequences (and may finish them)."""
    verified = [len(batch.drafts[i]) + 1 for i in batch.sampled]
    offsets = [0, *accumulate(verified)]
    emitted = Emitted([], [], [], [0] * len(verified), [0] * len(verified))
    alive, column = list(range(len(verified))), 0
    while alive:
        seqs = [batch.seqs[batch.sampled[a]] for a in alive]
        rows = [offsets[a] + column for a in alive]
        column_states = (
            [states[a] for a in alive] if column == 0 else [s.temperature_state for s in seqs]
        )
        out = sample(_rows_of(logits, rows), seqs, column_states)
        take(seqs, out)
        emitted.outputs.append(out)
        still = []
        for r, (a, seq) in enumerate(zip(alive, seqs, strict=True)):
            emitted.batch_indices.append(batch.sampled[a])
            emitted.logits_rows.append(rows[r])
            emitted.counts[a] += 1
            drafts = batch.drafts[batch.sampled[a]]
            if column < len(drafts) and out.token_ids[r] == drafts[column]:
                emitted.accepted[a] += 1
                if seq.finish_reason is None:
                    still.append(a)
        alive, column = still, column + 1
    return emitted
