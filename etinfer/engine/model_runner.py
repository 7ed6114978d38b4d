"""Turn a scheduled batch into tensors, run the model over the paged cache, and sample."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import torch

from etinfer.control.block_selection import (
    BLOCK_SELECTORS,
    BlockSelector,
    DecodeBlocks,
    PruningConfig,
    plan_budget,
)
from etinfer.engine.sampler import Sampler, SamplerOutput, SamplingBatch
from etinfer.engine.scheduler import ScheduledBatch
from etinfer.engine.sequence import Sequence
from etinfer.model.config import ModelConfig
from etinfer.model.llama import LlamaModel
from etinfer.model.paged_attention import (
    AttentionMetadata,
    KVCache,
    PagedAttention,
    PrefillChunk,
    PruningTelemetry,
    build_decode_pattern,
    prefill_mask,
    visible_blocks,
)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # rows whose logits are sampled: the last row of a finished prompt
    sample_seqs: list[Sequence]
    decode_seqs: list[Sequence]


@dataclass
class AttentionStats:
    """What decode attention kept this step, per layer and per decoding sequence (host lists)."""

    seqs: list[Sequence]
    kept: list[list[float]]  # [layers][seqs] (block, KV head) pairs attended to
    total: list[list[float]]  # [layers][seqs] (block, KV head) pairs in context
    dropped_mass: list[list[float]]  # [layers][seqs] upper bound of the attention mass dropped


@dataclass
class StepResult:
    sampled: list[Sequence]
    output: SamplerOutput | None
    attention: AttentionStats | None  # only when pruning is on


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        selector: BlockSelector,
        *,
        max_model_len: int,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int,
        calibration_temperature: float = 1.0,
        pruning: PruningConfig | None = None,
    ) -> None:
        self.config = config
        self.pruning = pruning
        self.device = device
        self.block_size = block_size
        self.sliding_window = config.sliding_window
        self.attention = PagedAttention(
            config.num_heads, config.num_kv_heads, config.head_dim, selector, config.sliding_window
        )
        self.model = LlamaModel(config, weights, self.attention, max_model_len, device, dtype)
        self.cache = KVCache(
            config.num_layers,
            num_blocks,
            block_size,
            config.num_kv_heads,
            config.head_dim,
            device,
            summaries=selector.needs_summaries,
        )
        self.sampler = Sampler(torch.Generator(device).manual_seed(seed), calibration_temperature)
        # Called with each step's sampled sequences and their logits [rows, vocab] (benchmarks
        # and harnesses read the distributions through it).
        self.logits_hook: Callable[[list[Sequence], torch.Tensor], None] | None = None

    def set_pruning(
        self, config: PruningConfig | None, selector: BlockSelector | None = None
    ) -> None:
        """Prune decode attention with ``config`` from the next step on, or attend densely
        (None). Prefill is dense either way, so one prefilled context can be decoded both ways
        (benchmarks compare them on one cache). The cache must keep block summaries, which it
        does when the runner was built with pruning. ``selector`` chooses the blocks within
        the config's budgets instead of the entropic selector (benchmarks pass an oracle)."""
        if self.cache.key_bounds is None:
            raise ValueError(
                "set_pruning needs an engine built with pruning on "
                "(control=ControlConfig(pruning=...)): its cache keeps the key bounds"
            )
        self.pruning = config
        if config is not None:
            self.attention.selector = selector or BLOCK_SELECTORS.create("entropic", config=config)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Compute the batch's tokens into the cache; sample where a sequence's known tokens end."""
        inputs = self.prepare(batch)
        hidden = self.model.forward(inputs.input_ids, inputs.positions, self.cache, inputs.meta)
        telemetry = inputs.meta.telemetry
        stats = None
        if telemetry is not None:
            kept, total, dropped = torch.stack(
                [telemetry.kept, telemetry.total, telemetry.dropped_mass]
            ).tolist()
            stats = AttentionStats(inputs.decode_seqs, kept, total, dropped)
        if not inputs.sample_seqs:
            return StepResult([], None, stats)
        logits = self.model.compute_logits(hidden[inputs.sample_rows])
        seqs = inputs.sample_seqs
        if self.logits_hook is not None:
            self.logits_hook(seqs, logits)
        sampling = SamplingBatch.build(
            [seq.params for seq in seqs],
            [seq.control_state for seq in seqs],
            [self._generator(seq) for seq in seqs],
            logits.shape[-1],
            self.device,
            forced=[seq.next_forced for seq in seqs],
        )
        return StepResult(seqs, self.sampler(logits, sampling), stats)

    @torch.inference_mode()
    def score(self, token_ids: list[int], blocks: list[int]) -> torch.Tensor:
        """Logits at every position of one sequence, prefilled into ``blocks``."""
        positions = torch.arange(len(token_ids))
        table = torch.tensor(blocks)
        slots = table[positions // self.block_size] * self.block_size + positions % self.block_size
        mask = prefill_mask(0, len(token_ids), self.sliding_window, self.device)
        meta = AttentionMetadata(
            slots.to(self.device), 0, None, None, [PrefillChunk(0, len(token_ids), None, mask)]
        )
        ids = torch.tensor(token_ids, device=self.device)
        hidden = self.model.forward(ids, positions.to(self.device), self.cache, meta)
        return self.model.compute_logits(hidden)

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        seqs, counts = batch.seqs, batch.num_tokens
        bs = self.block_size
        starts = [seq.num_computed_tokens for seq in seqs]
        input_ids = list(
            chain.from_iterable(
                seq.token_ids[s : s + n] for seq, s, n in zip(seqs, starts, counts, strict=True)
            )
        )
        width = max(len(seq.block_table) for seq in seqs)
        tables = torch.tensor(
            [seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs]
        )
        counts_t, starts_t = torch.tensor(counts), torch.tensor(starts)
        row_seq = torch.repeat_interleave(torch.arange(len(seqs)), counts_t)
        chunk_start = torch.cumsum(counts_t, 0) - counts_t
        positions = starts_t[row_seq] + torch.arange(len(input_ids)) - chunk_start[row_seq]
        slot_mapping = tables[row_seq, positions // bs] * bs + positions % bs

        num_decode = batch.num_decode
        decode_blocks = dense = telemetry = None
        if num_decode:
            decoding = seqs[:num_decode]
            decode_width = max(len(seq.block_table) for seq in decoding)
            decode_blocks = DecodeBlocks(
                tables[:num_decode, :decode_width].to(self.device),
                (starts_t[:num_decode] + 1).to(self.device),
                bs,
            )
            visible = visible_blocks(
                decode_blocks, self.config.num_kv_heads, None, self.sliding_window
            )
            if self.pruning is not None:
                self._plan_budgets(decode_blocks, decoding)
                telemetry = PruningTelemetry.empty(self.config.num_layers, decode_blocks, visible)
            dense = build_decode_pattern(
                decode_blocks,
                visible,
                self.config.queries_per_kv,
                self.cache.num_slots,
                self.sliding_window,
            )
        prefills = []
        for i in range(num_decode, len(seqs)):
            start, n = starts[i], counts[i]
            context_slots = None
            if start:
                context = torch.arange(start + n)
                context_slots = (tables[i, context // bs] * bs + context % bs).to(self.device)
            mask = prefill_mask(start, n, self.sliding_window, self.device)
            prefills.append(PrefillChunk(int(chunk_start[i]), n, context_slots, mask))

        ends = [s + n for s, n in zip(starts, counts, strict=True)]
        sampled = [i for i, seq in enumerate(seqs) if ends[i] == seq.num_tokens]
        fresh = None
        if self.cache.key_bounds is not None:
            fresh = (slot_mapping[slot_mapping % bs == 0] // bs).to(self.device)
        meta = AttentionMetadata(
            slot_mapping.to(self.device),
            num_decode,
            decode_blocks,
            dense,
            prefills,
            fresh,
            telemetry,
        )
        return StepInputs(
            input_ids=torch.tensor(input_ids, device=self.device),
            positions=positions.to(self.device),
            meta=meta,
            sample_rows=(chunk_start + counts_t - 1)[sampled].to(self.device),
            sample_seqs=[seqs[i] for i in sampled],
            decode_seqs=seqs[:num_decode],
        )

    def _plan_budgets(self, blocks: DecodeBlocks, seqs: list[Sequence]) -> None:
        """Each decoding sequence's block budget for this step, from its entropy (the upper side
        of its last estimate). A one-token chunk of a prompt being recomputed after preemption
        is prefill, not decode: dense."""
        config = self.pruning
        budgets, dense = [], True
        for seq in seqs:
            context = seq.num_computed_tokens + 1
            decoding = context == seq.num_tokens
            refresh = config.scorer == "mass" and (
                (seq.num_output_tokens - 1) % config.refresh_interval == 0
            )
            budget = plan_budget(
                seq.pruning_entropy if decoding else None,
                context,
                seq.block_budget,
                refresh,
                config,
                self.block_size,
            )
            seq.block_budget = budget
            budgets.append(budget)
            dense &= budget >= -(-context // self.block_size)
        if not dense:
            blocks.budgets = torch.tensor(budgets, device=self.device)
            blocks.max_budget = max(budgets)

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.seed is None or seq.params.greedy:
            return None
        if seq.generator is None:
            seq.generator = torch.Generator(self.device).manual_seed(seq.params.seed)
        return seq.generator
