"""Two additions to the reused-mass selector's choice, to measure what each buys per byte.

``OwnBoundsSelector``: each pruned layer also keeps its own best blocks by its key bounds (the
reused masses are one layer's view for every layer and head; the bounds are the layer's own
query, if blurred).

``HeadRolesSelector``, per-head roles (after DuoAttention and RazorAttention): a few KV heads of
the pruned layers read every block, the others keep what the reused-mass selector chose.

Which heads are retrieval heads is calibrated offline, on text the fidelity run does not score:
the reused-mass selector runs teacher-forced while ``MissedMass`` measures, per layer and KV
head, the exact attention mass (the most any query head of the group gave) on the blocks the
selector dropped. The heads that lose the most are the ones to read densely; DuoAttention finds
its retrieval heads by how much streaming them costs, this is the same question asked of the
selector that actually runs. It is a measurement tool: the calibration needs a dense attention
beside every pruned one (``OracleSelector``).
"""

from __future__ import annotations

import torch

from etinfer.bench.common.fidelity import forced_log_probs
from etinfer.control.block_scores import key_bound_scores, key_digest_scores
from etinfer.control.block_selection import EntropicSelector, PruningConfig
from etinfer.engine.layers import full_context_layers
from etinfer.llm import LLM
from etinfer.model.block_layout import Selection
from etinfer.model.kv_cache import KVCache
from studies.laws.oracle_selection import OracleSelector


class MissedMass(EntropicSelector):
    """The entropic selector, measuring what its choices drop (``missed``: [layers, kv_heads],
    the dropped mass summed over decode rows and steps)."""

    def __init__(
        self, config: PruningConfig, cache: KVCache, layers: int, full_layers: list[int]
    ) -> None:
        super().__init__(config, full_layers=full_layers)
        self.full_layers = full_layers
        self.oracle = OracleSelector(config, cache, full_layers=full_layers)
        self.missed = torch.zeros(layers, cache.keys.shape[1])

    def select(self, layer, query, blocks, summaries) -> Selection | None:
        selection = super().select(layer, query, blocks, summaries)
        if selection is not None:
            mass = self.oracle.block_scores(layer, query, blocks, summaries, None)
            self.missed[layer] += (mass * ~selection.mask).sum((0, 2))
        return selection

    def with_retrieval_heads(self, share: float) -> HeadRolesSelector:
        """The selector whose retrieval heads are the ``share`` of the pruned (layer, KV head)
        pairs that lost the most here."""
        flat = self.missed.flatten()
        count = round(share * int((flat > 0).sum()))
        chosen = torch.zeros_like(flat, dtype=torch.bool)
        chosen[flat.topk(count).indices] = True
        return HeadRolesSelector(self.config, chosen.view_as(self.missed), self.full_layers)


class OwnBoundsSelector(EntropicSelector):
    """The entropic selector (reused masses), and in each pruned layer the ``share`` of the
    row's blocks each KV head ranks best by its key bounds (by its key digest at ``spread``
    spreads, where given)."""

    def __init__(
        self,
        config: PruningConfig,
        share: float,
        full_layers: list[int],
        spread: float | None = None,
    ) -> None:
        super().__init__(config, full_layers=full_layers)
        self.share = share
        self.spread = spread

    def select(self, layer, query, blocks, summaries) -> Selection | None:
        selection = super().select(layer, query, blocks, summaries)
        if selection is None:  # a dense layer, or a selection layer
            return selection
        if self.spread is None:
            estimates = key_bound_scores(query, summaries, blocks.block_tables)
        else:
            estimates = key_digest_scores(query, summaries, blocks, self.spread)
        ranked = estimates.amax(2)
        budgets = (blocks.present.sum(1) * self.share).ceil().long()
        own = self.keep_best(ranked, blocks, budgets[:, None].expand(-1, ranked.shape[1]))
        return Selection(selection.mask | own)


class HeadRolesSelector(EntropicSelector):
    """The entropic selector with the ``retrieval`` heads ([layers, kv_heads]) reading every
    block of their layer."""

    def __init__(
        self, config: PruningConfig, retrieval: torch.Tensor, full_layers: list[int]
    ) -> None:
        super().__init__(config, full_layers=full_layers)
        self.retrieval = retrieval

    def select(self, layer, query, blocks, summaries) -> Selection | None:
        selection = super().select(layer, query, blocks, summaries)
        if selection is None or not self.retrieval[layer].any():
            return selection
        dense = self.retrieval[layer][None, :, None] & blocks.present[:, None, :]
        return Selection(selection.mask | dense, selection.bounds)


def calibrated(
    llm: LLM, config: PruningConfig, text: list[int], context: int, steps: int
) -> MissedMass:
    """What ``config``'s choices drop per layer and KV head, teacher-forced on ``text``'s
    ``steps`` tokens after ``context`` tokens of it."""
    engine = llm.engine
    layers, full = engine.model_config.num_layers, full_context_layers(engine.model_config)
    calibration = MissedMass(config, engine.runner.cache, layers, full)
    engine.set_pruning(config, calibration)
    forced_log_probs(llm, [text], context, steps)
    engine.set_pruning(None)
    return calibration
