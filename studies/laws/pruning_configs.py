"""The pruning study's named configurations: each part of the study runs the ones it is given
(``--speed-configs``, ``--fidelity-configs``, ``--passkey-configs``)."""

from __future__ import annotations

from dataclasses import replace

from etinfer.control.block_selection import PruningConfig

BOUND = PruningConfig(scorer="bound")
REUSED = PruningConfig(scorer="reused-mass")
DIGEST = PruningConfig(scorer="digest")
SKETCH = PruningConfig(scorer="sketch")
TOKENS = PruningConfig(scorer="sketch-tokens")
CONFIGS = {
    "bound": BOUND,
    "digest": DIGEST,
    "mass": PruningConfig(scorer="mass"),
    "sketch": SKETCH,
    "tokens": TOKENS,
    # Fixed shares of the blocks at every entropy: the speed/fidelity frontier.
    "bound-fifth": replace(BOUND, budget_low=0.2, budget_high=0.2),
    "bound-quarter": replace(BOUND, budget_low=0.25, budget_high=0.25),
    "bound-half": replace(BOUND, budget_low=0.5, budget_high=0.5),
    # Per-KV-head budgets from attention entropy, and the value factor, at the same shares.
    "heads-fifth": replace(BOUND, budget_low=0.2, budget_high=0.2, head_budgets=True),
    "heads-half": replace(BOUND, budget_low=0.5, budget_high=0.5, head_budgets=True),
    "value-fifth": replace(BOUND, budget_low=0.2, budget_high=0.2, scorer="bound-value"),
    "value-half": replace(BOUND, budget_low=0.5, budget_high=0.5, scorer="bound-value"),
    "heads": replace(BOUND, head_budgets=True),
    # Blocks ranked by the exact mass two dense selection layers gave them this step.
    "reused": REUSED,
    "reused-fifth": replace(REUSED, budget_low=0.2, budget_high=0.2),
    "reused-quarter": replace(REUSED, budget_low=0.25, budget_high=0.25),
    # The fewest blocks that carry 95 % of the measured mass, at most half of them.
    "reused-top-p": replace(REUSED, budget_law="top-p"),
}
# The budget laws side by side at a few settings each, for the bytes-against-KL frontier: fixed
# shares prune from any context (the scorers' defaults wait for where they pay, 8K for those that
# rank by each layer's query, past the fidelity runs' 6K).
for share in (0.08, 0.1, 0.125, 0.15, 0.175, 0.2, 0.35):
    bases = (("bound", BOUND), ("reused", REUSED), ("digest", DIGEST), ("sketch", SKETCH))
    bases += (("tokens", TOKENS),)
    for prefix, base in bases:
        CONFIGS[f"{prefix}-share-{share}"] = replace(
            base, budget_low=share, budget_high=share, min_context=0
        )
for tokens in (512, 1024, 2048):
    CONFIGS[f"bound-fixed-{tokens}"] = replace(BOUND, budget_law="fixed", token_budget=tokens)
    CONFIGS[f"reused-fixed-{tokens}"] = replace(REUSED, budget_law="fixed", token_budget=tokens)
for p in (0.8, 0.9, 0.99):
    CONFIGS[f"reused-top-p-{p}"] = replace(REUSED, budget_law="top-p", top_p=p)
    CONFIGS[f"reused-entropy+top-p-{p}"] = replace(REUSED, budget_law="entropy+top-p", top_p=p)
for low, high in ((0.05, 0.3), (0.1, 0.5), (0.2, 0.6)):
    law = replace(REUSED, budget_law="attention-entropy", budget_low=low, budget_high=high)
    CONFIGS[f"reused-attention-entropy-{low}-{high}"] = law
    CONFIGS[f"reused-entropy-{low}-{high}"] = replace(REUSED, budget_low=low, budget_high=high)
# Pruning from any context on, to measure where it starts to pay (the defaults wait for that).
CONFIGS["bound-ungated"] = replace(BOUND, min_context=0)
CONFIGS["reused-ungated"] = replace(REUSED, min_context=0)
CONFIGS["digest-ungated"] = replace(DIGEST, min_context=0)
CONFIGS["sketch-ungated"] = replace(SKETCH, min_context=0)
CONFIGS["tokens-ungated"] = replace(TOKENS, min_context=0)
# Single tokens with two sink blocks always read (the needle right after the first block).
for share in (0.08, 0.125):
    CONFIGS[f"tokens-sink2-share-{share}"] = replace(
        CONFIGS[f"tokens-share-{share}"], sink_blocks=2, min_blocks=8
    )
# Where reused-mass selects: a quarter of the blocks, the selection layers named after the @.
for layers in ((2, 16), (14,), (18,), (2, 10, 18), (5,)):  # 5: Gemma 3's first global layer
    CONFIGS["reused-quarter@" + "-".join(map(str, layers))] = replace(
        CONFIGS["reused-quarter"], selection_layers=layers
    )
