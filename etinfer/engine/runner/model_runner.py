"""Turn a scheduled batch into tensors, run the model over the paged cache, and sample."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from etinfer.control.record import StepDecisions
from etinfer.control.sparse_prefill import SparsePrefillSelector
from etinfer.engine.runner.attention_stats import AttentionStats
from etinfer.engine.runner.cuda_graphs import DecodeGraphs
from etinfer.engine.runner.options import RunnerOptions
from etinfer.engine.runner.step_inputs import QueryCapturer, StepInputBuilder
from etinfer.engine.sampling.prompt_logprobs import PromptScores, score_prompts
from etinfer.engine.sampling.sampler import Sampler, SamplerOutput
from etinfer.engine.sampling.sampling_batch import SamplingBatch
from etinfer.engine.scheduler import ScheduledBatch
from etinfer.engine.sequence import Sequence
from etinfer.model.attention.layer import PagedAttention
from etinfer.model.block_layout import AttentionSelector
from etinfer.model.families import family_of
from etinfer.model.kv_cache import KVCache
from etinfer.model.linear import rows_alone
from etinfer.model.llama import LlamaModel
from etinfer.model.loader import LoadedModel


@dataclass
class StepResult:
    attention: AttentionStats | None  # only when block budgets were planned
    # [sample rows, vocab] before any sampling transform (see StepInputs.sample_rows); None
    # when the step samples nothing.
    logits: torch.Tensor | None
    # Prefill chunks' prompt log-probabilities, where their requests asked for them.
    prompt_scores: list[PromptScores] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        *,
        model: LoadedModel,
        options: RunnerOptions,
        selector: AttentionSelector,
        query_capturer: QueryCapturer | None = None,
    ) -> None:
        """The cache keeps per-block summaries if ``selector`` scores blocks (then any other
        selector can be installed later, ``set_selector``) or sparse prefill is on.
        ``query_capturer``: the layer that keeps some rows' queries, if one is on."""
        config, sparse_prefill = model.config, options.sparse_prefill
        prefill_selector = None
        if sparse_prefill is not None:
            # Where only some layers slide (Gemma 3), those read their window densely and the
            # others are narrowed; a window on every layer (Mistral) leaves nothing to narrow.
            prefill_selector = SparsePrefillSelector(
                sparse_prefill,
                num_layers=config.num_layers,
                num_heads=config.num_heads,
                num_kv_heads=config.num_kv_heads,
                head_dim=config.head_dim,
                block_size=options.block_size,
                max_model_len=options.max_model_len,
                scale=config.scale,
            )
        self.config, self.options = config, options
        self.max_model_len = options.max_model_len
        self.device = device = options.device
        self.block_size = block_size = options.block_size
        self.attention = PagedAttention(
            options=options.attention,
            device=device,
            selector=selector,
            prefill_selector=prefill_selector,
        )
        self.model = LlamaModel(
            model,
            family_of(config),
            self.attention,
            options.max_model_len,
            device,
            options.dtype,
            options.quantization,
        )
        summaries = selector.needs_summaries or prefill_selector is not None
        # Graphs replay a decode step's fixed launches: none where a layer changes a step's shape
        # or reads whole blocks (block summaries, captured queries, batch-invariant rows).
        backend, batch_invariant = self.attention.backend, options.attention.batch_invariant
        graphs = options.cuda_graphs and device.type == "cuda" and backend.reads_block_tables
        graphs = graphs and not summaries and query_capturer is None and not batch_invariant
        self.cache = KVCache(
            config.num_layers,
            options.num_blocks + (1 if graphs else 0),  # a block of the graphs' padding rows' own
            block_size,
            config.num_kv_heads,
            config.head_dim,
            device,
            options.kv_cache_dtype,
            summaries=summaries,
            moments=selector.needs_moments,
            sketch_key_maps=selector.sketch_key_maps,
        )
        self.graphs = None
        if graphs:
            max_blocks = -(-options.max_model_len // block_size)
            scratch_slot = options.num_blocks * block_size
            self.graphs = DecodeGraphs(
                self.model, self.cache, options.max_num_seqs, max_blocks, scratch_slot
            )
        self.sampler = Sampler(
            torch.Generator(device).manual_seed(options.seed),
            options.calibration_temperature,
            options.stress,
        )
        self.query_capturer = query_capturer
        self.inputs = StepInputBuilder(
            config,
            device=device,
            block_size=block_size,
            num_slots=self.cache.num_slots,
            scale=options.attention.scale,
            prefill_selector=prefill_selector,
            batch_invariant=batch_invariant,
            query_capturer=query_capturer,
            backend=backend,
        )

    def set_selector(self, selector: AttentionSelector) -> None:
        """Decode attention asks ``selector`` from the next step on; prefill is unaffected, so one
        prefilled context can be decoded under several (benchmarks compare them on one cache)."""
        if selector.needs_moments and self.cache.key_moments is None:
            raise ValueError(
                "this selector ranks blocks by their keys' moments, which the cache does not "
                "keep: build the engine with pruning by the digest (PruningConfig(scorer='digest'))"
            )
        if selector.needs_summaries and self.cache.key_bounds is None:
            raise ValueError(
                "this selector scores blocks by their summaries, which the cache does not keep: "
                "build the engine with pruning on (control=ControlConfig(pruning=...))"
            )
        maps, kept = selector.sketch_key_maps, self.cache.sketch_key_maps
        if maps is not None and (kept is None or not torch.equal(maps.to(kept), kept)):
            raise ValueError(
                "this selector ranks tokens by a copy of the keys the cache does not keep by its "
                "maps: build the engine with the same pruning (PruningConfig(scorer='sketch'))"
            )
        self.attention.set_selector(selector)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, decisions: StepDecisions) -> StepResult:
        """Compute the batch's tokens into the cache under the step's decisions; the logits
        where a sequence's known tokens end and at each of its drafts."""
        if self._replayable(batch, decisions):
            return StepResult(None, self.graphs.run(batch.seqs))
        inputs = self.inputs.step(batch, decisions.block_budgets)
        with rows_alone(self.inputs.batch_invariant):
            hidden = self.model.forward(inputs.input_ids, inputs.positions, self.cache, inputs.meta)
        if inputs.capture is not None:
            self.query_capturer.store(inputs.capture)
        prefilling = batch.seqs[len(batch.seqs) - len(inputs.meta.prefills) :]
        for chunk, seq in zip(inputs.meta.prefills, prefilling, strict=True):
            if chunk.sparse is not None:
                seq.metrics.prefill_attention_skipped = chunk.sparse.profile.skipped_share
        telemetry = inputs.meta.telemetry
        stats = None if telemetry is None else AttentionStats.of(batch, telemetry)
        scores = score_prompts(hidden, inputs.meta.prefills, prefilling, self.model)
        if not batch.sampled:
            return StepResult(stats, None, scores)
        logits = self.model.compute_logits(hidden[inputs.sample_rows])
        return StepResult(stats, logits, scores)

    def _replayable(self, batch: ScheduledBatch, decisions: StepDecisions) -> bool:
        """Whether the step is a plain decode step a graph computes: one row per sequence, each
        sampled, every block read."""
        graphs, seqs = self.graphs, batch.seqs
        if graphs is None or decisions.block_budgets is not None:
            return False
        if not self.attention.selector.reads_everything or any(batch.drafts):
            return False
        if batch.num_decode != len(seqs) or batch.sampled != list(range(len(seqs))):
            return False
        return graphs.takes(len(seqs), max(len(seq.block_table) for seq in seqs))

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        states: list[float | None],
        allowed: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """One token for each row of ``logits`` (one per sequence), each row's temperature law
        starting from ``states``; ``allowed`` [rows, vocab] masks what grammars forbid."""
        sampling = SamplingBatch.build(
            [seq.params for seq in seqs],
            states,
            [self._generator(seq) for seq in seqs],
            logits.shape[-1],
            self.device,
            forced=[seq.next_forced for seq in seqs],
            allowed=allowed,
            constrained=[seq.matcher is not None for seq in seqs],
        )
        return self.sampler(logits, sampling)

    @torch.inference_mode()
    def score(self, token_ids: list[int], blocks: list[int]) -> torch.Tensor:
        """Logits at every position of one sequence, prefilled into ``blocks``."""
        ids, positions, meta = self.inputs.sequence(token_ids, blocks)
        hidden = self.model.forward(ids, positions, self.cache, meta)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def exit_states(
        self, token_ids: list[int], blocks: list[int], layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence prefilled into ``blocks``: the residual stream after ``layer`` layers
        and after the last one, at every position."""
        ids, positions, meta = self.inputs.sequence(token_ids, blocks)
        model = self.model
        early = model.run_layers(model.embed_tokens(ids), positions, self.cache, meta, range(layer))
        last = model.run_layers(early, positions, self.cache, meta, range(layer, len(model.layers)))
        return early, last

    @torch.inference_mode()
    def early_exit(self, batch: ScheduledBatch, num_layers: int) -> torch.Tensor:
        """The residual stream after ``num_layers`` layers at each sequence's last row."""
        inputs = self.inputs.step(batch)
        hidden = self.model.forward(
            inputs.input_ids, inputs.positions, self.cache, inputs.meta, num_layers
        )
        last_rows = torch.tensor(batch.num_tokens).cumsum(0) - 1
        return hidden[last_rows.to(self.device)]

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.seed is None or seq.params.greedy:
            return None
        if seq.generator is None:
            seq.generator = torch.Generator(self.device).manual_seed(seq.params.seed)
        return seq.generator
