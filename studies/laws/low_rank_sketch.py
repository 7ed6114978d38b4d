"""Tokens ranked by a low-rank copy of every key, to measure what selection finer than whole
blocks could reach at the bytes a block choice reads.

After Loki (keys live in a low-dimensional subspace) with the copy quantized: each layer and KV
head maps its keys to ``rank`` components and keeps them in ``bits`` bits a component with a
scale per key; a query mapped to the same components against that copy gives approximate scores
for every token, ranked as the oracle ranks exact ones. The maps are calibrated once, on a text
that no scored text reaches (``calibrated_sketch``: its keys and the queries met on it), either
as the keys' leading right singular vectors (``whitened`` False), or query-aware: in the
coordinates where the calibration queries are white (``A = Cq^(1/2)``, ``q.k = (A^-1 q).(A k)``)
the leading principal vectors ``U`` of the mapped keys, the key copy ``U^T A k`` and the query's
``U^T A^-1 q``. A query that weighs few directions of a spread key space (Gemma 3's global
layers, whose keys are normed per head) is served by the second where the first misses them.

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
from etinfer.control.key_sketch import fit_maps, gram
from etinfer.llm import LLM
from etinfer.model.kv_cache import KVCache
from studies.laws.oracle_selection import OracleSelector

# Forced steps of the calibration text: every pruned layer's budget falls below the whole
# context within a few (a budget loses a quarter a step at most), and the rest gather queries.
CALIBRATION_STEPS = 48


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
        whitened: bool = False,
        full_layers: list[int] | None = None,
    ) -> None:
        super().__init__(config, cache, full_layers=full_layers)
        self.rank, self.bits, self.whitened = rank, bits, whitened
        self.calibrating = True
        self.seen: dict[int, tuple[list[torch.Tensor], torch.Tensor]] = {}  # queries, keys
        self.maps: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # [kv_heads, dim, rank]

    @property
    def sketch_share(self) -> float:
        return self.rank * self.bits / (2 * self.cache.keys.shape[-1] * 16)

    def logits(self, layer: int, q: torch.Tensor, keys: torch.Tensor, blocks) -> torch.Tensor:
        if self.calibrating:  # exact, and what the layer met kept for its maps
            queries = self.seen.get(layer, ([], None))[0]
            queries.append(q[:, 0].float())  # [kv_heads, group, dim]
            self.seen[layer] = (queries, keys[:, 0, : int(blocks.context_lens[0])].float())
            return super().logits(layer, q, keys, blocks)
        key_map, query_map = self.maps[layer]
        copy = quantized(torch.einsum("kstd,kdr->kstr", keys.float(), key_map), self.bits)
        projected = torch.einsum("ksgd,kdr->ksgr", q, query_map)
        return torch.einsum("ksgr,kstr->ksgt", projected, copy) * keys.shape[-1] ** -0.5

    def finish_calibration(self) -> None:
        """Each layer's maps from the queries and keys it met while calibrating."""
        for layer, (queries, keys) in self.seen.items():
            self.maps[layer] = self._maps(torch.cat(queries, 1), keys)
        self.calibrating, self.seen = False, {}

    def _maps(self, queries: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(key map, query map), [kv_heads, dim, rank] each, from ``queries`` [kv_heads, n,
        dim] and ``keys`` [kv_heads, tokens, dim], as the engine's sketch scorer fits them."""
        return fit_maps(gram(queries), gram(keys), self.rank, self.whitened)


def calibrated_sketch(
    config: PruningConfig,
    llm: LLM,
    rank: int,
    text: list[int],
    context: int,
    bits: int = 4,
    whitened: bool = False,
) -> LowRankSketchSelector:
    """A selector for ``config`` whose maps come from ``text``: its first ``context`` tokens'
    keys and the queries of ``CALIBRATION_STEPS`` forced steps after them."""
    selector = LowRankSketchSelector(config, llm.engine.runner.cache, rank, bits, whitened)
    llm.engine.set_pruning(config, selector)
    forced_log_probs(llm, [text[: context + CALIBRATION_STEPS]], context, CALIBRATION_STEPS)
    llm.engine.set_pruning(None)
    selector.finish_calibration()
    return selector
