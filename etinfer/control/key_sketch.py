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
from etinfer.model.attention.pattern import DecodePattern
from etinfer.model.block_layout import DecodeBlocks
from etinfer.model.key_copy import code_rows

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
    codes: torch.Tensor,  # the layer's key copy, int8 (``model/key_copy.py``)
    code_scales: torch.Tensor,  # [kv_heads, slots] float32
    blocks: DecodeBlocks,
    scale: float,
) -> torch.Tensor:
    """Each block's share of the softmax mass under the copy's scores, in logs, per query head:
    [seqs, kv_heads, group, max_blocks], -inf past the context. Natively where the kernels run
    (one pass over the copy, no gathered tensors); else in torch."""
    projected = project(query, query_map)
    tables, lens, size = blocks.block_tables, blocks.context_lens, blocks.block_size
    native = block_kernels.sketch_block_scores(
        projected, codes, code_scales, tables, lens, size, scale
    )
    if native is not None:
        return native
    log_mass = torch_token_log_mass(projected, codes, code_scales, blocks, scale)
    width = tables.shape[1]
    return log_mass.unflatten(-1, (width, size)).logsumexp(-1)


def project(query: torch.Tensor, query_map: torch.Tensor) -> torch.Tensor:
    """[seqs, kv_heads, group, rank]: each query head's query on its KV head's directions."""
    native = block_kernels.project_queries(query, query_map)
    if native is not None:
        return native
    seqs, heads, dim = query.shape
    kv_heads = query_map.shape[0]
    grouped = query.view(seqs, kv_heads, heads // kv_heads, dim)
    return torch.einsum("skgd,kdr->skgr", grouped, query_map).contiguous()


def quantize_queries(projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each projected query in 16 bits, as the kernels score with it: its values over its
    largest magnitude / 32767, rounded to nearest even (integers, in the input's type), and that
    scale [..., ] float32."""
    scale = projected.abs().amax(-1) / 32767.0
    divisor = torch.where(scale > 0, scale, 1.0)
    return torch.round(projected / divisor[..., None]), scale


def torch_token_log_mass(
    projected: torch.Tensor,
    codes: torch.Tensor,
    code_scales: torch.Tensor,
    blocks: DecodeBlocks,
    scale: float,
) -> torch.Tensor:
    """The torch form of the kernels' first pass: each slot of each row's blocks, its share of
    the mass under the copy's scores, in logs, per query head: [seqs, kv_heads, group, max_blocks
    * block_size], -inf past the context. The dot products of 16-bit queries and 8-bit codes are
    integers, exact in float64, so each logit is the kernel's up to its last rounding."""
    tables, lens, size = blocks.block_tables, blocks.context_lens, blocks.block_size
    slots = (tables[:, :, None] * size + torch.arange(size, device=tables.device)).flatten(1)
    rows = code_rows(codes, projected.shape[-1])[:, slots]  # [kv, seqs, tokens, rank]
    queries, query_scale = quantize_queries(projected)
    dots = torch.einsum("skgr,kstr->skgt", queries.double(), rows.double()).float()
    unit = code_scales[:, slots].transpose(0, 1)[:, :, None]  # [seqs, kv, 1, tokens]
    logits = dots * (unit * (query_scale * scale)[..., None])
    inside = torch.arange(slots.shape[1], device=tables.device) < lens[:, None]
    logits = logits.masked_fill(~inside[:, None, None], -torch.inf)
    return logits - logits.logsumexp(-1, keepdim=True)


def sketch_token_pattern(
    query: torch.Tensor,  # [seqs, heads, head_dim] float32
    query_map: torch.Tensor,  # [kv_heads, head_dim, rank]
    codes: torch.Tensor,  # the layer's key copy, int8 (``model/key_copy.py``)
    code_scales: torch.Tensor,  # [kv_heads, slots] float32
    blocks: DecodeBlocks,
    scale: float,
    budgets: torch.Tensor,  # [seqs] tokens each sequence keeps (its forced ones included)
    sink: int,  # the first tokens, always kept
    recent: int,  # the last tokens (the current one among them), always kept
) -> tuple[DecodePattern, torch.Tensor]:
    """The cache rows each decode row reads when single tokens are kept: each sequence's sink
    and recent tokens and, per KV head, its best others by the most mass any query head of the
    group gives them under the copy's scores, ``budgets`` in all (at least the forced ones, at
    most the context). Returns the pattern (each row's tokens in order) and the share of each
    block's tokens in context kept, [seqs, kv_heads, max_blocks] (pruning's telemetry)."""
    seqs, heads, _ = query.shape
    kv_heads, num_slots = code_scales.shape
    group = heads // kv_heads
    projected = project(query, query_map)
    tables, lens, size = blocks.block_tables, blocks.context_lens, blocks.block_size
    native = block_kernels.sketch_token_pattern(
        projected, codes, code_scales, tables, lens, size, scale, budgets, sink, recent
    )
    if native is not None:
        crow, cols, kept = native
        return DecodePattern(crow, cols, torch.zeros_like(cols, dtype=torch.uint8)), kept
    log_mass = torch_token_log_mass(projected, codes, code_scales, blocks, scale)
    positions = torch.arange(log_mass.shape[-1], device=tables.device)
    inside = positions < lens[:, None]
    forced = inside & ((positions < sink) | (positions >= lens[:, None] - recent))
    score = log_mass.amax(2).masked_fill(forced[:, None], torch.inf)
    score.masked_fill_(~inside[:, None], -torch.inf)
    counts = budgets.maximum(forced.sum(-1)).minimum(lens)  # [seqs]
    top = score.topk(int(counts.max()), dim=-1).indices  # [seqs, kv_heads, largest]
    taken = torch.arange(top.shape[-1], device=top.device) < counts[:, None, None]
    keep = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, top, taken.expand_as(top))
    # Rows (sequence, KV head, query head) in order, each reading its KV head's tokens in order.
    seq, head, _, position = keep[:, :, None].expand(-1, -1, group, -1).nonzero(as_tuple=True)
    slots = tables[seq, position // size] * size + position % size
    cols = (head * num_slots + slots).int()
    crow = torch.zeros(seqs * heads + 1, dtype=torch.int32, device=tables.device)
    torch.cumsum(counts.repeat_interleave(heads), 0, out=crow[1:])
    width = tables.shape[1]
    kept = keep.view(seqs, kv_heads, width, size).sum(-1) / blocks.block_tokens[:, None].clamp(
        min=1
    )
    return DecodePattern(crow, cols, torch.zeros_like(cols, dtype=torch.uint8)), kept
