"""Block scores the selectors rank by, each a few tensor operations over a layer's block
summaries, and the top-k that turns scores into kept blocks (natively where the kernels run)."""

from __future__ import annotations

import torch

from etinfer.model import block_kernels
from etinfer.model.block_layout import BlockSummaries, DecodeBlocks


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


def key_digest_scores(
    query: torch.Tensor, summaries: BlockSummaries, blocks: DecodeBlocks, spread: float
) -> torch.Tensor:
    """Each block's ``q.mu + spread * ||q * sigma||`` per query head, [seqs, kv_heads, group,
    blocks]: ``mu`` and ``sigma`` are the per-channel mean and spread of its keys, from the sums
    the cache keeps. Where the channels are uncorrelated, a query's scores over the block have
    that mean and spread, so this estimates its largest score with one outlier key weighing as
    one key, where min/max bounds give the whole block its reach in every channel at once."""
    tables, tokens = blocks.block_tables, blocks.block_tokens
    moments = summaries.key_moments
    native = block_kernels.key_digest_scores(query, moments, tables, tokens, spread)
    if native is not None:
        return native
    seqs, _, dim = query.shape
    kv_heads = moments.shape[0]
    means, mean_squares = (moments[:, tables] / tokens.clamp(min=1)[..., None, None]).unbind(-2)
    variance = (mean_squares - means.square()).clamp(min=0.0)  # [kv_heads, seqs, width, dim]
    q = query.view(seqs, kv_heads, -1, dim).transpose(0, 1)
    centre = torch.einsum("ksgd,kswd->ksgw", q, means)
    reach = torch.einsum("ksgd,kswd->ksgw", q.square(), variance).sqrt()
    return (centre + spread * reach).transpose(0, 1)
