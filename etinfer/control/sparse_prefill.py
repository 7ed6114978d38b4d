"""Attention-entropy sparse prefill (EntropyInfer, seed 003): which cached blocks each segment of
a long prompt reads while the prompt is prefilled in chunks.

**The estimate.** A prompt is cut into segments of ``segment_size`` positions. In every layer,
before a chunk's attention, each segment of the chunk estimates its attention over the blocks
before it, per KV head, from the block summaries the cache keeps: with ``q`` the segment's mean
query, ``sum_c max(q_c M_c, q_c m_c)`` bounds the segment's average score of every key of a
block whose per-channel key bounds are ``m <= k <= M`` (the mean is exact for the average score,
where the seed's per-segment query maximum and minimum only bracket it). A softmax over the
blocks, averaged over the query heads of a KV head, is the block-level attention; its entropy is
the head's *attention entropy* for the segment (not the predictive entropy of the record).

**The budgets** follow the seed's rule, made causal (chunked prefill cannot look at the segments
after the chunk, where the seed classifies heads over the whole prompt at once):

- a head whose attention entropy has stayed below ``entropy_threshold`` in every segment so far
  is *rigid* and reads ``base_budget`` tokens;
- a *dynamic* head's budget follows the relative change of its entropy,
  ``r = (H_s - H_prev) / H_prev`` clamped to ``[0, 1 + delta]``:
  ``B_s = clip(B_prev + alpha * B0 * (r - delta), B0, max_budget_factor * B0)``; its first
  estimated segment takes ``r = delta``, so its budget starts at ``B0``.

A budget counts every key a segment's queries read before their own local window: the sink,
the best-ranked blocks, and the window of ``window`` positions before the segment. The keys from
the window start up to each query are always read (causally), so a chunk's own tokens are
always in view. The last segment of the prompt (the one whose queries predict the first output
token) and every segment starting before ``min_context`` attend densely, as do the first
``dense_layers`` layers. The KV cache stays complete: sparse prefill saves compute, not memory.

**Sizes for an 8K context.** The seed's defaults are for 32K-128K contexts: 512-token segments,
dense below 4,096 tokens, ``B0`` = 2,048 (1.6-6 % of the context). Dividing by 16 (128K to 8K)
gives 32-token segments and ``B0`` = 128, too small on both counts here: a segment's mean query
over 32 tokens is noisy, and each segment's attention is its own kernel call, which at 32 rows
runs far below the speed of a CPU's attention kernel. So: 256-token segments (four to a default
1,024-token prefill chunk), dense below 1,024 tokens (the first chunk), and ``B0`` = 768
(about 1/10 of an 8K context; up to 2,304 tokens at ``3 B0``). Measured side by side at 7K and
8K tokens (BENCHMARKS.md): ``B0`` = 1,024 took 0.63-0.66x of dense's time to first token at
7K, 768 took 0.60x and 512 0.55x, every one keeping the passkeys dense finds; 768 is the
largest that reaches 0.6x there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from etinfer.control.block_scores import signed_parts
from etinfer.model.block_layout import (
    BlockSummaries,
    PrefillContext,
    PrefillPiece,
    PrefillSelector,
)
from etinfer.validation import check_float, check_int


@dataclass(frozen=True)
class SparsePrefillConfig:
    segment_size: int = 256  # positions; a multiple of the block size
    min_context: int = 1024  # segments starting before this position attend densely
    base_budget: int = 768  # B0, tokens read before a segment's window (sink and window in)
    max_budget_factor: float = 3.0  # a dynamic head's budget stays within [B0, factor * B0]
    entropy_threshold: float = 1e-5  # e_t, nats: below it in every segment, a head is rigid
    alpha: float = 0.5
    delta: float = 0.4
    sink: int = 16  # positions at the start always read; a multiple of the block size
    window: int = 256  # positions before a segment always read; a multiple of the block size
    dense_layers: int = 0  # the first layers attend densely

    def __post_init__(self) -> None:
        check_int("segment_size", self.segment_size, low=1)
        check_int("min_context", self.min_context, low=0)
        check_int("sink", self.sink, low=0)
        check_int("window", self.window, low=0)
        # The always-read keys fit in every budget, so a budget never cuts into them.
        check_int("base_budget", self.base_budget, low=max(1, self.sink + self.window))
        check_float("max_budget_factor", self.max_budget_factor, low=1.0)
        check_float("entropy_threshold", self.entropy_threshold, low=0.0)
        check_float("alpha", self.alpha, low=0.0)
        check_float("delta", self.delta, low=0.0)
        check_int("dense_layers", self.dense_layers, low=0)

    def check_block_size(self, block_size: int) -> None:
        """Segments, sink and window are whole blocks: the estimate ranks whole blocks."""
        for name in ("segment_size", "sink", "window"):
            value = getattr(self, name)
            if value % block_size:
                raise ValueError(
                    f"control.sparse_prefill.{name} must be a multiple of the block size "
                    f"{block_size}, got {value}"
                )


@dataclass(frozen=True)
class HeadBudgets:
    """One layer's budget state per KV head, carried from segment to segment."""

    entropy: torch.Tensor  # [kv_heads] the last segment's attention entropy (NaN: none yet)
    budget: torch.Tensor  # [kv_heads] the last segment's budget, tokens
    rigid: torch.Tensor  # [kv_heads] every segment so far below the entropy threshold

    @classmethod
    def initial(cls, kv_heads: int, config: SparsePrefillConfig) -> HeadBudgets:
        return cls(
            torch.full((kv_heads,), math.nan),
            torch.full((kv_heads,), float(config.base_budget)),
            torch.ones(kv_heads, dtype=torch.bool),
        )


def segment_budgets(
    entropy: torch.Tensor, state: HeadBudgets, config: SparsePrefillConfig
) -> tuple[torch.Tensor, HeadBudgets]:
    """The budgets (tokens) of consecutive segments, [segments, kv_heads], from their attention
    entropies, and the state after the last of them."""
    base, budgets = float(config.base_budget), []
    for h in entropy:  # one segment after another: each budget moves from the one before
        rigid = state.rigid & (h < config.entropy_threshold)
        ratio = (h - state.entropy) / state.entropy.clamp(min=1e-9)
        ratio = torch.where(state.entropy.isnan(), config.delta, ratio)
        ratio = ratio.clamp(0.0, 1.0 + config.delta)
        budget = state.budget + config.alpha * base * (ratio - config.delta)
        budget = budget.clamp(base, config.max_budget_factor * base)
        budget = torch.where(rigid, base, budget)
        state = HeadBudgets(h, budget, rigid)
        budgets.append(budget)
    return torch.stack(budgets), state


@dataclass
class AttentionProfile:
    """One sequence's prefill under sparse prefill: attention entropy and budget per segment,
    layer and KV head (NaN where not estimated, or where a segment attended densely), and the
    attention work done against dense attention's."""

    segment_size: int
    entropy: torch.Tensor  # [segments, layers, kv_heads] nats
    budgets: torch.Tensor  # [segments, layers, kv_heads] tokens read before the window
    states: list[HeadBudgets]  # per layer
    pairs_dense: int = 0  # (query head, key) pairs dense prefill attention computes
    pairs_computed: int = 0  # those sparse prefill computed
    next_position: int = 0  # where the sequence's next prefill chunk should start

    @property
    def rigid_heads(self) -> torch.Tensor:
        """[layers, kv_heads]: heads below the entropy threshold in every segment so far."""
        return torch.stack([s.rigid for s in self.states])

    @property
    def skipped_share(self) -> float:
        """The share of dense prefill's attention work that was skipped."""
        return 1.0 - self.pairs_computed / self.pairs_dense if self.pairs_dense else 0.0


def _pairs(start: int, end: int) -> int:
    """Keys a causal query reads, summed over positions [start, end): sum of (p + 1)."""
    return (end * (end + 1) - start * (start + 1)) // 2


class SparsePrefillSelector(PrefillSelector):
    def __init__(
        self,
        config: SparsePrefillConfig,
        *,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        max_model_len: int,
        scale: float | None = None,
    ) -> None:
        """``scale``: attention's score scale, where the model's is not head_dim ** -0.5."""
        config.check_block_size(block_size)
        self.config = config
        self.num_layers, self.num_heads, self.num_kv_heads = num_layers, num_heads, num_kv_heads
        self.scale = scale or head_dim**-0.5
        self.block_size = block_size
        self.num_segments = -(-max_model_len // config.segment_size)

    def begin(
        self, profile: AttentionProfile | None, start: int, end: int, num_tokens: int
    ) -> AttentionProfile | None:
        """The profile a sequence's chunk [start, end) carries: none for a prompt short enough
        to attend densely throughout, a fresh one where its prefill (re)starts anywhere but
        where the last chunk ended (a preemption's recompute, perhaps after a prefix-cache
        hit: the old profile is left to the outputs that hold it)."""
        if num_tokens <= self.config.min_context:
            return None
        if profile is None or start != profile.next_position:
            shape = (self.num_segments, self.num_layers, self.num_kv_heads)
            states = [
                HeadBudgets.initial(self.num_kv_heads, self.config) for _ in range(self.num_layers)
            ]
            nan = torch.full(shape, math.nan)
            profile = AttentionProfile(self.config.segment_size, nan, nan.clone(), states)
        profile.next_position = end
        return profile

    def select_prefill(
        self,
        layer: int,
        query: torch.Tensor,
        context: PrefillContext,
        summaries: BlockSummaries,
    ) -> list[PrefillPiece] | None:
        config, profile = self.config, context.profile
        pieces = self._pieces(context.position, query.shape[0])
        dense_pairs = sum(_pairs(p.start, p.end) for p in pieces)
        profile.pairs_dense += self.num_heads * dense_pairs
        estimated = [p for p in pieces if p.start >= config.segment_size]
        if not estimated:
            profile.pairs_computed += self.num_heads * dense_pairs
            return None
        probs, entropy = self._estimate(query, estimated, context, summaries)
        budgets = self._advance(profile, layer, estimated, entropy.cpu())
        final_segment = (context.num_tokens - 1) // config.segment_size * config.segment_size
        computed, sparse = 0, False
        for piece, piece_probs, budget in zip(estimated, probs, budgets, strict=True):
            if piece.start < config.min_context or piece.start >= final_segment:
                continue
            if layer < config.dense_layers:
                continue
            kept = self._keep(piece, piece_probs, budget)
            if kept is None:
                continue
            piece.kept, piece.local_start, sparse = kept, self._local_start(piece.start), True
            profile.budgets[piece.start // config.segment_size, layer] = torch.tensor(budget)
        group = self.num_heads // self.num_kv_heads
        for piece in pieces:
            start, end = piece.start, piece.end
            if piece.kept is None:
                computed += self.num_heads * _pairs(start, end)
                continue
            local = _pairs(start, end) - (end - start) * piece.local_start
            for kept in piece.kept:
                computed += group * (kept.numel() * self.block_size * (end - start) + local)
        profile.pairs_computed += computed
        return pieces if sparse else None

    def _advance(
        self,
        profile: AttentionProfile,
        layer: int,
        pieces: list[PrefillPiece],
        entropy: torch.Tensor,
    ) -> list[list[float]]:
        """Each piece's budget per KV head (host lists). The law advances once per segment, at
        the piece that starts it; a piece that continues a segment from the chunk before (a
        chunk need not start on a segment boundary) keeps that segment's budget."""
        size, state = self.config.segment_size, profile.states[layer]
        budgets = [state.budget] * len(pieces)
        starting = [i for i, p in enumerate(pieces) if p.start % size == 0]
        if starting:
            new, profile.states[layer] = segment_budgets(entropy[starting], state, self.config)
            for i, budget in zip(starting, new, strict=True):
                budgets[i] = budget
            profile.entropy[[pieces[i].start // size for i in starting], layer] = entropy[starting]
        return [b.tolist() for b in budgets]

    def _pieces(self, position: int, rows: int) -> list[PrefillPiece]:
        """The chunk cut at segment boundaries."""
        size, pieces, row = self.config.segment_size, [], 0
        while row < rows:
            start = position + row
            end = min(position + rows, (start // size + 1) * size)
            pieces.append(PrefillPiece(slice(row, row + end - start), start))
            row += end - start
        return pieces

    def _local_start(self, start: int) -> int:
        """Where a segment's always-read window begins: ``window`` positions back, on a block
        boundary."""
        bs = self.block_size
        return max(0, start - self.config.window) // bs * bs

    def _estimate(
        self,
        query: torch.Tensor,
        pieces: list[PrefillPiece],
        context: PrefillContext,
        summaries: BlockSummaries,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block-level attention [pieces, kv_heads, blocks] of each piece over the whole blocks
        before it, and its entropy [pieces, kv_heads]."""
        bs, kv_heads = self.block_size, self.num_kv_heads
        mean = torch.stack([query[p.rows].mean(0) for p in pieces])  # [pieces, heads, dim]
        visible = torch.tensor([p.start // bs for p in pieces])
        width = int(visible.max())
        bounds = summaries.key_bounds[:, context.block_table[:width]].to(mean.dtype)
        signed = signed_parts(mean).view(len(pieces), kv_heads, -1, 2 * mean.shape[-1])
        scores = torch.einsum("pkgc,kbc->pkgb", signed, bounds.flatten(2)) * self.scale
        hidden = torch.arange(width, device=query.device) >= visible[:, None].to(query.device)
        scores.masked_fill_(hidden[:, None, None, :], -torch.inf)
        probs = scores.softmax(-1).mean(2)
        return probs, torch.special.entr(probs).sum(-1)

    def _keep(
        self, piece: PrefillPiece, probs: torch.Tensor, budgets: list[float]
    ) -> list[torch.Tensor] | None:
        """Per KV head, the sink blocks and the best-ranked blocks before the window, in
        position order; None where every head's budget covers all of them."""
        config, bs = self.config, self.block_size
        sink, local = config.sink // bs, self._local_start(piece.start) // bs
        ranked = max(0, local - sink)
        counts = [min(ranked, int(b - config.sink - config.window) // bs) for b in budgets]
        if min(counts) >= ranked:
            return None
        top = probs[:, sink:local].topk(max(counts), dim=-1).indices + sink
        head_sink = torch.arange(sink, device=probs.device)
        return [
            torch.cat([head_sink, top[h, :count].sort().values]) for h, count in enumerate(counts)
        ]
