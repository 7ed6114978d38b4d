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
meant to save, so two proxies are offered:

- ``bound``: per-channel key bounds ``m <= k <= M`` of the block give ``q.k <= sum_c max(q_c M_c,
  q_c m_c)`` for every key in it (Quest), an upper bound on each score, at O(head_dim) a block;
- ``mass``: the attention mass the block received the last time it was attended to (``s = 1``:
  the paper does not define a computable value surprisal), refreshed by a dense step every
  ``refresh_interval`` steps;
- ``bound-value``: the key bound with a value factor. Dropping a block changes the attention
  output by about its mass times the distance between its mean value and the output, so the
  score is ``log(bound mass) + log ||v_b - o||``, with ``o`` the output the bounds themselves
  predict (their softmax over the blocks' mean values, which the cache keeps as sums).

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
from dataclasses import dataclass

import torch

from etinfer.control.record import Controlled, ControlRecord
from etinfer.control.registry import Registry
from etinfer.model import block_kernels
from etinfer.model.block_layout import AttentionSelector, BlockSummaries, DecodeBlocks, Selection
from etinfer.validation import check_choice, check_float, check_int

SCORERS = ("bound", "bound-value", "mass")


@dataclass(frozen=True)
class PruningConfig:
    scorer: str = "bound"
    min_context: int = 1024  # tokens; shorter contexts attend densely
    dense_layers: int = 2  # the first layers stay dense (Quest keeps two; measured here too)
    min_blocks: int = 8
    sink_blocks: int = 1
    recent_blocks: int = 2
    entropy_floor: float = 0.5  # nats
    entropy_high: float = 4.0  # at and above it the budget is budget_high
    budget_low: float = 0.125  # fraction of blocks kept at (or below) the floor
    budget_high: float = 0.5
    max_shrink: float = 0.25  # a budget loses at most this fraction per step
    refresh_interval: int = 16  # mass scorer: a dense step this often
    head_budgets: bool = False  # share the budget among KV heads by where their attention lies
    head_floor: float = 0.5  # share of the budget each head keeps by its own ranking first

    def __post_init__(self) -> None:
        check_choice("scorer", self.scorer, SCORERS)
        check_int("min_context", self.min_context, low=0)
        check_int("dense_layers", self.dense_layers, low=0)
        check_int("sink_blocks", self.sink_blocks, low=0)
        check_int("recent_blocks", self.recent_blocks, low=0)
        # The always-kept blocks fit in every budget, so none of them is ever cut.
        check_int("min_blocks", self.min_blocks, low=max(1, self.sink_blocks + self.recent_blocks))
        check_float("entropy_floor", self.entropy_floor, low=0.0)
        check_float("entropy_high", self.entropy_high, low=self.entropy_floor, low_open=True)
        check_float("budget_low", self.budget_low, low=0.0, high=1.0, low_open=True)
        check_float("budget_high", self.budget_high, low=self.budget_low, high=1.0)
        check_float("max_shrink", self.max_shrink, low=0.0, high=1.0)
        check_int("refresh_interval", self.refresh_interval, low=1)
        check_float("head_floor", self.head_floor, low=0.0, high=1.0)


def block_budget(
    predictive_entropy_upper: float, num_blocks: int, previous: int | None, config: PruningConfig
) -> int:
    """How many blocks a sequence keeps this step, from the upper side of its predictive
    entropy estimate (conservative: an underestimate would prune harder)."""
    h = max(predictive_entropy_upper, config.entropy_floor)
    span = config.entropy_high - config.entropy_floor
    weight = min(1.0, (h - config.entropy_floor) / span)
    fraction = config.budget_low + (config.budget_high - config.budget_low) * weight
    budget = max(config.min_blocks, math.ceil(fraction * num_blocks))
    if previous is not None and config.max_shrink < 1:
        # At least one block per step, or a small budget rounds back to itself for good.
        shrink = 0 if config.max_shrink == 0 else max(1, math.floor(previous * config.max_shrink))
        budget = max(budget, previous - shrink)
    return min(budget, num_blocks)


def plan_budget(
    predictive_entropy_upper: float | None,
    context_len: int,
    previous: int | None,
    refresh: bool,
    config: PruningConfig,
    block_size: int,
) -> int:
    """The blocks a decoding sequence keeps this step: its whole context where it attends
    densely (no entropy measured yet, a context under ``min_context``, a mass refresh step),
    else its entropy's budget. A dense step counts as the previous budget, so the rate limit
    also holds where pruning starts."""
    in_context = -(-context_len // block_size)
    if predictive_entropy_upper is None or context_len < config.min_context or refresh:
        return in_context
    previous = in_context if previous is None else previous
    return block_budget(predictive_entropy_upper, in_context, previous, config)


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

    def __init__(self, config: PruningConfig | None = None, scale: float | None = None) -> None:
        """``scale``: attention's score scale, where the model's is not head_dim ** -0.5
        (Gemma's query_pre_attn_scalar): the head budgets and the bound-value scorer turn key
        bounds into attention logits with it."""
        self.config = config or PruningConfig()
        self.observes_mass = self.config.scorer == "mass"
        self.scale = scale

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
                )
            )
        return budgets

    def select(self, layer, query, blocks, summaries) -> Selection | None:
        if layer < self.config.dense_layers or blocks.budgets is None:
            return None
        bounds = key_bound_scores(query, summaries, blocks.block_tables)
        scores = self.block_scores(layer, query, blocks, summaries, bounds)
        budgets = None
        if self.config.head_budgets:
            logits = bounds * self._scale(query)
            budgets = self.head_budgets(self.head_mass(logits, scores, blocks), scores, blocks)
        return Selection(self.keep_best(scores, blocks, budgets), bounds)

    def block_scores(
        self,
        layer: int,
        query: torch.Tensor,
        blocks: DecodeBlocks,
        summaries: BlockSummaries,
        bounds: torch.Tensor,
    ) -> torch.Tensor:
        """What each block may contribute, [seqs, kv_heads, max_blocks]: higher is kept first."""
        if self.config.scorer == "mass":
            return summaries.mass[:, blocks.block_tables].permute(1, 0, 2)
        bound = bounds.amax(2)  # a block matters if it may matter to any head of the group
        if self.config.scorer == "bound-value":
            return value_weighted(bound * self._scale(query), summaries, blocks)
        return bound

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
        if self.config.scorer == "mass":
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


def best_of(scores: torch.Tensor, budgets: torch.Tensor, largest: int | None) -> torch.Tensor:
    """The mask of the ``budgets`` best of each row of ``scores`` [..., width] (``budgets``
    broadcast to [...]), ``largest`` the largest of them where the host knows it (None: it may
    be any width). Natively where the kernels run; else one top-k at the largest budget, each
    row keeping its own budget's worth of it (no host sync for the largest)."""
    mask = block_kernels.keep_largest(scores, budgets)
    if mask is not None:
        return mask
    top = scores.topk(min(largest or scores.shape[-1], scores.shape[-1]), dim=-1).indices
    taken = torch.arange(top.shape[-1], device=scores.device) < budgets[..., None]
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, taken.expand_as(top))


def signed_parts(query: torch.Tensor) -> torch.Tensor:
    """``[q+, q-]`` along the last axis: against ``[M, m]``, the per-channel key maxima and
    minima of a block, it gives ``sum_c max(q_c M_c, q_c m_c)``, the largest ``q.k`` there."""
    return torch.cat([query.clamp(min=0), query.clamp(max=0)], dim=-1)


def value_weighted(
    logits: torch.Tensor, summaries: BlockSummaries, blocks: DecodeBlocks
) -> torch.Tensor:
    """``log(bound mass) + log ||v_b - o||`` per row, KV head and block: ``logits`` [seqs,
    kv_heads, max_blocks] are the scaled key bounds; ``o`` is the output they predict."""
    tokens = blocks.block_tokens  # [seqs, max_blocks]
    sums = summaries.value_sums[:, blocks.block_tables].transpose(0, 1)  # [seqs, kv, b, dim]
    means = sums / tokens.clamp(min=1)[:, None, :, None]
    mass = logits + tokens.log()[:, None, :]  # a block's bound times its tokens, in logs
    output = (mass.softmax(-1)[..., None] * means).sum(-2, keepdim=True)
    return mass + torch.log((means - output).norm(dim=-1) + 1e-6)


def key_bound_scores(
    query: torch.Tensor, summaries: BlockSummaries, tables: torch.Tensor
) -> torch.Tensor:
    """Upper bounds of ``q.k`` over each block, per query head: [seqs, kv_heads, group, blocks].

    ``sum_c max(q_c M_c, q_c m_c) = [q+, q-] . [M, m]`` with ``q+``/``q-`` the positive and
    negative parts of the query. Each query row meets only its own sequence's blocks (padding
    included, so that the answer is a plain view): a sampled matmul on exactly those pairs reads
    the bounds in place, where gathering them first and a batched matmul cost 2-3x as much (two
    extra passes over the gathered copy, and a BLAS shape of three rows). Natively, where the
    kernels run, it is one pass over the blocks' bounds: a fifth of the time at 8K tokens.
    """
    native = block_kernels.key_bound_scores(query, summaries.key_bounds, tables)
    if native is not None:
        return native
    seqs, heads, dim = query.shape
    kv_heads, num_blocks = summaries.key_bounds.shape[:2]
    group, width = heads // kv_heads, tables.shape[1]
    # Column of (kv head, block) in the bounds viewed as [kv_heads * num_blocks, 2 * dim].
    cols = torch.arange(kv_heads, device=tables.device)[:, None] * num_blocks + tables[:, None]
    cols = cols[:, :, None].expand(seqs, kv_heads, group, width).reshape(-1).int()
    rows = seqs * heads
    crow = torch.arange(0, rows * width + 1, width, device=tables.device, dtype=torch.int32)
    structure = torch.sparse_csr_tensor(
        crow,
        cols,
        query.new_zeros(cols.numel()),
        (rows, kv_heads * num_blocks),
        check_invariants=False,
    )
    q = signed_parts(query).view(rows, 2 * dim)
    bounds = summaries.key_bounds.view(kv_heads * num_blocks, 2 * dim).to(query.dtype)
    scores = torch.sparse.sampled_addmm(structure, q, bounds.t(), beta=0.0).values()
    return scores.view(seqs, kv_heads, group, width)
