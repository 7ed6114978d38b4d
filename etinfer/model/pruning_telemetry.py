"""What decode attention kept in a step, per layer and decode row: the blocks read and an upper
bound of the attention mass the dropped ones carried (the certificate each token reports)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from etinfer.model.block_layout import DecodeBlocks


@dataclass
class PrunedLayer:
    """What one pruned layer's attention computed, as the bound needs it."""

    layer: int
    # [seqs, kv_heads, group, blocks] upper bounds of q.k per block; None where the selector
    # ranked without them (then the layer certifies nothing it dropped: a dropped mass of 1)
    bounds: torch.Tensor | None
    # [seqs, kv_heads, blocks] the blocks read; where single tokens were, the share of each
    # block's tokens in context read (float)
    visible: torch.Tensor
    # [seqs * heads] each query row's largest score (scaled) and its softmax denominator over
    # the kept entries, where there are bounds to weigh against them (else None)
    row_max: torch.Tensor | None
    denominators: torch.Tensor | None


@dataclass
class PruningTelemetry:
    """Per layer and decode sequence, what attention kept.

    Pruned layers hand in what they computed as they run (``record``); the figures are worked
    out for all of them at once when first read. Per layer they were a dozen small operations,
    1.6 ms of a 16 ms pruned step at batch 1 and 8K tokens.
    """

    in_context: torch.Tensor  # [seqs, kv_heads, blocks] blocks in context (and window)
    log_tokens: torch.Tensor  # [seqs, blocks] log of each block's tokens in context
    total: torch.Tensor  # [layers, seqs] (block, KV head) pairs in context
    scale: float  # of q.k in the scores
    read: torch.Tensor  # [layers, seqs] pairs a layer reads unless pruned: its context or window
    pruned: list[PrunedLayer] = field(default_factory=list)
    _figures: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def empty(
        cls,
        layers: int,
        blocks: DecodeBlocks,
        in_context: torch.Tensor,
        scale: float,
        windows: tuple[list[int], torch.Tensor] | None = None,
    ) -> PruningTelemetry:
        """Before the step; ``in_context`` is what dense attention reads; ``windows``: the
        sliding layers of a model that mixes windows, and the blocks their window holds (what
        they read, never pruned)."""
        total = in_context.sum((1, 2)).float().expand(layers, -1).clone()
        read = total.clone()
        if windows is not None:
            local, visible = windows
            read[local] = visible.sum((1, 2)).float()
        return cls(in_context, blocks.block_tokens.log(), total, scale, read)

    def record(self, pruned: PrunedLayer) -> None:
        """A pruned layer's attention; a layer not recorded read every block it could."""
        self.pruned.append(pruned)
        self._figures = None

    @property
    def kept(self) -> torch.Tensor:
        """[layers, seqs] (block, KV head) pairs attended to."""
        return self._computed()[0]

    @property
    def dropped_mass(self) -> torch.Tensor:
        """[layers, seqs] upper bound of the softmax mass the dropped blocks carried, the
        largest over the query heads.

        With ``D`` the dropped blocks' true softmax numerator sum and ``K`` the kept one (exact),
        the dropped mass is ``D / (K + D)``; each key's score is at most its block's key bound,
        so ``D <= sum_dropped tokens * exp(bound)`` bounds it from above. The attention output
        error is that mass times the gap between dropped and kept mean values.
        """
        return self._computed()[1]

    def _computed(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._figures is None:
            kept, dropped = self.read.clone(), torch.zeros_like(self.total)
            if self.pruned:
                layers = torch.tensor([p.layer for p in self.pruned], device=kept.device)
                visible = torch.stack([p.visible for p in self.pruned])
                kept[layers] = visible.sum((2, 3)).float()
                gone = self.in_context & (visible < 1)  # [pruned, seqs, kv, blocks]
                # One selector prunes every layer of a step: all with key bounds, or none.
                if self.pruned[0].bounds is None:  # no certificate: 1 where any was dropped
                    dropped[layers] = gone.flatten(2).any(2).float()
                else:
                    dropped[layers] = self._bounded_mass(gone)
            self._figures = kept, dropped
        return self._figures

    def _bounded_mass(self, gone: torch.Tensor) -> torch.Tensor:
        """[pruned, seqs]: the bound on the dropped mass (see ``dropped_mass``), the largest
        over the query heads, for the ``gone`` blocks of each pruned layer."""
        bounds = torch.stack([p.bounds for p in self.pruned])  # [pruned, seqs, kv, g, b]
        shape = (*bounds.shape[:4], 1)
        row_max = torch.stack([p.row_max for p in self.pruned]).view(shape)
        log_kept = torch.stack([p.denominators for p in self.pruned]).log().view(shape)
        relative = bounds * self.scale
        relative += self.log_tokens[:, None, None, :]
        relative -= row_max
        relative.masked_fill_(~gone[:, :, :, None, :], -torch.inf)
        return torch.sigmoid(relative.logsumexp(-1, keepdim=True) - log_kept).amax((2, 3, 4))
