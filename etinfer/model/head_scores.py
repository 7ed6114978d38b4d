"""Prompt tokens scored through the output head without its logits written out
(``native/quant_head_scores.c``): what prompt log-probabilities need of each row (the
normaliser, the scored token's logit and rank, the largest logits) gathered tile by tile as the
head's kernel makes them.

A head on interleaved GGUF blocks (Q4_0, Q4_1, Q8_0: the head of every file we ship) wrote
Gemma 3's 262,144 logits a row to memory and read them twice more, for its candidates and for
the scores; folded in while they are in the cache, scoring a prompt costs less than the head's
own pass that writes them (BENCHMARKS.md, "Perplexity on human text").

The scores are those of the head's logits with the candidates and the scored token recomputed
from the exact weights (``TopRefinedLinear``), the scored token always: the rest keep the
kernel's 8-bit-activation rounding, as the head's own logits do.
"""

from __future__ import annotations

import torch

from etinfer.model import quant_kernels
from etinfer.model.linear import BlockLinear, TopRefinedLinear

# Per row: the scored token's log-probability and rank, the top ``count`` ids and theirs.
Scores = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def fused_head(head) -> TopRefinedLinear | None:
    """``head`` where it runs fused: a refined head on one interleaved block weight with 8-bit
    activations, on the CPU kernels; else None (the caller writes the logits and scores them)."""
    if not isinstance(head, TopRefinedLinear) or not isinstance(head.layer, BlockLinear):
        return None
    product = head.layer.product
    if head.layer.bias is not None or product.precise or product.float_activations:
        return None
    if len(product.parts) != 1 or not product.parts[0].interleaved:
        return None
    return head


def head_scores(
    head: TopRefinedLinear, hidden: torch.Tensor, targets: torch.Tensor, count: int
) -> Scores:
    """Each row of ``hidden`` [rows, in] scored against ``targets`` [rows] with its top
    ``count`` (at most 64), through a head ``fused_head`` took."""
    kernels = quant_kernels.library()
    assert kernels is not None, "fused_head takes only heads on the block kernels"
    (part,) = head.layer.product.parts
    x = hidden.float().contiguous()
    targets = targets.to(torch.int64).contiguous()
    rows, width = x.shape[0], max(head.candidates, count)
    exact_target = head.exact(x, targets[:, None])[:, 0].contiguous()
    most, sums = torch.empty(rows), torch.empty(rows, dtype=torch.float64)
    above, kernel_target = torch.empty(rows, dtype=torch.int64), torch.empty(rows)
    ids, kernel = torch.empty(rows, width, dtype=torch.int64), torch.empty(rows, width)
    status = kernels.head_scores8(
        int(part.qtype), part.data.data_ptr(), part.out_features, part.in_features, x.data_ptr(),
        rows, targets.data_ptr(), exact_target.data_ptr(), width, torch.get_num_threads(),
        *(t.data_ptr() for t in (most, sums, above, kernel_target, ids, kernel)),
    )  # fmt: skip
    if status == -3:
        raise MemoryError(f"no memory to score {rows} rows through the output head")
    if status != 0:
        raise ValueError(
            f"prompt tokens outside the {part.out_features}-entry vocabulary, or {count} > 64"
        )
    refined = head.exact(x, ids)
    # The normaliser of the kernel's logits, the candidates' and the target's put right.
    base = most.double()[:, None]
    sums = sums + ((refined.double() - base).exp() - (kernel.double() - base).exp()).sum(1)
    is_target = ids == targets[:, None]
    outside = ~is_target.any(1)
    shift = (exact_target.double() - base[:, 0]).exp() - (kernel_target.double() - base[:, 0]).exp()
    log_z = base[:, 0] + (sums + torch.where(outside, shift, 0.0)).log()
    # The kernel counted its own logits above the target's exact one, the target's included.
    point = exact_target[:, None]
    others = ~is_target
    rank = 1 + above - (kernel_target > exact_target).long()
    rank = rank - ((kernel > point) & others).sum(1) + ((refined > point) & others).sum(1)
    top, order = refined.topk(count, dim=1)
    token_logprob = (exact_target.double() - log_z).float()
    return token_logprob, rank, ids.gather(1, order), (top.double() - log_z[:, None]).float()
