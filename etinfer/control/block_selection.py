"""Which KV-cache blocks each decoding sequence attends to (the paper's meso scale).

A selector sees one layer's decode queries and the paged layout of their contexts and answers
with a mask of kept blocks per sequence and KV head, or ``None`` for all of them. The attention
backend turns the answer into the set of cache slots it reads, so a selector that keeps fewer
blocks makes attention compute less, not just mask more.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from etinfer.control.registry import Registry


@dataclass
class DecodeBlocks:
    """The paged layout of the sequences decoding this step."""

    block_tables: torch.Tensor  # [num_seqs, max_blocks] block ids (padding past the end)
    context_lens: torch.Tensor  # [num_seqs] tokens in context, the current one included
    block_size: int


class BlockSelector(ABC):
    @abstractmethod
    def select(self, layer: int, query: torch.Tensor, blocks: DecodeBlocks) -> torch.Tensor | None:
        """Return a bool mask [num_seqs, num_kv_heads, max_blocks] of blocks to attend to,
        or None to attend to every block. ``query`` is [num_seqs, num_heads, head_dim]."""


BLOCK_SELECTORS: Registry[BlockSelector] = Registry("block selector")


@BLOCK_SELECTORS.register("dense")
class DenseSelector(BlockSelector):
    def select(self, layer: int, query: torch.Tensor, blocks: DecodeBlocks) -> None:
        return None
