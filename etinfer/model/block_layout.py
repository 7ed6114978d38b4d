"""What decode attention knows of the paged cache in a step, and the hook that narrows it.

Attention calls an :class:`AttentionSelector` once per layer with that layer's decode queries
and the step's paged layout; the answer is a mask of the blocks to read. The model defines the
hook it calls; the control layer (``etinfer.control.block_selection``) implements it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class DecodeBlocks:
    """The paged layout of the sequences decoding this step."""

    block_tables: torch.Tensor  # [num_seqs, max_blocks] block ids (padding past the end)
    context_lens: torch.Tensor  # [num_seqs] tokens in context, the current one included
    block_size: int
    # [num_seqs] blocks each sequence keeps this step (its whole context where it attends
    # densely), or None when every sequence attends densely; and the largest budget, known on
    # the host so that a selector's top-k needs no device sync.
    budgets: torch.Tensor | None = None
    max_budget: int = 0


@dataclass
class BlockSummaries:
    """What a layer's cache keeps per block for scoring, indexed by block id."""

    # [kv_heads, num_blocks, 2, head_dim]: per channel the largest and the smallest key. Kept
    # together so that one gather and one matmul score every block.
    key_bounds: torch.Tensor
    mass: torch.Tensor | None = None  # [kv_heads, num_blocks], last observed attention mass


@dataclass
class Selection:
    """A selector's answer for one layer."""

    mask: torch.Tensor  # [seqs, kv_heads, max_blocks] blocks to attend to
    # [seqs, kv_heads, group, max_blocks] upper bounds of q.k per block and query head, when the
    # selector computed them (attention turns them into a dropped-mass certificate)
    bounds: torch.Tensor | None = None


class AttentionSelector(ABC):
    """The per-layer hook: which blocks each decoding sequence's attention reads."""

    needs_summaries = False  # the cache keeps key bounds and masses per block for it
    observes_mass = False  # attention records each attended block's mass for it

    @abstractmethod
    def select(
        self,
        layer: int,
        query: torch.Tensor,
        blocks: DecodeBlocks,
        summaries: BlockSummaries | None,
    ) -> Selection | None:
        """The blocks to attend to, or None for all of them. ``query`` is [num_seqs,
        num_heads, head_dim]; the mask is [num_seqs, num_kv_heads, max_blocks]."""
        ...
