"""What decode attention knows of the paged cache in a step, and the hook that narrows it.

Attention calls an :class:`AttentionSelector` once per layer with that layer's decode queries
and the step's paged layout; the answer is a mask of the blocks to read, or the pattern of
single tokens (:class:`DecodePattern`, the cache rows each decode row reads). The model defines
the hook it calls; the control layer (``etinfer.control.block_selection``) implements it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import cached_property

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
    # What a selector derives from the layout alone, once a step for all its layers (keyed by the
    # selector): at batch 1 a layer's selection is a few dozen small operations, each a few
    # microseconds, and the layout does not change within the step.
    derived: dict[tuple, object] = field(default_factory=dict, repr=False)

    # Derived once a step (the layout does not change within it), though every layer reads them.
    @cached_property
    def block_tokens(self) -> torch.Tensor:
        """[num_seqs, max_blocks]: tokens of context in each table entry (0 in padding)."""
        width = self.block_tables.shape[1]
        offsets = torch.arange(width, device=self.context_lens.device) * self.block_size
        return (self.context_lens[:, None] - offsets).clamp(0, self.block_size)

    @cached_property
    def present(self) -> torch.Tensor:
        """[num_seqs, max_blocks]: the table entries that hold context."""
        return self.block_tokens > 0


@dataclass
class DecodePattern:
    """Which cache rows each decode query row (sequence, head) reads, as a CSR pattern.

    Every kept block is read whole; ``outside`` flags the entries outside the context (past the
    current token in the last block, before the window in the first), whose scores are set to
    -inf. They are few (under two blocks' worth per row), and reading them costs less than
    making every row's length exact: that needs a compaction over all entries.
    """

    crow: torch.Tensor  # [rows + 1] int32
    cols: torch.Tensor  # [nnz] int32 cache rows: kv_head * num_slots + slot
    outside: torch.Tensor  # [nnz] uint8, 1 at the entries outside the context

    # Built when first asked for (the torch path and the mass scorer ask): the native kernel
    # needs none, and a prefill chunk's pattern has tens of millions of entries.
    @cached_property
    def masked(self) -> torch.Tensor:
        """[few] the entries outside the context, as indices (the torch path's form)."""
        return self.outside.nonzero().flatten()

    @cached_property
    def row_ids(self) -> torch.Tensor:
        """[nnz] the row of each entry, to subtract its row's max."""
        rows = torch.arange(self.crow.numel() - 1, device=self.crow.device)
        return rows.repeat_interleave(self.crow.diff(), output_size=self.nnz)

    @cached_property
    def zeros(self) -> torch.Tensor:
        """[nnz] placeholder values; sampled_addmm needs some."""
        return torch.zeros(self.nnz, device=self.cols.device)

    @property
    def nnz(self) -> int:
        return self.cols.numel()


@dataclass
class BlockSummaries:
    """What a layer's cache keeps per block for scoring, indexed by block id."""

    # [kv_heads, num_blocks, 2, head_dim]: per channel the largest and the smallest key. Kept
    # together so that one gather and one matmul score every block.
    key_bounds: torch.Tensor
    mass: torch.Tensor | None = None  # [kv_heads, num_blocks], last observed attention mass
    value_sums: torch.Tensor | None = None  # [kv_heads, num_blocks, head_dim]
    # [kv_heads, num_blocks, 2, head_dim] float32: the sums of the keys and of their squares,
    # per channel (the digest scorer's mean and spread)
    key_moments: torch.Tensor | None = None
    # [layers, kv_heads, num_blocks]: every layer's last observed mass, so that a selector may
    # read a later layer's from the step before (it has not run yet in this one)
    layer_masses: torch.Tensor | None = None
    # Every key's low-rank copy, int8 by block and pairs of directions (``key_copy.py``), and
    # its scale per key [kv_heads, slots] float32 (``control/key_sketch.py``)
    key_sketch: torch.Tensor | None = None
    sketch_scales: torch.Tensor | None = None


@dataclass
class Selection:
    """A selector's answer for one layer: blocks, or single tokens."""

    # [seqs, kv_heads, max_blocks] blocks to attend to; for single tokens, the share of each
    # block's tokens in context kept (float)
    mask: torch.Tensor
    # [seqs, kv_heads, group, max_blocks] upper bounds of q.k per block and query head, when the
    # selector computed them (attention turns them into a dropped-mass certificate)
    bounds: torch.Tensor | None = None
    # The cache rows each decode row reads, where the selector chose single tokens (then
    # attention reads exactly these, and ``mask`` is what pruning's telemetry counts)
    tokens: DecodePattern | None = None


@dataclass(frozen=True, eq=False)  # compared by identity: it holds tensors
class TokenChoice:
    """How a selector of single tokens chooses them at each layer (``Selection.tokens``), for the
    native decoder to make the same choice inside its layer loop (``native/decoder.c``): the
    layers from ``dense_layers`` on that see the whole context keep, per KV head, the sink's and
    the recent tokens and the best others by the key copy's scores under the layer's map."""

    query_maps: torch.Tensor  # [layers, kv_heads, head_dim, rank] float32
    dense_layers: int  # the layers below it read everything
    sink_blocks: int
    recent_blocks: int

    def forced_tokens(self, block_size: int) -> tuple[int, int]:
        """The sink's tokens and the recent ones (at least the current token), always kept."""
        return self.sink_blocks * block_size, max(1, self.recent_blocks * block_size)


class AttentionSelector(ABC):
    """The per-layer hook: which blocks each decoding sequence's attention reads."""

    needs_summaries = False  # the cache keeps key bounds and masses per block for it
    needs_moments = False  # ...and the sums of each block's keys and of their squares
    observes_mass = False  # attention records each attended block's mass for it
    # It never narrows attention (a decode step may then be a captured CUDA graph).
    reads_everything = False
    # Its answer at a layer does not read that layer's query (``select`` is then asked with
    # None): a pruned step may run in native calls, one per run of layers reading the same
    # blocks (``PrunedDecode.segments``).
    selects_without_query = False
    # It answers with single tokens (``Selection.tokens``): attention must run on patterns.
    selects_tokens = False
    # How it chooses them, where the native decoder can choose the same inside its step.
    token_choice: TokenChoice | None = None
    # [layers, kv_heads, head_dim, rank]: the cache keeps every key's low-rank copy by these
    # maps for it (``BlockSummaries.key_sketch``), or None
    sketch_key_maps: torch.Tensor | None = None

    def observes(self, layer: int) -> bool:
        """Whether attention records the blocks' mass at ``layer`` (``observes_mass`` layers)."""
        return self.observes_mass

    def reads_all_of(self, blocks: DecodeBlocks | None) -> bool:
        """Whether no layer narrows this step's attention (then a decode step may run in one
        native call, its summaries and masses kept after it)."""
        return self.reads_everything

    @abstractmethod
    def select(
        self,
        layer: int,
        query: torch.Tensor | None,
        blocks: DecodeBlocks,
        summaries: BlockSummaries | None,
    ) -> Selection | None:
        """The blocks to attend to, or None for all of them. ``query`` is [num_seqs,
        num_heads, head_dim] (None for a selector that ``selects_without_query``); the mask is
        [num_seqs, num_kv_heads, max_blocks]."""
        ...


@dataclass
class PrefillContext:
    """One sequence's prefill chunk as a prefill selector sees it."""

    position: int  # of the chunk's first token
    num_tokens: int  # the sequence's known tokens (the prompt, or all of it when recomputing)
    block_table: torch.Tensor  # [blocks] the sequence's block ids
    profile: object  # the selector's per-sequence state, carried from chunk to chunk


@dataclass
class PrefillPiece:
    """A run of the chunk's query rows that shares one choice of keys."""

    rows: slice  # of the chunk
    start: int  # position of the first row
    # None: dense (every earlier key). Else the keys read are, per KV head, the blocks ``kept``
    # (indices into the block table, ascending, all before ``local_start``) and then every
    # position from ``local_start`` up to the query itself.
    kept: list[torch.Tensor] | None = None
    local_start: int = 0

    @property
    def end(self) -> int:
        """Position after the piece's last row."""
        return self.start + self.rows.stop - self.rows.start


class PrefillSelector(ABC):
    """The per-layer hook of sparse prefill: which cached keys each part of a chunk reads."""

    @abstractmethod
    def begin(self, profile: object, start: int, end: int, num_tokens: int) -> object | None:
        """The per-sequence state (``PrefillContext.profile``) a chunk of positions [start,
        end) carries, from the sequence's last one; None: the chunk attends densely."""
        ...

    @abstractmethod
    def select_prefill(
        self,
        layer: int,
        query: torch.Tensor,
        context: PrefillContext,
        summaries: BlockSummaries,
    ) -> list[PrefillPiece] | None:
        """``query`` is the chunk's [rows, num_heads, head_dim]; None: the chunk attends
        densely."""
        ...
