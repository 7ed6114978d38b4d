"""Which KV-cache blocks each decoding sequence attends to (the paper's meso scale, section 3.2).

A selector acts at two depths. Once per step (``plan_budgets``) it reads each decoding
sequence's predictive entropy from the step's control record and decides how many blocks it
keeps. In every layer (``select``, the model's ``AttentionSelector`` hook) it sees the layer's
decode queries and the paged layout and answers with a mask of kept blocks per sequence and KV
head, or ``None`` for all of them. The attention backend turns the answer into the cache slots
it reads, so keeping fewer blocks makes attention compute less, not just mask more.

The entropic selector ranks blocks by a cheap contribution score and keeps a budget that follows
the sequence's entropy regime (low entropy: fewer blocks). The paper's score is
``I_b = sum_{i in b} a_i s(v_i)``; computing the weights ``a_i`` exactly costs the attention it is
meant to save, so proxies are offered (``reused-mass``, the last, is the default: at equal step
time the closest to dense attention, and it keeps the passkeys dense attention finds):

- ``bound``: per-channel key bounds ``m <= k <= M`` of the block give ``q.k <= sum_c max(q_c M_c,
  q_c m_c)`` for every key in it (Quest), an upper bound on each score, at O(head_dim) a block;
- ``mass``: the attention mass the block received the last time it was attended to (``s = 1``:
  the paper does not define a computable value surprisal), refreshed by a dense step every
  ``refresh_interval`` steps;
- ``digest``: each block's per-channel key mean ``mu`` and spread ``sigma`` (the cache keeps the
  sums of its keys and of their squares) give ``q.mu + k ||q * sigma||``, an estimate of the
  block's largest score where min/max bounds give one outlier key the whole block's reach in
  every channel (after a public engine's change that took needle retrieval from 2/10 to 10/10);
  the same walk and bytes as the bounds, and no certificate of what it drops;
- ``bound-value``: the key bound with a value factor. Dropping a block changes the attention
  output by about its mass times the distance between its mean value and the output, so the
  score is ``log(bound mass) + log ||v_b - o||``, with ``o`` the output the bounds themselves
  predict (their softmax over the blocks' mean values, which the cache keeps as sums);
- ``reused-mass`` (after TidalDecode): a few selection layers attend densely, and attention
  records the exact mass each block got there (free: the dense weights are computed anyway);
  every later layer keeps the blocks the last selection layer weighed most (the most any of its
  heads gave), plus what the next selection layer weighed most one step before, until the next
  one. The second term is free too (the cache keeps every layer's last mass) and carries what a
  deep layer retrieves to the layers before it: with the first layer's mass alone a passkey
  dense attention found was lost, with both it was kept (BENCHMARKS.md). Exact where it ranks,
  it needs no key bounds at all; a layer that pruned this way certifies nothing it dropped (its
  dropped mass reads 1);
- ``sketch``: every key's low-rank copy, kept by the cache in 8 bits (``key_sketch.py``), scores
  each token against the layer's query; a block weighs the softmax mass its tokens carry under
  those scores, the most any query head of its group gives it. It reads the copy of every
  token in context (rank / (2 head_dim) of a 16-bit cache's bytes, in 8 bits) and certifies
  nothing it dropped. ``sketch-tokens`` keeps single tokens by the same scores instead of
  blocks, as many as the budget's blocks hold (attention then reads a list of cache rows).

**Per-head budgets** (``head_budgets``, after EntropyInfer and AdaKV): the sequence's budget,
times its KV heads, is shared among the heads by one ranking of every (head, block) pair by the
block's share of that head's attention (the key bounds' softmax). A head whose attention has a
low entropy covers its mass with a few blocks and gives the rest to heads that spread theirs, at
the same blocks read. Each head first keeps ``head_floor`` of the row's budget by its own
ranking: the estimate is an upper bound, and a head it calls sharp must not be starved. (The
seed's rule, a share in proportion to ``e^H`` per head, measured worse than one budget for all
heads at every share: BENCHMARKS.md.)

Guards (the paper's sections 3.2, 3.3 and 5), the first four applied
where each sequence's budget is planned (``plan_budget``):

- the entropy floor ``H_prune = max(H_upper, H_floor)``, where ``H_upper`` is the upper side of
  the estimate;
- a minimum budget of blocks; budgets never round down to zero;
- the sink block and the most recent blocks are always kept, and so is the current token's block
  (the backend adds it);
- dense attention below a minimum context length and in the first layers;
- a rate limit: a budget may grow at once but shrinks by at most a fraction per step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from etinfer.control.block_budgets import (
    MEASURED_LAWS,
    PruningConfig,
    plan_budget,
    selection_layers,
)
from etinfer.control.block_scores import (
    best_of,
    key_bound_scores,
    key_digest_scores,
    value_weighted,
)
from etinfer.control.key_sketch import SketchMaps, sketch_block_scores, sketch_token_pattern
from etinfer.control.record import Controlled, ControlRecord
from etinfer.control.registry import Registry
from etinfer.model.block_layout import (
    AttentionSelector,
    BlockSummaries,
    DecodeBlocks,
    Selection,
    TokenChoice,
)


class BlockSelector(AttentionSelector):
    """A decode-pruning layer: block budgets once per step (``plan_budgets``), the blocks
    themselves in every layer (``select``, the model's per-layer hook)."""

    def plan_budgets(
        self, record: ControlRecord, decoding: Sequence[Controlled], block_size: int
    ) -> list[int] | None:
        """Per-step hook: how many blocks each decoding sequence keeps this step, from its
        entry in the record; None when none prunes."""
        return None


BLOCK_SELECTORS: Registry[BlockSelector] = Registry("block selector")


@BLOCK_SELECTORS.register("dense")
class DenseSelector(BlockSelector):
    reads_everything = True

    def select(self, layer, query, blocks, summaries) -> None:
        return None


@BLOCK_SELECTORS.register("entropic")
class EntropicSelector(BlockSelector):
    needs_summaries = True

    def __init__(
        self,
        config: PruningConfig | None = None,
        scale: float | None = None,
        full_layers: Sequence[int] | None = None,
        sketch: SketchMaps | None = None,
    ) -> None:
        """``scale``: attention's score scale, where the model's is not head_dim ** -0.5
        (Gemma's query_pre_attn_scalar): the head budgets and the bound-value scorer turn key
        bounds into attention logits with it. ``full_layers``: the model's layers that see the
        whole context (the others slide over a window and are never pruned), where the
        reused-mass scorer's selection layers must lie. ``sketch``: the sketch scorer's maps."""
        self.config = config = config or PruningConfig()
        # Only the digest reads them: the other scorers' caches skip their upkeep at every write.
        self.needs_moments = config.scorer == "digest"
        self.observes_mass = config.scorer in ("mass", "reused-mass")
        # Reused masses rank by what the selection layers measured, not by the layer's query.
        self.selects_without_query = config.scorer == "reused-mass"
        self.scale = scale
        self.selection_layers: tuple[int, ...] = ()
        if config.scorer == "reused-mass":
            self.selection_layers = selection_layers(config, full_layers)
        self.sketch = sketch
        if config.sketched:
            if sketch is None:
                raise ValueError(f"scorer {config.scorer!r} needs its fitted maps (SketchMaps)")
            self.sketch_key_maps = sketch.key_maps
        self.selects_tokens = config.scorer == "sketch-tokens"
        if self.selects_tokens:
            self.token_choice = TokenChoice(
                sketch.query_maps, config.dense_layers, config.sink_blocks, config.recent_blocks
            )

    def observes(self, layer: int) -> bool:
        if self.config.scorer == "reused-mass":
            return layer in self.selection_layers
        return self.observes_mass

    def reads_all_of(self, blocks: DecodeBlocks | None) -> bool:
        return blocks is not None and blocks.budgets is None  # ``select`` returns None

    def plan_budgets(
        self, record: ControlRecord, decoding: Sequence[Controlled], block_size: int
    ) -> list[int]:
        """Dense where the sequence has no estimate yet or is recomputing its prompt after a
        preemption (a one-token chunk of a prompt is prefill, not decode); with the mass
        scorer, a dense refresh every ``refresh_interval`` generated tokens."""
        config, budgets = self.config, []
        for seq in decoding:
            decoding_token = seq.num_computed_tokens + 1 == seq.num_tokens
            context = seq.num_computed_tokens - seq.kv_offset + 1  # entries in its cache
            entry = record[seq]
            refresh = config.scorer == "mass" and (
                (seq.num_output_tokens - 1) % config.refresh_interval == 0
            )
            budgets.append(
                plan_budget(
                    entry.predictive_entropy_upper if decoding_token else None,
                    context,
                    entry.block_budget,
                    refresh,
                    config,
                    block_size,
                    len(decoding),
                )
            )
        return budgets

    def select(self, layer, query, blocks, summaries) -> Selection | None:
        if layer < self.config.dense_layers or blocks.budgets is None:
            return None
        if self.config.scorer == "reused-mass":
            return self.reuse(layer, query, blocks, summaries)
        if self.config.scorer == "digest":
            spread = self.config.digest_spread
            estimates, bounds = key_digest_scores(query, summaries, blocks, spread), None
        elif self.config.sketched:
            return self.sketch_selection(layer, query, blocks, summaries)
        else:
            estimates = bounds = key_bound_scores(query, summaries, blocks.block_tables)
        scores = self.block_scores(layer, query, blocks, summaries, estimates)
        budgets = None
        if self.config.head_budgets:
            logits = estimates * self._scale(query)
            budgets = self.head_budgets(self.head_mass(logits, scores, blocks), scores, blocks)
        return Selection(self.keep_best(scores, blocks, budgets), bounds)

    def sketch_selection(
        self, layer: int, query: torch.Tensor, blocks: DecodeBlocks, summaries: BlockSummaries
    ) -> Selection:
        """The blocks, or single tokens, the key copy ranks best: single tokens as many as
        the budget's blocks hold, the sink's and the most recent ones first (the current
        token among them)."""
        size = blocks.block_size
        codes, code_scales = summaries.key_sketch, summaries.sketch_scales
        query_map = self.sketch.query_maps[layer].to(query.device)
        copy = (query, query_map, codes, code_scales, blocks, self._scale(query))
        if not self.selects_tokens:
            scores = sketch_block_scores(*copy).amax(2)  # the most any head of the group gives
            return Selection(self.keep_best(scores, blocks))
        sink, recent = self.token_choice.forced_tokens(size)
        tokens, kept = sketch_token_pattern(*copy, blocks.budgets * size, sink, recent)
        return Selection(kept, tokens=tokens)

    def block_scores(
        self,
        layer: int,
        query: torch.Tensor,
        blocks: DecodeBlocks,
        summaries: BlockSummaries,
        estimates: torch.Tensor,
    ) -> torch.Tensor:
        """What each block may contribute, [seqs, kv_heads, max_blocks]: higher is kept first.
        ``estimates``: each block's largest score per query head (its key bound, or digest)."""
        if self.config.scorer == "mass":
            return summaries.mass[:, blocks.block_tables].permute(1, 0, 2)
        bound = estimates.amax(2)  # a block matters if it may matter to any head of the group
        if self.config.scorer == "bound-value":
            return value_weighted(bound * self._scale(query), summaries, blocks)
        return bound

    def reuse(
        self, layer: int, query: torch.Tensor, blocks: DecodeBlocks, summaries: BlockSummaries
    ) -> Selection | None:
        """A selection layer attends densely, its mass recorded in place as attention runs
        (``observes``); a later layer keeps what the last one weighed most, the same blocks for
        every KV head (a head of this layer has no counterpart there), ranked once a step."""
        if layer in self.selection_layers:
            blocks.derived[("reused-mass",)] = (layer, summaries)
            return None
        if ("reused-mass",) not in blocks.derived:
            return None  # before the first selection layer: dense
        source, measured = blocks.derived[("reused-mass",)]
        key = ("reused-mask", source)
        if key not in blocks.derived:
            weighed = self.weighed(source, measured, blocks)
            kv_heads = measured.mass.shape[0]
            scores = weighed[:, None].expand(-1, kv_heads, -1)
            budgets = None
            if self.config.budget_law in MEASURED_LAWS:
                budgets = self.measured_budgets(weighed, blocks)[:, None].expand(-1, kv_heads)
            blocks.derived[key] = self.keep_best(scores, blocks, budgets)
        return Selection(blocks.derived[key])

    def weighed(self, source: int, measured: BlockSummaries, blocks: DecodeBlocks) -> torch.Tensor:
        """Each row's blocks [seqs, max_blocks] by the share of attention selection layer
        ``source`` gave them this step (the most any of its KV heads gave), plus the share the
        next selection layer gave them the step before (it has not run yet in this one)."""
        tables = blocks.block_tables
        weighed = measured.mass[:, tables].amax(0)
        later = [layer for layer in self.selection_layers if layer > source]
        if later and measured.layer_masses is not None:
            ahead = measured.layer_masses[later[0]][:, tables].amax(0)
            # +inf: written since that layer last ran (or never decoded): this step's share alone
            weighed = weighed + ahead.masked_fill(ahead.isinf(), 0.0)
        return weighed

    def measured_budgets(self, weighed: torch.Tensor, blocks: DecodeBlocks) -> torch.Tensor:
        """Per row, the blocks a law that counts measured mass keeps, from the ``weighed`` mass
        [seqs, max_blocks]: the sink and recent blocks and, of the others, the fewest whose
        share reaches ``top_p`` of theirs (top-p), or a share of them between budget_low and
        budget_high that follows the entropy of their mass (attention-entropy); within the
        row's planned budget (the cap) and at least ``min_blocks``."""
        config = self.config
        forced = self.forced_blocks(blocks) & blocks.present
        others = weighed.masked_fill(forced | ~blocks.present, 0.0).nan_to_num(posinf=0.0)
        if config.budget_law == "attention-entropy":
            candidates = (blocks.present & ~forced).sum(-1)
            probs = others / others.sum(-1, keepdim=True).clamp(min=1e-30)
            entropy = -(probs * probs.clamp(min=1e-30).log()).sum(-1)
            spread = (entropy / candidates.clamp(min=2).log()).clamp(max=1.0)  # 1: all alike
            share = config.budget_low + (config.budget_high - config.budget_low) * spread
            needed = (share * candidates - 1e-4).ceil().long()  # not a block for rounding
        else:
            share = others.sort(-1, descending=True).values.cumsum(-1)
            needed = (share < config.top_p * share[:, -1:]).sum(-1) + 1
        counts = needed + forced.sum(-1)
        return counts.clamp(min=config.min_blocks).minimum(blocks.budgets)

    def _scale(self, query: torch.Tensor) -> float:
        return self.scale or query.shape[-1] ** -0.5

    def head_mass(
        self, logits: torch.Tensor, scores: torch.Tensor, blocks: DecodeBlocks
    ) -> torch.Tensor:
        """Each block's share of each KV head's attention, [seqs, kv_heads, max_blocks],
        comparable across heads: the softmax of the scaled key bounds ``logits`` [seqs,
        kv_heads, group, max_blocks], the largest of the group's query heads."""
        exists = blocks.present
        return logits.masked_fill(~exists[:, None, None], -torch.inf).softmax(-1).amax(2)

    def head_budgets(
        self, mass: torch.Tensor, scores: torch.Tensor, blocks: DecodeBlocks
    ) -> torch.Tensor:
        """Blocks per row and KV head [seqs, kv_heads]: the row's budget times its heads,
        counted out of one ranking of all its (head, block) pairs by ``mass``, after each
        head's first ``head_floor`` share of the budget in its own order (``keep_best``'s)."""
        seqs, kv_heads, width = mass.shape
        exists = blocks.present
        floor = (blocks.budgets * self.config.head_floor).long()
        own = self.ranked(scores, blocks)
        first = best_of(own, floor[:, None], math.ceil(blocks.max_budget * self.config.head_floor))
        first |= self.forced_blocks(blocks)[:, None]
        ranked = mass.masked_fill(first, torch.inf).masked_fill(~exists[:, None], -torch.inf)
        chosen = best_of(ranked.flatten(1), blocks.budgets * kv_heads, blocks.max_budget * kv_heads)
        return (chosen.view(seqs, kv_heads, width) & exists[:, None]).sum(-1)

    def forced_blocks(self, blocks: DecodeBlocks) -> torch.Tensor:
        """The sink and the most recent blocks of each row, [seqs, max_blocks] (and the padding
        past its end)."""
        key = ("forced", self.config.sink_blocks, self.config.recent_blocks)
        if key not in blocks.derived:
            counts = blocks.present.sum(1)
            positions = torch.arange(blocks.block_tables.shape[1], device=counts.device)
            blocks.derived[key] = (positions < self.config.sink_blocks) | (
                positions >= counts[:, None] - self.config.recent_blocks
            )
        return blocks.derived[key]

    def ranked(self, scores: torch.Tensor, blocks: DecodeBlocks) -> torch.Tensor:
        """``scores`` with the forced blocks strictly first and missing ones last: blocks never
        attended to yet have an infinite mass, which is clamped just below the forced ones."""
        key = ("fixed", self.config.sink_blocks, self.config.recent_blocks)
        if key not in blocks.derived:
            # +inf at the forced blocks, -inf past the context; where neither, the score.
            forced, present = self.forced_blocks(blocks), blocks.present
            values = torch.zeros(present.shape, device=present.device)
            values.masked_fill_(forced, torch.inf).masked_fill_(~present, -torch.inf)
            blocks.derived[key] = ((forced | ~present)[:, None], values[:, None])
        overridden, values = blocks.derived[key]
        if self.observes_mass:
            scores = scores.clamp(max=torch.finfo(scores.dtype).max)
        return torch.where(overridden, values, scores)

    def keep_best(
        self, scores: torch.Tensor, blocks: DecodeBlocks, head_budgets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The mask of each row's ``budget`` best blocks (each head's, with ``head_budgets``),
        the forced ones (sink and recent) first."""
        scores = self.ranked(scores, blocks)
        # A head's budget may pass the row's: then every block is ranked.
        if head_budgets is None:
            mask = best_of(scores, blocks.budgets[:, None], blocks.max_budget)
        else:
            mask = best_of(scores, head_budgets, None)
        return mask & blocks.present[:, None, :]
