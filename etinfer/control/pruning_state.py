"""One request's state under entropic pruning (``block_selection.py`` holds the law).

The engine gives every request this state when it enters an engine built with pruning on; the
block budget is what the law planned for it last step (the rate limit's reference), the lists are
what its decode attention kept, per generated token, which its outputs report.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PruningState:
    """- block_budget: blocks decode attention kept last step; None before its first pruned step.
    - blocks_kept: per generated token (not the prefill's), the share of the context's (block, KV
      head) pairs decode attention read over all layers.
    - dropped_mass: per generated token, the bound on the attention mass any layer dropped.
    - reported: entries of both lists that earlier delta outputs carried.
    """

    block_budget: int | None = None
    blocks_kept: list[float] = field(default_factory=list)
    dropped_mass: list[float] = field(default_factory=list)
    reported: int = 0

    def record_attention(self, kept: float, total: float, dropped_mass: float) -> None:
        """One generated token's decode attention: (block, KV head) pairs kept and in context
        over all layers, and the bound on the attention mass any layer dropped."""
        self.blocks_kept.append(kept / total if total else 1.0)
        self.dropped_mass.append(dropped_mass)

    @property
    def last_share(self) -> float:
        """The share of the context decode attention read last step (1: all, or none yet)."""
        return self.blocks_kept[-1] if self.blocks_kept else 1.0
