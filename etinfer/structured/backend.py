"""The interface a grammar library implements to constrain decoding.

A backend compiles a ``StructuredOutputsParams`` into an immutable grammar (shared by every
request that asks for the same one, across threads) and makes a matcher per request: the
matcher follows the tokens the request emits and writes which tokens may come next into one
row of a bitmask. The bitmask layout is the one xgrammar and llguidance share: int32 words,
bit ``j`` of word ``i`` set when token ``32 * i + j`` is allowed, so the sampler applies any
backend's masks the same way (``masks.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from etinfer.structured.params import StructuredOutputsParams


class Matcher(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False (and no change) when the grammar forbids it."""

    @abstractmethod
    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of ``bitmask``."""

    @classmethod
    def fill_masks(cls, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Rows ``rows`` of ``bitmask`` for ``matchers`` (all of this class): one call a step
        where the library has a batched one, which may spread the rows over threads."""
        for matcher, row in zip(matchers, rows, strict=True):
            matcher.fill_mask(bitmask, row)

    @abstractmethod
    def jump_forward(self) -> str:
        """The text the grammar allows as the only continuation from here ('' if none)."""

    @property
    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar has ended (a stop token was accepted)."""


class CompiledGrammar(ABC):
    @abstractmethod
    def matcher(self) -> Matcher:
        """A fresh matcher at the grammar's start."""


class GrammarBackend(ABC):
    name: str

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Compile ``params``; ValueError naming the problem when the backend cannot."""


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A bitmask for ``rows`` rows, every token allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


# Row b: the eight bits of byte value b, lowest first. Unpacking a bitmask byte by byte through
# this table (an embedding lookup) took 0.1 ms for 16 rows of a 49K vocabulary; shifting each
# word 32 ways took 1.6 ms.
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).float()


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bool mask [rows, vocab_size] a bitmask stands for (True: allowed). Bytes of an
    int32 word are little-endian on every host torch runs on: byte k holds tokens 8k..8k+7."""
    data = bitmask.contiguous().view(torch.uint8).long()
    bits = torch.nn.functional.embedding(data, _BYTE_BITS.to(bitmask.device))
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size] > 0
