"""What a native decode step holds for single tokens chosen inside it (``native/decoder.c``'s
``Step``): a selector of single tokens (``TokenChoice``) ranks each layer's context by the key
copy under that layer's query, so the C chooses them between the layer's cache write and its
attention, with the kernels the layer-by-layer path calls (``native/key_sketch.c``,
``native/token_choice.c``). The step's count of entries is the same at every layer (each row
keeps its budget, or its whole context), so the pattern's buffers are sized once a step."""

from __future__ import annotations

import torch

from etinfer.model import native_kernels
from etinfer.model.attention.metadata import AttentionMetadata
from etinfer.model.block_layout import TokenChoice


class TokenStep:
    """The step's fields for single tokens (``fields``, in ``Step``'s order) and the tensors they
    point into, held until the call returns: the rows' tables, contexts and budgets in tokens,
    the pattern's buffers, the projected queries, and each layer's share of every block kept,
    ``kept`` [layers of the call, rows, kv_heads, width] (one scratch for all of them where no
    telemetry reads it)."""

    # The fields of a step that chooses no tokens.
    NONE = (None,) * 3 + (0,) * 3 + (None,) * 3 + (0,) * 2 + (None,) * 2 + (0,)

    def __init__(
        self, choice: TokenChoice, shape, meta: AttentionMetadata, num_layers: int
    ) -> None:
        blocks, size, heads = meta.decode_blocks, shape.block_size, shape.heads
        assert blocks is not None and blocks.budgets is not None
        native = native_kernels.library()
        assert native is not None
        sink, recent = choice.forced_tokens(size)
        self.tables = blocks.block_tables.to(torch.int64).contiguous()
        self.lens = blocks.context_lens.to(torch.int64).contiguous()
        self.budgets = (blocks.budgets * size).to(torch.int64).contiguous()
        rows, width = self.tables.shape
        self.crow = torch.empty(rows * heads + 1, dtype=torch.int32)
        self.nnz = native.token_offsets(
            self.lens.data_ptr(), self.budgets.data_ptr(), rows, heads, width * size, sink,
            recent, self.crow.data_ptr(),
        )  # fmt: skip
        if self.nnz < 0:
            raise ValueError(f"single tokens: more pattern entries than int32 holds ({rows} rows)")
        self.cols = torch.empty(self.nnz, dtype=torch.int32)
        self.outside = torch.zeros(self.nnz, dtype=torch.uint8)
        observed = meta.telemetry is not None
        self.kept = torch.empty(num_layers if observed else 1, rows, shape.kv_heads, width)
        self.projected = torch.empty(rows * heads * shape.sketch_rank)
        self.fields = (
            *(t.data_ptr() for t in (self.tables, self.lens, self.budgets)), width, sink, recent,
            *(t.data_ptr() for t in (self.crow, self.cols, self.outside)), self.nnz,
            native_kernels.attention_threads(self.nnz), self.kept.data_ptr(),
            self.projected.data_ptr(), self.kept[0].numel() if observed else 0,
        )  # fmt: skip

    @classmethod
    def of(
        cls, choice: TokenChoice | None, shape, meta: AttentionMetadata, num_layers: int
    ) -> TokenStep | None:
        """Where ``choice`` chooses this step (None: every row reads its whole context)."""
        blocks = meta.decode_blocks
        if choice is None or blocks is None or blocks.budgets is None:
            return None
        return cls(choice, shape, meta, num_layers)
