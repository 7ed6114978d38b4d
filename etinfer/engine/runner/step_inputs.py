"""A scheduled batch as the tensors one forward pass takes: token ids, positions, and the
attention metadata every layer reads (cache slots, decode patterns, prefill chunks and masks,
and where layers differ in their sliding window, the step as the sliding layers see it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import chain
from typing import Protocol

import torch

from etinfer.control.sparse_prefill import SparsePrefillSelector
from etinfer.engine.runner.device_copy import to_device
from etinfer.engine.scheduler import ScheduledBatch
from etinfer.engine.sequence import Sequence
from etinfer.model.attention.backend import AttentionBackend
from etinfer.model.attention.metadata import AttentionMetadata, PrefillChunk, prefill_mask
from etinfer.model.attention.pattern import DecodePattern, visible_blocks
from etinfer.model.block_layout import DecodeBlocks, PrefillContext
from etinfer.model.config import ModelConfig
from etinfer.model.pruning_telemetry import PruningTelemetry


class QueryCapture(Protocol):
    """Rows of a step whose queries attention copies out of every layer, and where to."""

    rows: torch.Tensor  # [captured] rows of the step's flat batch
    queries: torch.Tensor  # [layers, captured, heads, head_dim], filled as layers run


class QueryCapturer(Protocol):
    """A layer that keeps some rows' queries (KV compression's voters): it names them before a
    step's forward pass and takes them after it."""

    def plan_capture(
        self, seqs: list[Sequence], starts: list[int], counts: list[int], first_rows: list[int]
    ) -> QueryCapture | None: ...

    def store(self, capture: QueryCapture) -> None: ...


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    # Rows whose logits are sampled: per sampled sequence, its last known token's row and the
    # rows of its drafts, in order.
    sample_rows: torch.Tensor
    capture: QueryCapture | None = None  # KV compression's voting queries


class StepInputBuilder:
    def __init__(
        self,
        config: ModelConfig,
        *,
        device: torch.device,
        block_size: int,
        num_slots: int,
        scale: float,
        prefill_selector: SparsePrefillSelector | None,
        batch_invariant: bool,
        query_capturer: QueryCapturer | None,
        backend: AttentionBackend,
    ) -> None:
        """``batch_invariant``: prefill rows attend as decode rows (see EngineConfig);
        ``query_capturer``: the layer that keeps some rows' queries, if one is on;
        ``backend``: the attention backend, which says what its decode rows need built."""
        self.config, self.device = config, device
        self.block_size, self.num_slots, self.scale = block_size, num_slots, scale
        self.prefill_selector = prefill_selector
        self.batch_invariant = batch_invariant
        self.query_capturer = query_capturer
        # Every layer's window (Mistral), or where layers differ (Gemma 3) the sliding layers'
        # window, for which each step also builds a ``local`` view of its metadata.
        self.sliding_window = config.uniform_window
        self.local_window = config.sliding_window if config.mixed_windows else None
        self.local_layers = sorted(config.local_layers)
        self.backend = backend

    def sequence(
        self, token_ids: list[int], blocks: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """One sequence as one prefill of ``token_ids`` into ``blocks`` (``score``, the early
        exit's fit): its ids, positions and attention metadata."""
        n = len(token_ids)
        positions = torch.arange(n)
        table = torch.tensor(blocks)
        slots = table[positions // self.block_size] * self.block_size + positions % self.block_size
        if self.batch_invariant:  # every row as a decode row, as in a step (``prepare``)
            decode_blocks, _, pattern = self._decode_rows(table.expand(n, -1), positions + 1)
            meta = AttentionMetadata(to_device(slots, self.device), n, decode_blocks, pattern, [])
        else:
            mask = prefill_mask(0, n, self.sliding_window, self.device)
            chunk = PrefillChunk(0, n, None, mask)
            meta = AttentionMetadata(to_device(slots, self.device), 0, None, None, [chunk])
        meta.local = self._local_view(meta, [0] * len(meta.prefills))
        ids = to_device(torch.tensor(token_ids), self.device)
        return ids, to_device(positions, self.device), meta

    def _decode_rows(
        self, tables: torch.Tensor, context_lens: torch.Tensor
    ) -> tuple[DecodeBlocks, torch.Tensor | None, DecodePattern | None]:
        """Rows that attend as decode rows: each to its ``context_lens`` first cache entries
        through its row of ``tables``. Their layout, visible blocks and dense pattern (None where
        the backend reads the tables)."""
        blocks = DecodeBlocks(
            to_device(tables, self.device), to_device(context_lens, self.device), self.block_size
        )
        visible, pattern = self._dense_pattern(blocks, self.sliding_window)
        return blocks, visible, pattern

    def _dense_pattern(
        self, blocks: DecodeBlocks, window: int | None
    ) -> tuple[torch.Tensor | None, DecodePattern | None]:
        """The blocks each decode row sees, and their CSR pattern, as the backend's decode reads
        them; neither where it reads the block tables itself (``_in_view`` works the blocks out
        where they are needed)."""
        return self.backend.decode_metadata(blocks, self.num_slots, window)

    def _in_view(
        self, blocks: DecodeBlocks, window: int | None, visible: torch.Tensor | None
    ) -> torch.Tensor:
        """The blocks decode rows see (pruning's telemetry counts them): ``visible`` where a
        pattern worked them out, else worked out here."""
        if visible is not None:
            return visible
        return visible_blocks(blocks, self.config.num_kv_heads, sliding_window=window)

    def _local_view(
        self,
        meta: AttentionMetadata,
        starts: list[int],
        decode: tuple[torch.Tensor | None, DecodePattern | None] | None = None,
    ) -> AttentionMetadata | None:
        """The step as the sliding layers see it, where layers differ in their window: the
        same rows, the window's decode pattern and prefill masks (``starts``: each prefill
        chunk's first position; ``decode``: the window's visible blocks and pattern, where the
        step worked them out already)."""
        window = self.local_window
        if window is None:
            return None
        pattern = None
        if decode is not None:
            pattern = decode[1]
        elif meta.decode_blocks is not None:
            _, pattern = self._dense_pattern(meta.decode_blocks, window)
        prefills = [
            dataclasses.replace(chunk, mask=prefill_mask(start, chunk.length, window, self.device))
            for chunk, start in zip(meta.prefills, starts, strict=True)
        ]
        return dataclasses.replace(meta, dense_pattern=pattern, prefills=prefills)

    def step(self, batch: ScheduledBatch, budgets: list[int] | None = None) -> StepInputs:
        """The step's tensors; ``budgets``: blocks each decoding sequence keeps (None: all)."""
        seqs, counts = batch.seqs, batch.num_tokens
        bs = self.block_size
        starts = [seq.num_computed_tokens for seq in seqs]
        input_ids = list(chain.from_iterable(batch.input_ids(i) for i in range(len(seqs))))
        width = max(len(seq.block_table) for seq in seqs)
        tables = torch.tensor(
            [seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs]
        )
        counts_t, starts_t = torch.tensor(counts), torch.tensor(starts)
        row_seq = torch.repeat_interleave(torch.arange(len(seqs)), counts_t)
        chunk_start = torch.cumsum(counts_t, 0) - counts_t
        positions = starts_t[row_seq] + torch.arange(len(input_ids)) - chunk_start[row_seq]
        # Where KV compression dropped entries, a position's cache index is behind it.
        index = positions - torch.tensor([seq.kv_offset for seq in seqs])[row_seq]
        slot_mapping = tables[row_seq, index // bs] * bs + index % bs

        # Decode rows: one per token a decoding sequence computes (its last known token and its
        # drafts), each attending to the context up to itself, so that a verified draft's row
        # is computed exactly as the decode step of that token would compute it. With
        # batch_invariant, prefill chunks' rows too.
        num_decode = len(seqs) if self.batch_invariant else batch.num_decode
        decode_rows = sum(counts[:num_decode])
        decode_blocks = dense = telemetry = local_decode = None
        if num_decode:
            decode_width = max(len(seq.block_table) for seq in seqs[:num_decode])
            decode_blocks, visible, dense = self._decode_rows(
                tables[row_seq[:decode_rows], :decode_width], index[:decode_rows] + 1
            )
            if self.local_window is not None:
                local_decode = self._dense_pattern(decode_blocks, self.local_window)
            if budgets is not None:
                row_budgets = torch.tensor(budgets).repeat_interleave(counts_t[:num_decode])
                self._set_budgets(decode_blocks, index[:decode_rows] + 1, row_budgets)
                # The sliding layers read their window, never pruned: that is what they keep.
                windows = None
                if local_decode is not None:
                    local = self._in_view(decode_blocks, self.local_window, local_decode[0])
                    windows = (self.local_layers, local)
                visible = self._in_view(decode_blocks, self.sliding_window, visible)
                telemetry = PruningTelemetry.empty(
                    self.config.num_layers, decode_blocks, visible, self.scale, windows
                )
        prefills = []
        for i in range(num_decode, len(seqs)):
            start, n = starts[i], counts[i]
            sparse = self._sparse_context(seqs[i], start, n, tables[i])
            context_slots = None
            if start or sparse is not None:
                context = torch.arange(start + n)
                context_slots = to_device(tables[i, context // bs] * bs + context % bs, self.device)
            chunk = PrefillChunk(int(chunk_start[i]), n, context_slots, None, sparse)
            chunk.mask = prefill_mask(start, n, self.sliding_window, self.device)
            prefills.append(chunk)

        fresh = to_device(slot_mapping[slot_mapping % bs == 0] // bs, self.device)
        capture = None
        if self.query_capturer is not None:
            capture = self.query_capturer.plan_capture(seqs, starts, counts, chunk_start.tolist())
        meta = AttentionMetadata(
            to_device(slot_mapping, self.device),
            decode_rows,
            decode_blocks,
            dense,
            prefills,
            fresh,
            telemetry,
            capture_rows=None if capture is None else capture.rows,
            captured=None if capture is None else capture.queries,
        )
        meta.local = self._local_view(meta, starts[num_decode:], local_decode)
        sampled = torch.tensor(batch.sampled, dtype=torch.long)
        verified = torch.tensor([len(batch.drafts[i]) + 1 for i in batch.sampled], dtype=torch.long)
        ends = (chunk_start + counts_t)[sampled]
        sample_rows = torch.repeat_interleave(ends, verified) - _ranks_from_end(verified)
        return StepInputs(
            input_ids=to_device(torch.tensor(input_ids), self.device),
            positions=to_device(positions, self.device),
            meta=meta,
            sample_rows=to_device(sample_rows, self.device),
            capture=capture,
        )

    def _sparse_context(
        self, seq: Sequence, start: int, n: int, table: torch.Tensor
    ) -> PrefillContext | None:
        """What sparse prefill needs of a prefilling sequence; None where it attends densely."""
        if self.prefill_selector is None:
            return None
        seq.sparse_prefill = self.prefill_selector.begin(
            seq.sparse_prefill, start, start + n, seq.num_tokens
        )
        if seq.sparse_prefill is None:
            return None
        return PrefillContext(
            start, seq.num_tokens, to_device(table, self.device), seq.sparse_prefill
        )

    def _set_budgets(
        self, blocks: DecodeBlocks, context_lens: torch.Tensor, budgets: torch.Tensor
    ) -> None:
        """Hand the per-row budgets to attention where some row keeps less than its context."""
        in_context = -(-context_lens // self.block_size)
        if bool((budgets < in_context).any()):
            blocks.budgets = to_device(budgets, self.device)
            blocks.max_budget = int(budgets.max())


def _ranks_from_end(lengths: torch.Tensor) -> torch.Tensor:
    """For runs of ``lengths``, each element's distance from past its run's end: n, ..., 1."""
    offsets = torch.arange(int(lengths.sum())) - torch.repeat_interleave(
        torch.cumsum(lengths, 0) - lengths, lengths
    )
    return torch.repeat_interleave(lengths, lengths) - offsets
