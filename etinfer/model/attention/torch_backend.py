"""The ``torch`` backend: decode as torch operations on the CSR pattern (the scores by
``torch.sparse.sampled_addmm`` on exactly the pattern's pairs, the softmax on the flat score
vector, the values by ``embedding_bag`` with per-entry weights), prefill through SDPA. What runs
where neither the C kernel nor the GPU's serves (another device, no C compiler, Gemma 2's soft
cap on the CPU), and what the mass scorer reads on CUDA: every entry's weight."""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.nn.functional as F

from etinfer.model.attention.pattern import DecodePattern
from etinfer.model.attention.pattern_decode import PatternDecode
from etinfer.model.kv_cache import KVCache
from etinfer.model.softcap import softcap

# The CSR kernels are stable in the pinned torch; the notice would only confuse.
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")


class TorchBackend(PatternDecode):
    def attend(
        self, layer: int, q: torch.Tensor, cache: KVCache, pattern: DecodePattern
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        scale, cap = self.options.scale, self.options.softcap
        if cache.dtype == cache.compute_dtype:
            return pattern_attention(
                q, cache.key_rows[layer], cache.value_rows[layer], pattern, scale, cap
            )
        # The pattern's rows widened once, in entry order (the CPU's sparse kernels take no
        # half or int8 types); the entries then read those rows one to one.
        keys, values = cache.read_rows(layer, pattern.cols)
        cols = torch.arange(pattern.nnz, dtype=pattern.cols.dtype, device=q.device)
        gathered = dataclasses.replace(pattern, cols=cols)
        return pattern_attention(q, keys, values, gathered, scale, cap)


def pattern_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pattern: DecodePattern,
    scale: float,
    cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of query rows ``q`` over ``pattern``'s cache rows of ``keys`` and ``values``
    (float32), in torch operations: what the native kernel computes (off the CPU, or without a
    C compiler), and with ``cap`` scores soft-capped (Gemma 2). The output, and per row the
    largest score, the softmax denominator, and the entries' unnormalised weights."""
    if q.device.type == "cpu":
        structure = torch.sparse_csr_tensor(
            pattern.crow,
            pattern.cols,
            pattern.zeros,
            (q.shape[0], keys.shape[0]),
            check_invariants=False,
        )
        scores = torch.sparse.sampled_addmm(structure, q, keys.t(), beta=0.0, alpha=scale)
        scores = scores.values()
    else:
        scores = gathered_scores(q, keys, pattern, scale)
    if cap is not None:
        scores = softcap(scores, cap)
    scores.index_fill_(0, pattern.masked, -torch.inf)
    row_max = torch.segment_reduce(scores, "max", offsets=pattern.crow)
    weights = scores.sub_(row_max[pattern.row_ids]).exp_()
    denominators = torch.segment_reduce(weights, "sum", offsets=pattern.crow)
    out = F.embedding_bag(
        pattern.cols,
        values,
        pattern.crow,
        mode="sum",
        per_sample_weights=weights,
        include_last_offset=True,
    )
    return out.div_(denominators[:, None]), row_max, denominators, weights


# Bytes of the rows ``gathered_scores`` gathers at once (a query's and a key's per entry).
_GATHERED_BYTES = 512 << 20


def gathered_scores(
    q: torch.Tensor, keys: torch.Tensor, pattern: DecodePattern, scale: float
) -> torch.Tensor:
    """The pattern's scores as dots of gathered rows, off the CPU. There ``sampled_addmm`` is
    cuSPARSE's SDDMM, which may take a CSR tensor's column indices as sorted in each row, the
    CSR invariant; ours follow the block table's order, the pool's. On an H200 that path gave
    the Gemma 2 test wrong logprobs (this form replaces it, not yet re-run on a GPU). A decode
    pattern's gathered rows cost little, and a long one is taken in pieces of bounded size."""
    scores = torch.empty(pattern.nnz, dtype=q.dtype, device=q.device)
    entries = max(1, _GATHERED_BYTES // (2 * q.shape[-1] * q.element_size()))
    for start in range(0, pattern.nnz, entries):
        piece = slice(start, start + entries)
        rows, cols = pattern.row_ids[piece], pattern.cols[piece].long()
        torch.linalg.vecdot(q[rows], keys[cols], out=scores[piece])
    return scores.mul_(scale)
