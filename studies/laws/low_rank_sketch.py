"""Tokens ranked by a low-rank, 4-bit copy of every key, to measure what selection finer than
whole blocks could reach at the bytes a block choice reads.

After Loki (keys live in a low-dimensional subspace) with the copy quantized: each layer and KV
head projects its keys on their ``rank`` leading right singular vectors, found once from the
first sequence's keys in context at the layer's first pruned step (``calibrated_sketch`` makes
that sequence a calibration text that no scored text reaches), and keeps the projections in
``bits`` bits a component with a scale per key. A query projected on the same basis against
that copy gives approximate scores for every token, ranked as the oracle ranks exact ones.

Run with ``--block-size 1`` each block is a token, and the choice is token by token. The copy
is what a cache would keep beside the keys, read in full by each pruned layer:
``rank * bits / (2 * head_dim * 16)`` of the KV bytes of a 16-bit cache (``sketch_share``),
counted with the tokens kept. In torch here, from the cached keys: a measurement, its time is
not a kernel's.
"""

from __future__ import annotations

import torch

from etinfer.bench.common.fidelity import forced_log_probs
from etinfer.control.block_selection import PruningConfig
from etinfer.llm import LLM
from etinfer.model.kv_cache import KVCache
from studies.laws.oracle_selection import OracleSelector


def quantized(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` rounded to ``bits`` signed bits a component, one scale per last-axis row."""
    top = 2 ** (bits - 1) - 1
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / top
    return (x / scale).round().clamp(-top, top) * scale


class LowRankSketchSelector(OracleSelector):
    def __init__(
        self,
        config: PruningConfig,
        cache: KVCache,
        rank: int,
        bits: int = 4,
        full_layers: list[int] | None = None,
    ) -> None:
        super().__init__(config, cache, full_layers=full_layers)
        self.rank, self.bits = rank, bits
        self.bases: dict[int, torch.Tensor] = {}  # [kv_heads, dim, rank] a layer

    @property
    def sketch_share(self) -> float:
        return self.rank * self.bits / (2 * self.cache.keys.shape[-1] * 16)

    def logits(self, layer: int, q: torch.Tensor, keys: torch.Tensor, blocks) -> torch.Tensor:
        if layer not in self.bases:
            seen = keys[:, 0, : int(blocks.context_lens[0])].float()  # [kv_heads, tokens, dim]
            vectors = torch.linalg.svd(seen, full_matrices=False).Vh  # [kv_heads, dim, dim]
            self.bases[layer] = vectors[:, : self.rank].transpose(1, 2).contiguous()
        basis = self.bases[layer]
        copy = quantized(torch.einsum("kstd,kdr->kstr", keys.float(), basis), self.bits)
        projected = torch.einsum("ksgd,kdr->ksgr", q, basis)
        return torch.einsum("ksgr,kstr->ksgt", projected, copy) * keys.shape[-1] ** -0.5


# Forced steps of the calibration text: enough for every pruned layer's budget to fall below the
# whole context (a budget loses a quarter a step at most), so that each layer ranks once.
CALIBRATION_STEPS = 8


def calibrated_sketch(
    config: PruningConfig, llm: LLM, rank: int, text: list[int], context: int
) -> LowRankSketchSelector:
    """A selector for ``config`` whose bases come from ``text``'s first ``context`` tokens'
    keys, teacher-forced under it before it ranks anything else."""
    selector = LowRankSketchSelector(config, llm.engine.runner.cache, rank)
    llm.engine.set_pruning(config, selector)
    forced_log_probs(llm, [text[: context + CALIBRATION_STEPS]], context, CALIBRATION_STEPS)
    llm.engine.set_pruning(None)
    return selector
