"""Super-additivity (the paper's section 6.8): does the coupled loop gain more than its layers
would if each acted alone and their effects compounded?

Each arm's effect on a Table 1 column is a gain factor over the baseline of the same repeat,
above 1 where it helps: the ratio for throughput, η and quality, its inverse for latency. The
single layers' factors multiplied are what the full system would reach if the layers neither
helped nor hindered each other; the full system's factor over that product is the excess (above
1: super-additive). A product, not a sum of gains: layers that each save a fraction of the time
compound, and a sum calls that compounding an interaction."""

from __future__ import annotations

import math

from etinfer.bench.common.results import Figure
from studies.ablation.metrics import SINGLE_LAYERS, TABLE1, spread


def super_additivity(records: list[dict]) -> dict | None:
    """Per Table 1 column: the full system's factor, the single layers' (alone and multiplied)
    and the excess, each paired within a repeat and spread over the repeats; None where the run
    left out the full system or a single layer."""
    by = {(r["config"], r["repeat"]): r["figures"] for r in records}
    if not all((c, 0) in by for c in ("baseline", "full", *SINGLE_LAYERS)):
        return None
    repeats = sorted({r["repeat"] for r in records})
    result = {}
    for column, (name, lower_better) in TABLE1.items():

        def factor(config: str, repeat: int, name=name, lower_better=lower_better) -> float:
            ratio = by[(config, repeat)][name] / by[("baseline", repeat)][name]
            return 1 / ratio if lower_better else ratio

        full = [factor("full", k) for k in repeats]
        compounded = [math.prod(factor(c, k) for c in SINGLE_LAYERS) for k in repeats]
        excess = [f / c for f, c in zip(full, compounded, strict=True)]
        verdict = _verdict(full, excess)
        result[column] = {
            "figure": name,
            "full": spread(full),
            "compounded": spread(compounded),
            "singles": {c: spread([factor(c, k) for k in repeats]) for c in SINGLE_LAYERS},
            "excess": spread(excess),
            # One repeat has no spread, so its verdict cannot be told from noise.
            "verdict": verdict if len(repeats) > 1 else f"{verdict} (one repeat)",
        }
    return result


def _verdict(full: list[float], excess: list[float]) -> str:
    """Super-additive only where the full system gains and exceeds the compounded layers in
    every repeat: losses smaller than the compounded losses of the single layers are no gain."""
    if min(full) <= 1:
        return "no gain (the full system is not better than the baseline in every repeat)"
    if min(excess) > 1:
        return "super-additive"
    if max(excess) < 1:
        return "sub-additive"
    return "not distinguishable from additive"


def additivity_figures(result: dict | None, labels: dict) -> list[Figure]:
    """The factors as a result's figures (unit x, above 1 better), per column: the full
    system's, the single layers' compounded, and the excess, with their spread."""
    found = []
    for column, entry in (result or {}).items():
        for subject, key in (
            ("full system's gain factor", "full"),
            ("single layers' gain factors compounded", "compounded"),
            ("super-additivity excess", "excess"),
        ):
            s = entry[key]
            spread_of = {"sd": s["sd"], "min": s["min"], "max": s["max"]}
            at = labels | {"column": column}
            found.append(Figure(subject, s["mean"], "x", at, spread_of, s["n"]))
    return found
