"""A low-rank copy of every key, and the block scores a query reads from it.

Blocks ranked by summaries (key bounds, digests) miss what dense attention finds: a block's
bounds cannot tell the needle from filler that looks like it. Ranking by each token's own score
can, and a cache can afford to keep every key a second time in a few bytes: projected on
``rank`` directions and stored in 8 bits with a scale per key, 16 directions are 1/16 of the key
and value bytes of a 16-bit cache at a head size of 64. A query projected on the matching
directions scores every token against the copy; a block's score is the softmax mass its tokens
carry under those approximate scores, the most any query head of its group gives it.

The directions are query-aware (after Loki, which keeps the keys' own principal directions):
in the coordinates where the queries are white (``A = Cq^(1/2)``, so ``q.k = (A^-1 q).(A k)``),
the leading principal directions ``U`` of the mapped keys; the key copy is ``U^T A k`` and the
query's ``U^T A^-1 q``. Keys' own directions serve SmolLM2 as well but miss Gemma 3's global
layers, whose keys are normed per head and spread over many directions the queries weigh
little (BENCHMARKS.md, "Tokens, not blocks"). The maps are fitted once per model on the shipped
corpus (``etinfer.calibrate``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from etinfer.model import block_kernels
from etinfer.model.block_layout import DecodeBlocks

# The calibration queries' covariance is lifted by this share of its mean eigenvalue before its
# square root is inverted: a few hundred queries leave some of a 256-wide head's directions
# unseen.
RIDGE = 1e-2


@dataclass(frozen=True)
class SketchMaps:
    """Per layer and KV head, the maps of keys and queries to the copy's directions."""

    key_maps: torch.Tensor  # [layers, kv_heads, head_dim, rank] float32
    query_maps: torch.Tensor  # [layers, kv_heads, head_dim, rank] float32

    @property
    def rank(self) -> int:
        return self.key_maps.shape[-1]

    def save(self, path) -> None:
        torch.save({"key_maps": self.key_maps, "query_maps": self.query_maps}, path)

    @classmethod
    def load(cls, path) -> SketchMaps:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        return cls(saved["key_maps"].float(), saved["query_maps"].float())


def gram(x: torch.Tensor) -> torch.Tensor:
    """``x^T x`` per head, in float64: [heads, dim, dim] of ``x`` [heads, n, dim], what the maps
    are fitted from (summed over any number of passages)."""
    x = x.double()
    return x.transpose(1, 2) @ x


def fit_maps(
    query_gram: torch.Tensor, key_gram: torch.Tensor, rank: int, whitened: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(key map, query map), [kv_heads, head_dim, rank] each, from the ``gram`` of the queries
    and of the keys [kv_heads, head_dim, head_dim] one layer met; query-aware unless
    ``whitened`` is False (then both are the keys' leading principal directions)."""
    if not whitened:
        basis = torch.linalg.eigh(key_gram).eigenvectors[:, :, -rank:].float()
        return basis, basis
    values, vectors = torch.linalg.eigh(
        query_gram / query_gram.diagonal(0, 1, 2).sum(-1)[:, None, None]
    )
    values = values.clamp(min=0)
    lifted = values + RIDGE * values.mean(-1, keepdim=True)
    root = vectors @ torch.diag_embed(lifted.sqrt()) @ vectors.transpose(1, 2)
    inverse_root = vectors @ torch.diag_embed(lifted.rsqrt()) @ vectors.transpose(1, 2)
    # The keys where the queries are white (root is symmetric): their principal directions.
    top = torch.linalg.eigh(root @ key_gram @ root).eigenvectors[:, :, -rank:]
    return (root @ top).float(), (inverse_root @ top).float()


def sketch_block_scores(
    query: torch.Tensor,  # [seqs, heads, head_dim] float32
    query_map: torch.Tensor,  # [kv_heads, head_dim, rank]
    codes: torch.Tensor,  # [kv_heads, slots, rank] int8: the layer's key copy
    code_scales: torch.Tensor,  # [kv_heads, slots] float32
    blocks: DecodeBlocks,
    scale: float,
) -> torch.Tensor:
    """Each block's share of the softmax mass under the copy's scores, in logs, per query head:
    [seqs, kv_heads, group, max_blocks], -inf past the context. Natively where the kernels run
    (one pass over the copy, no gathered tensors); else in torch."""
    seqs, heads, dim = query.shape
    kv_heads = query_map.shape[0]
    projected = torch.einsum(
        "skgd,kdr->skgr", query.view(seqs, kv_heads, heads // kv_heads, dim), query_map
    ).contiguous()
    tables, lens, size = blocks.block_tables, blocks.context_lens, blocks.block_size
    native = block_kernels.sketch_block_scores(
        projected, codes, code_scales, tables, lens, size, scale
    )
    if native is not None:
        return native
    slots = (tables[:, :, None] * size + torch.arange(size, device=tables.device)).flatten(1)
    copy = codes[:, slots].float() * code_scales[:, slots, None]  # [kv, seqs, tokens, rank]
    logits = torch.einsum("skgr,kstr->skgt", projected, copy) * scale
    inside = torch.arange(slots.shape[1], device=tables.device) < lens[:, None]
    logits = logits.masked_fill(~inside[:, None, None], -torch.inf)
    width = tables.shape[1]
    per_block = logits.unflatten(-1, (width, size)).logsumexp(-1)
    return per_block - logits.logsumexp(-1, keepdim=True)
