"""A pruned decode step's kept blocks in fixed shapes: what a step replayed from a CUDA graph
needs, where nothing may depend on values the host has not seen.

The eager path turns a selector's mask into a CSR pattern whose size is the number of blocks
kept (``decode_pattern``): a shape only known once the mask is, so it cannot be captured. Here
the same mask becomes, per row and KV head, a compacted block table as wide as the padded table
(the kept block ids first, in table order), the tokens each entry holds and the count kept,
all written by fixed-shape operations: a stable sort, gathers and masks. The budgets behind the
mask are a device tensor the step's inputs carry (``DecodeBlocks.budgets`` with
``max_budget = 0``: the selectors then take every top-k at the table's width and keep each
row's own budget of it), so a changed budget needs no new capture. ``attend_kept`` is attention
over such a table in torch operations, the reference a graph's paged kernel is checked against;
on the CPU it equals the eager pattern's attention (tests/model/test_kept_blocks.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KeptBlocks:
    tables: torch.Tensor  # [rows, kv_heads, width] kept block ids first (table order), then 0
    tokens: torch.Tensor  # [rows, kv_heads, width] tokens of context per entry; 0 past the kept
    counts: torch.Tensor  # [rows, kv_heads] blocks kept


def kept_blocks(
    mask: torch.Tensor,  # [rows, kv_heads, width] bool: a selector's kept blocks
    block_tables: torch.Tensor,  # [rows, width]
    block_tokens: torch.Tensor,  # [rows, width] tokens of context per table entry
) -> KeptBlocks:
    """The mask's blocks as compacted tables, with the current token's block (the last that
    holds context) always among them, as the eager pattern adds it."""
    width = block_tables.shape[1]
    positions = torch.arange(width, device=mask.device)
    present = block_tokens > 0
    current = positions == present.sum(-1, keepdim=True) - 1
    keep = (mask | current[:, None]) & present[:, None]
    # Kept entries first, each group in table order (a stable sort of 0 = kept, 1 = dropped).
    order = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices
    counts = keep.sum(-1)
    past = positions >= counts[..., None]
    tables = block_tables[:, None].expand_as(keep).gather(-1, order).masked_fill(past, 0)
    tokens = block_tokens[:, None].expand_as(keep).gather(-1, order).masked_fill(past, 0)
    return KeptBlocks(tables, tokens, counts)


def attend_kept(
    q: torch.Tensor,  # [rows, kv_heads * group, dim]
    keys: torch.Tensor,  # [kv_heads, slots, dim] one layer's cache (slot = block * size + i)
    values: torch.Tensor,  # [kv_heads, slots, dim]
    kept: KeptBlocks,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Each query row's attention over its KV head's kept blocks, [rows, heads, dim]: every
    entry of the compacted table read, those past a block's tokens or the count masked."""
    rows, kv_heads = kept.tables.shape[:2]
    dim = q.shape[-1]
    offsets = torch.arange(block_size, device=q.device)
    slots = (kept.tables[..., None] * block_size + offsets).flatten(2)  # [rows, kv, width*size]
    valid = (offsets < kept.tokens[..., None]).flatten(2)
    heads = torch.arange(kv_heads, device=q.device)[None, :, None]
    k, v = keys[heads, slots], values[heads, slots]  # [rows, kv, width*size, dim]
    grouped = q.view(rows, kv_heads, -1, dim)
    scores = (grouped @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~valid[:, :, None], -torch.inf)
    return (scores.softmax(-1) @ v).view(rows, -1, dim)
