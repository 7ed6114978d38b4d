"""Pruning's configuration and its budget laws: how many KV blocks a decoding sequence keeps
(pure functions of the configuration and the step's record; the selector that picks the blocks
is ``block_selection.py``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from etinfer.validation import check_choice, check_float, check_int

SCORERS = ("bound", "bound-value", "digest", "mass", "reused-mass", "sketch", "sketch-tokens")
SKETCHED = ("sketch", "sketch-tokens")  # the scorers that read the cache's key copy
# How many blocks a row keeps:
# - "entropy", the paper's law: its predictive entropy between the floor and the high mark sets
#   a share between budget_low and budget_high;
# - "fixed" (Quest): token_budget tokens' worth of blocks, whatever the entropy and context;
# - "top-p" (Twilight): the fewest blocks that carry top_p of the mass the selection layer
#   measured, at most budget_high of them;
# - "attention-entropy" (EntropyInfer's signal): the entropy of that measured mass over the
#   row's blocks, as a fraction of its largest (all blocks alike), sets the share between
#   budget_low and budget_high;
# - "entropy+top-p": top-p within the cap the paper's law sets.
# The last three count measured mass: they need the reused-mass scorer.
BUDGET_LAWS = ("entropy", "fixed", "top-p", "attention-entropy", "entropy+top-p")
MEASURED_LAWS = ("top-p", "attention-entropy", "entropy+top-p")
SELECTION_DEPTH = 0.6  # reused-mass: the default second selection layer's depth in the model
# Per scorer, the context from which pruning costs less than it saves, by the step's decoding
# sequences: (from this many, this context), the largest count not above the step's applies.
# Reused masses, which answer without a layer's query, prune in native calls between their
# selection layers: held to AVX2 they cost 1.08x dense at 1K, 0.95-1.02x at 2K, 0.79-0.83x at
# 4K and 0.64-0.68x at 8K at batch 1, and at batch 8 0.84x at 1K. The other scorers rank by each
# layer's query, so their pruned steps run layer by layer against a dense step in one native
# call: they start where reused masses did before (8K), at every batch (BENCHMARKS.md,
# "Entropic pruning").
# The key copy's scorers, held to AVX2: single tokens are chosen inside the native decoder's one
# call a step, 1.02x dense at 1K, 0.95x at 2K, 0.80x at 4K and 0.70x at 8K at batch 1, at batch
# 8 0.91x at 1K and 0.55x at 8K: reused masses' gate serves them. Blocks by the copy run layer
# by layer (1.17x at 8K at batch 1; at batch 8 0.89x at 4K, 0.72x at 8K); past 8K at batch 1
# unmeasured (above the default model's context).
PAYING_CONTEXT: dict[str, tuple[tuple[int, int], ...]] = {
    **dict.fromkeys(("bound", "bound-value", "digest", "mass"), ((1, 8192),)),
    "sketch": ((1, 16384), (8, 4096)),
    **dict.fromkeys(("reused-mass", "sketch-tokens"), ((1, 3072), (8, 1024))),
}


@dataclass(frozen=True)
class PruningConfig:
    # reused-mass: at equal decode cost the closest to dense of the scorers, and it keeps the
    # passkeys dense attention finds (BENCHMARKS.md, "Entropic pruning")
    scorer: str = "reused-mass"
    # tokens; shorter contexts attend densely. None: where the scorer starts to pay at batch 1
    # (PAYING_CONTEXT)
    min_context: int | None = None
    dense_layers: int = 2  # the first layers stay dense (Quest keeps two; measured here too)
    min_blocks: int = 8
    sink_blocks: int = 1
    recent_blocks: int = 2
    entropy_floor: float = 0.5  # nats
    entropy_high: float = 4.0  # at and above it the budget is budget_high
    budget_low: float = 0.125  # fraction of blocks kept at (or below) the floor
    budget_high: float = 0.5
    max_shrink: float = 0.25  # a budget loses at most this fraction per step
    refresh_interval: int = 16  # mass scorer: a dense step this often
    digest_spread: float = 2.0  # digest scorer: a block's reach is its mean plus this many spreads
    head_budgets: bool = False  # share the budget among KV heads by where their attention lies
    head_floor: float = 0.5  # share of the budget each head keeps by its own ranking first
    # reused-mass: the layers that attend densely and rank blocks for the layers after them;
    # None: the first layer pruning reaches and the one at SELECTION_DEPTH of the model (if it
    # serves at least two), among those that see the whole context (TidalDecode's choice for 32
    # layers was 2 and 13)
    selection_layers: tuple[int, ...] | None = None
    budget_law: str = "entropy"
    top_p: float = 0.95  # the top-p laws' share of the measured mass
    token_budget: int = 1024  # the fixed law's tokens per row (Quest's budgets: 1-4K)
    # sketch scorers: the directions of the key copy, None: 3/8 of the head size (24 of 64 in 8
    # bits and a float32 scale are 10.9 % of a 16-bit cache's bytes; at 16, single tokens lost a
    # passkey dense attention found, and Gemma 3's global layers needed 48 of 256 to come near
    # the oracle: BENCHMARKS.md "Tokens, not blocks"); and the
    # file of its fitted maps (``SketchMaps``), None: fitted once per model file and cached
    # (``etinfer.calibrate.build_engine``)
    sketch_rank: int | None = None
    sketch_maps: str | None = None

    def rank_for(self, head_dim: int) -> int:
        """The key copy's rank for a model of ``head_dim``."""
        if self.sketch_rank is not None and self.sketch_rank > head_dim:
            raise ValueError(
                f"control.pruning.sketch_rank must be at most the head size {head_dim}, got "
                f"{self.sketch_rank}"
            )
        return self.sketch_rank or max(1, head_dim * 3 // 8)

    @property
    def sketched(self) -> bool:
        """Whether its scorer reads the cache's low-rank key copy (and needs its maps)."""
        return self.scorer in SKETCHED

    def __post_init__(self) -> None:
        check_choice("scorer", self.scorer, SCORERS)
        check_choice("budget_law", self.budget_law, BUDGET_LAWS)
        check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        check_int("token_budget", self.token_budget, low=1)
        if self.sketch_rank is not None:
            check_int("sketch_rank", self.sketch_rank, low=1)
        if self.head_budgets and self.scorer in ("reused-mass", *SKETCHED):
            raise ValueError(
                "head_budgets shares a budget among KV heads by their key bounds: it needs scorer "
                f"'bound', 'bound-value', 'digest' or 'mass', got {self.scorer!r}"
            )
        if self.budget_law in MEASURED_LAWS and self.scorer != "reused-mass":
            raise ValueError(
                f"budget_law {self.budget_law!r} counts blocks by their measured mass: it needs "
                f"scorer 'reused-mass', got {self.scorer!r}"
            )
        if self.min_context is not None:
            check_int("min_context", self.min_context, low=0)
        check_int("dense_layers", self.dense_layers, low=0)
        check_int("sink_blocks", self.sink_blocks, low=0)
        check_int("recent_blocks", self.recent_blocks, low=0)
        # The always-kept blocks fit in every budget, so none of them is ever cut.
        check_int("min_blocks", self.min_blocks, low=max(1, self.sink_blocks + self.recent_blocks))
        check_float("entropy_floor", self.entropy_floor, low=0.0)
        check_float("entropy_high", self.entropy_high, low=self.entropy_floor, low_open=True)
        check_float("budget_low", self.budget_low, low=0.0, high=1.0, low_open=True)
        check_float("budget_high", self.budget_high, low=self.budget_low, high=1.0)
        check_float("max_shrink", self.max_shrink, low=0.0, high=1.0)
        check_int("refresh_interval", self.refresh_interval, low=1)
        check_float("digest_spread", self.digest_spread, low=0.0)
        check_float("head_floor", self.head_floor, low=0.0, high=1.0)
        if self.selection_layers is not None:
            layers = tuple(self.selection_layers)
            for layer in layers:
                check_int("selection_layers", layer, low=0)
            if not layers or list(layers) != sorted(set(layers)):
                raise ValueError(
                    f"selection_layers must be distinct layers in ascending order, got {layers!r}"
                )


def dense_below(config: PruningConfig, decoding: int = 1) -> int:
    """The context, in tokens, under which a sequence attends densely in a step that decodes
    ``decoding`` sequences."""
    if config.min_context is None:
        return next(c for n, c in reversed(PAYING_CONTEXT[config.scorer]) if decoding >= n)
    return config.min_context


def check_context(config: PruningConfig, max_model_len: int) -> None:
    """Refuse a fixed token budget no context of the engine can exceed: it would never prune."""
    if config.budget_law == "fixed" and config.token_budget >= max_model_len:
        raise ValueError(
            f"control.pruning.token_budget must be below max_model_len {max_model_len} (the "
            f"longest context), got {config.token_budget}"
        )


def block_budget(
    predictive_entropy_upper: float, num_blocks: int, previous: int | None, config: PruningConfig
) -> int:
    """How many blocks a sequence keeps this step, from the upper side of its predictive
    entropy estimate (conservative: an underestimate would prune harder)."""
    h = max(predictive_entropy_upper, config.entropy_floor)
    span = config.entropy_high - config.entropy_floor
    weight = min(1.0, (h - config.entropy_floor) / span)
    fraction = config.budget_low + (config.budget_high - config.budget_low) * weight
    budget = max(config.min_blocks, math.ceil(fraction * num_blocks))
    if previous is not None and config.max_shrink < 1:
        # At least one block per step, or a small budget rounds back to itself for good.
        shrink = 0 if config.max_shrink == 0 else max(1, math.floor(previous * config.max_shrink))
        budget = max(budget, previous - shrink)
    return min(budget, num_blocks)


def plan_budget(
    predictive_entropy_upper: float | None,
    context_len: int,
    previous: int | None,
    refresh: bool,
    config: PruningConfig,
    block_size: int,
    decoding: int = 1,
) -> int:
    """The blocks a decoding sequence keeps this step (one of ``decoding``): its whole context
    where it attends densely (no entropy measured yet, a context under ``min_context`` or, by
    default, under where pruning pays at this many sequences, a mass refresh step),
    else its law's budget (the cap, for a law the layers finish). A dense step counts as the
    previous budget, so the rate limit also holds where pruning starts."""
    in_context = -(-context_len // block_size)
    dense_context = context_len < dense_below(config, decoding)
    if predictive_entropy_upper is None or dense_context or refresh:
        return in_context
    if config.budget_law == "fixed":
        return min(in_context, max(config.min_blocks, -(-config.token_budget // block_size)))
    if config.budget_law in ("top-p", "attention-entropy"):
        # These count the measured mass alone, in the layers: plan their cap, budget_high.
        predictive_entropy_upper = config.entropy_high
    previous = in_context if previous is None else previous
    return block_budget(predictive_entropy_upper, in_context, previous, config)


def selection_layers(config: PruningConfig, full_layers: Sequence[int] | None) -> tuple[int, ...]:
    """The reused-mass scorer's selection layers for a model whose layers ``full_layers`` see
    the whole context: the configured ones, checked to be among them, or the default."""
    full = sorted(full_layers) if full_layers is not None else None
    if config.selection_layers is not None:
        chosen = tuple(config.selection_layers)
        if full is not None and not set(chosen) <= set(full):
            raise ValueError(
                f"control.pruning.selection_layers {list(chosen)}: a selection layer must see the "
                f"whole context; this model's such layers are {full}"
            )
        return chosen
    if full is None:
        raise ValueError("control.pruning.selection_layers: give them, the model's are unknown")
    reached = [layer for layer in full if layer >= config.dense_layers] or full[-1:]
    # The second where 60 % of the model's layers lie behind it: on SmolLM2 (30 layers) a
    # selection at layer 18 kept every passkey dense attention found, at 14 or 16 it lost some
    # (BENCHMARKS.md, "Entropic pruning").
    deep = min(reached, key=lambda layer: abs(layer - SELECTION_DEPTH * (full[-1] + 1)))
    # A selection layer reads everything for the pruned layers after it: serving fewer than two
    # it reads more than it saves (Gemma 3 270M, whose layers 5, 11 and 17 see the whole
    # context: selecting at 5 and 11 read 82 % of dense's bytes, a 1.02x step; at 5 alone 64 %,
    # 0.94x).
    if sum(layer > deep for layer in reached) < 2:
        return (reached[0],)
    return tuple(sorted({reached[0], deep}))
