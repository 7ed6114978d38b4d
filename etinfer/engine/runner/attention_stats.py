"""What decode attention kept in a step, per layer and decode row, handed to each sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from etinfer.engine.sampling.step_sampling import Emitted
from etinfer.engine.scheduler import ScheduledBatch
from etinfer.engine.sequence import Sequence
from etinfer.model.pruning_telemetry import PruningTelemetry


@dataclass
class AttentionStats:
    """What decode attention kept this step, per layer and decode row (host lists): a decoding
    sequence has one row per token it verifies, ``columns`` counts them from 0."""

    seqs: list[Sequence]
    columns: list[int]
    kept: list[list[float]]  # [layers][rows] (block, KV head) pairs attended to
    total: list[list[float]]  # [layers][rows] (block, KV head) pairs in context
    dropped_mass: list[list[float]]  # [layers][rows] upper bound of the attention mass dropped

    def record(self, batch: ScheduledBatch, starts: list[int], emitted: Emitted | None) -> None:
        """Into each sequence, the rows that computed an output token (not a prompt's last)
        and whose next token was emitted: one entry per generated token."""
        counts = {} if emitted is None else dict(zip(batch.sampled, emitted.counts, strict=True))
        index = {seq: i for i, seq in enumerate(batch.seqs)}
        for row, (seq, column) in enumerate(zip(self.seqs, self.columns, strict=True)):
            i = index[seq]
            if starts[i] >= seq.num_prompt_tokens and column < counts.get(i, 0):
                seq.pruning.record_attention(
                    sum(layer[row] for layer in self.kept),
                    sum(layer[row] for layer in self.total),
                    max(layer[row] for layer in self.dropped_mass),
                )

    @classmethod
    def of(cls, batch: ScheduledBatch, telemetry: PruningTelemetry) -> AttentionStats:
        """The step's telemetry on the host (one transfer), one row per decode row."""
        kept, total, dropped = torch.stack(
            [telemetry.kept, telemetry.total, telemetry.dropped_mass]
        ).tolist()
        decoding = range(batch.num_decode)
        rows = [(batch.seqs[i], c) for i in decoding for c in range(batch.num_tokens[i])]
        seqs, columns = map(list, zip(*rows, strict=True))
        return cls(seqs, columns, kept, total, dropped)
