"""Turn a scheduled batch into tensors, run the model over the paged cache, and sample."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Protocol

import torch

from etinfer.control.record import StepDecisions
from etinfer.control.sparse_prefill import SparsePrefillConfig, SparsePrefillSelector
from etinfer.control.stress import StressConfig
from etinfer.engine.attention_stats import AttentionStats
from etinfer.engine.sampler import Sampler, SamplerOutput
from etinfer.engine.sampling_batch import SamplingBatch
from etinfer.engine.scheduler import ScheduledBatch
from etinfer.engine.sequence import Sequence
from etinfer.model.block_layout import AttentionSelector, DecodeBlocks, PrefillContext
from etinfer.model.decode_pattern import DecodePattern, decode_pattern
from etinfer.model.kv_cache import KVCache
from etinfer.model.llama import LlamaModel
from etinfer.model.loader import LoadedModel
from etinfer.model.paged_attention import (
    AttentionMetadata,
    PagedAttention,
    PrefillChunk,
    PruningTelemetry,
    prefill_mask,
)


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


@dataclass
class StepResult:
    attention: AttentionStats | None  # only when block budgets were planned
    # [sample rows, vocab] before any sampling transform (see StepInputs.sample_rows); None
    # when the step samples nothing.
    logits: torch.Tensor | None


class ModelRunner:
    def __init__(
        self,
        model: LoadedModel,
        selector: AttentionSelector,
        *,
        max_model_len: int,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int,
        kv_cache_dtype: torch.dtype = torch.float32,
        quantization: str = "auto",
        calibration_temperature: float = 1.0,
        stress: StressConfig | None = None,
        sparse_prefill: SparsePrefillConfig | None = None,
        batch_invariant: bool = False,
        query_capturer: QueryCapturer | None = None,
    ) -> None:
        """The cache keeps per-block summaries if ``selector`` scores blocks (then any other
        selector can be installed later, ``set_selector``) or ``sparse_prefill`` is on.
        ``batch_invariant``: prefill rows attend as decode rows (see EngineConfig).
        ``query_capturer``: the layer that keeps some rows' queries, if one is on."""
        config = model.config
        prefill_selector = None
        if sparse_prefill is not None:
            if config.sliding_window is not None:
                raise ValueError("sparse_prefill does not support sliding-window attention yet")
            prefill_selector = SparsePrefillSelector(
                sparse_prefill,
                num_layers=config.num_layers,
                num_heads=config.num_heads,
                num_kv_heads=config.num_kv_heads,
                head_dim=config.head_dim,
                block_size=block_size,
                max_model_len=max_model_len,
            )
        self.config = config
        self.max_model_len = max_model_len
        self.device = device
        self.block_size = block_size
        self.sliding_window = config.sliding_window
        self.attention = PagedAttention(
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            selector,
            config.sliding_window,
            prefill_selector,
        )
        self.prefill_selector = prefill_selector
        self.batch_invariant = batch_invariant
        self.model = LlamaModel(model, self.attention, max_model_len, device, dtype, quantization)
        self.cache = KVCache(
            config.num_layers,
            num_blocks,
            block_size,
            config.num_kv_heads,
            config.head_dim,
            device,
            kv_cache_dtype,
            summaries=selector.needs_summaries or prefill_selector is not None,
        )
        self.sampler = Sampler(
            torch.Generator(device).manual_seed(seed), calibration_temperature, stress
        )
        self.query_capturer = query_capturer

    def set_selector(self, selector: AttentionSelector) -> None:
        """Decode attention asks ``selector`` from the next step on; prefill is unaffected, so one
        prefilled context can be decoded under several (benchmarks compare them on one cache)."""
        if selector.needs_summaries and self.cache.key_bounds is None:
            raise ValueError(
                "this selector scores blocks by their summaries, which the cache does not keep: "
                "build the engine with pruning on (control=ControlConfig(pruning=...))"
            )
        self.attention.selector = selector

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, decisions: StepDecisions) -> StepResult:
        """Compute the batch's tokens into the cache under the step's decisions; the logits
        where a sequence's known tokens end and at each of its drafts."""
        inputs = self.prepare(batch, decisions.block_budgets)
        hidden = self.model.forward(inputs.input_ids, inputs.positions, self.cache, inputs.meta)
        if inputs.capture is not None:
            self.query_capturer.store(inputs.capture)
        prefilling = batch.seqs[len(batch.seqs) - len(inputs.meta.prefills) :]
        for chunk, seq in zip(inputs.meta.prefills, prefilling, strict=True):
            if chunk.sparse is not None:
                seq.metrics.prefill_attention_skipped = chunk.sparse.profile.skipped_share
        telemetry = inputs.meta.telemetry
        stats = None if telemetry is None else AttentionStats.of(batch, telemetry)
        if not batch.sampled:
            return StepResult(stats, None)
        return StepResult(stats, self.model.compute_logits(hidden[inputs.sample_rows]))

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, seqs: list[Sequence], states: list[float | None]
    ) -> SamplerOutput:
        """One token for each row of ``logits`` (one per sequence), each row's temperature law
        starting from ``states``."""
        sampling = SamplingBatch.build(
            [seq.params for seq in seqs],
            states,
            [self._generator(seq) for seq in seqs],
            logits.shape[-1],
            self.device,
            forced=[seq.next_forced for seq in seqs],
        )
        return self.sampler(logits, sampling)

    @torch.inference_mode()
    def score(self, token_ids: list[int], blocks: list[int]) -> torch.Tensor:
        """Logits at every position of one sequence, prefilled into ``blocks``."""
        ids, positions, meta = self._prefill_inputs(token_ids, blocks)
        hidden = self.model.forward(ids, positions, self.cache, meta)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def exit_states(
        self, token_ids: list[int], blocks: list[int], layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence prefilled into ``blocks``: the residual stream after ``layer`` layers
        and after the last one, at every position."""
        ids, positions, meta = self._prefill_inputs(token_ids, blocks)
        model = self.model
        early = model.run_layers(model.embed_tokens(ids), positions, self.cache, meta, range(layer))
        last = model.run_layers(early, positions, self.cache, meta, range(layer, len(model.layers)))
        return early, last

    def _prefill_inputs(
        self, token_ids: list[int], blocks: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        n = len(token_ids)
        positions = torch.arange(n)
        table = torch.tensor(blocks)
        slots = table[positions // self.block_size] * self.block_size + positions % self.block_size
        if self.batch_invariant:  # every row as a decode row, as in a step (``prepare``)
            decode_blocks, _, pattern = self._decode_rows(table.expand(n, -1), positions + 1)
            meta = AttentionMetadata(slots.to(self.device), n, decode_blocks, pattern, [])
        else:
            mask = prefill_mask(0, n, self.sliding_window, self.device)
            chunk = PrefillChunk(0, n, None, mask)
            meta = AttentionMetadata(slots.to(self.device), 0, None, None, [chunk])
        ids = torch.tensor(token_ids, device=self.device)
        return ids, positions.to(self.device), meta

    def _decode_rows(
        self, tables: torch.Tensor, context_lens: torch.Tensor
    ) -> tuple[DecodeBlocks, torch.Tensor, DecodePattern]:
        """Rows that attend as decode rows: each to its ``context_lens`` first cache entries
        through its row of ``tables``. Their layout, visible blocks and dense pattern."""
        blocks = DecodeBlocks(tables.to(self.device), context_lens.to(self.device), self.block_size)
        visible, pattern = decode_pattern(
            blocks,
            self.config.num_kv_heads,
            self.config.queries_per_kv,
            self.cache.num_slots,
            sliding_window=self.sliding_window,
        )
        return blocks, visible, pattern

    @torch.inference_mode()
    def early_exit(self, batch: ScheduledBatch, num_layers: int) -> torch.Tensor:
        """The residual stream after ``num_layers`` layers at each sequence's last row."""
        inputs = self.prepare(batch)
        hidden = self.model.forward(
            inputs.input_ids, inputs.positions, self.cache, inputs.meta, num_layers
        )
        last_rows = torch.tensor(batch.num_tokens).cumsum(0) - 1
        return hidden[last_rows.to(self.device)]

    def prepare(self, batch: ScheduledBatch, budgets: list[int] | None = None) -> StepInputs:
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
        decode_blocks = dense = telemetry = None
        if num_decode:
            decode_width = max(len(seq.block_table) for seq in seqs[:num_decode])
            decode_blocks, visible, dense = self._decode_rows(
                tables[row_seq[:decode_rows], :decode_width], index[:decode_rows] + 1
            )
            if budgets is not None:
                row_budgets = torch.tensor(budgets).repeat_interleave(counts_t[:num_decode])
                self._set_budgets(decode_blocks, index[:decode_rows] + 1, row_budgets)
                telemetry = PruningTelemetry.empty(
                    self.config.num_layers, decode_blocks, visible, self.attention.scale
                )
        prefills = []
        for i in range(num_decode, len(seqs)):
            start, n = starts[i], counts[i]
            sparse = self._sparse_context(seqs[i], start, n, tables[i])
            context_slots = None
            if start or sparse is not None:
                context = torch.arange(start + n)
                context_slots = (tables[i, context // bs] * bs + context % bs).to(self.device)
            mask = prefill_mask(start, n, self.sliding_window, self.device)
            prefills.append(PrefillChunk(int(chunk_start[i]), n, context_slots, mask, sparse))

        fresh = (slot_mapping[slot_mapping % bs == 0] // bs).to(self.device)
        capture = None
        if self.query_capturer is not None:
            capture = self.query_capturer.plan_capture(seqs, starts, counts, chunk_start.tolist())
        meta = AttentionMetadata(
            slot_mapping.to(self.device),
            decode_rows,
            decode_blocks,
            dense,
            prefills,
            fresh,
            telemetry,
            capture_rows=None if capture is None else capture.rows,
            captured=None if capture is None else capture.queries,
        )
        sampled = torch.tensor(batch.sampled, dtype=torch.long)
        verified = torch.tensor([len(batch.drafts[i]) + 1 for i in batch.sampled], dtype=torch.long)
        ends = (chunk_start + counts_t)[sampled]
        sample_rows = torch.repeat_interleave(ends, verified) - _ranks_from_end(verified)
        return StepInputs(
            input_ids=torch.tensor(input_ids, device=self.device),
            positions=positions.to(self.device),
            meta=meta,
            sample_rows=sample_rows.to(self.device),
            capture=capture,
        )

    def _sparse_context(
        self, seq: Sequence, start: int, n: int, table: torch.Tensor
    ) -> PrefillContext | None:
        """What sparse prefill needs of a prefilling sequence; None where it attends densely."""
        if self.prefill_selector is None:
            return None
        seq.attention_profile = self.prefill_selector.begin(
            seq.attention_profile, start, start + n, seq.num_tokens
        )
        if seq.attention_profile is None:
            return None
        return PrefillContext(start, seq.num_tokens, table.to(self.device), seq.attention_profile)

    def _set_budgets(
        self, blocks: DecodeBlocks, context_lens: torch.Tensor, budgets: torch.Tensor
    ) -> None:
        """Hand the per-row budgets to attention where some row keeps less than its context."""
        in_context = -(-context_lens // self.block_size)
        if bool((budgets < in_context).any()):
            blocks.budgets = budgets.to(self.device)
            blocks.max_budget = int(budgets.max())

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.seed is None or seq.params.greedy:
            return None
        if seq.generator is None:
            seq.generator = torch.Generator(self.device).manual_seed(seq.params.seed)
        return seq.generator


def _ranks_from_end(lengths: torch.Tensor) -> torch.Tensor:
    """For runs of ``lengths``, each element's distance from past its run's end: n, ..., 1."""
    offsets = torch.arange(int(lengths.sum())) - torch.repeat_interleave(
        torch.cumsum(lengths, 0) - lengths, lengths
    )
    return torch.repeat_interleave(lengths, lengths) - offsets
