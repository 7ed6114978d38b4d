"""How the cache stores the low-rank copy of its keys (``control/key_sketch.py``): by block and
pairs of directions, ``[..., kv_heads, blocks, ceil(rank / 2), block_size, 2]`` int8, each
token's two codes of a pair side by side. Eight tokens' codes of a pair then lie in 16 bytes, one
vector of 16-bit integers for one multiply-add of pairs against a query's (``native/key_sketch.c``);
a token-major copy needed a sum across the lanes for every token and query head, which was most
of its first pass."""

from __future__ import annotations

import torch


def copy_shape(kv_heads: int, num_blocks: int, block_size: int, rank: int) -> tuple[int, ...]:
    """The shape of one layer's copy."""
    return (kv_heads, num_blocks, (rank + 1) // 2, block_size, 2)


def write_codes(copy: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor) -> None:
    """``codes`` [..., kv_heads, len(slots), rank] into ``copy`` (the layout above) at ``slots``
    (a zero past an odd rank)."""
    pairs, size = copy.shape[-3:-1]
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    # Advanced indices split by a slice put the slots' dimension first.
    blocks, offsets = slots // size, slots % size
    rows = codes.unflatten(-1, (pairs, 2)).movedim(-3, 0)  # [n, ..., kv_heads, pairs, 2]
    copy[..., blocks, :, offsets, :] = rows


def code_rows(copy: torch.Tensor, rank: int) -> torch.Tensor:
    """``copy`` as rows by slot, [..., kv_heads, slots, rank] (a copy of the tensor)."""
    *lead, kv_heads, blocks, pairs, size, _ = copy.shape
    rows = copy.transpose(-3, -2).reshape(*lead, kv_heads, blocks * size, pairs * 2)
    return rows[..., :rank]


def from_rows(rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """The copy holding ``rows`` [..., kv_heads, slots, rank] by slot (the inverse of
    ``code_rows``)."""
    *lead, kv_heads, slots, rank = rows.shape
    layout = copy_shape(kv_heads, slots // block_size, block_size, rank)
    copy = torch.zeros((*lead, *layout), dtype=rows.dtype, device=rows.device)
    write_codes(copy, torch.arange(slots, device=rows.device), rows)
    return copy
