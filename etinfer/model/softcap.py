"""Gemma 2's soft caps: attention scores and final logits as ``cap * tanh(x / cap)``.

Scaled-dot-product attention takes no soft cap, so attention over a capped model's prefill runs
as its plain formula here (as transformers' eager attention does): scores, cap, mask, softmax,
values. Decode reads its rows through a pattern, where the cap is one more operation on the
pattern's scores (``attention/torch_backend.py``'s ``pattern_attention``).
"""

from __future__ import annotations

import torch


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)``: near ``x`` for small values, never beyond ``cap``."""
    return torch.tanh(x / cap) * cap


def capped_attention(
    q: torch.Tensor,  # [1, heads, queries, dim]
    k: torch.Tensor,  # [1, kv_heads, keys, dim]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # [queries, keys] True where a query may attend
    causal: bool,
    scale: float,
    cap: float,
) -> torch.Tensor:
    """What ``scaled_dot_product_attention`` (with ``enable_gqa``) computes, the scores capped
    before the mask: [1, heads, queries, dim]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = softcap(q @ k.transpose(-1, -2) * scale, cap)
    if causal:
        queries, keys = scores.shape[-2:]
        mask = torch.ones(queries, keys, dtype=torch.bool, device=q.device).tril(keys - queries)
    if mask is not None:
        scores = scores.masked_fill(~mask, -torch.inf)
    return torch.softmax(scores, dim=-1) @ v
