"""The pruning section's tables of scorers and budget laws side by side: teacher-forced
fidelity at their measured reads and cost, and the passkeys each keeps."""

import re

from benchmarks.layout import Column, Pick, Row, Table
from benchmarks.tables.common import AVX512, HELD, figure
from benchmarks.tables.laws import step_table
from benchmarks.tables.table1 import PAPER, RATIOS

# On the defaults: 16-token blocks, the file's own weights (``setting_labels``).
FORCED = {
    "workload": "teacher-forced", "batch": 4, "context": 6144, "block_size": None,
    "quantization": None, "key_copy": None,
}  # fmt: skip


def forced(subject: str, unit: str, decimals: int, **labels) -> Pick:
    """A figure of the teacher-forced run at ``FORCED``'s setting."""
    return Pick(subject=subject, unit=unit, labels=FORCED | labels, decimals=decimals)


# (scorer, budget law, its setting) and the study's name for the arm
LAW_ARMS = (
    *(("`bound`", "entropy (paper)", "12.5-50 %", "bound"),),
    *(("`bound`", "fixed share", f"{s * 100:g} %", f"bound-share-{s}") for s in (0.125, 0.2, 0.35)),
    *(("`bound`", "fixed tokens (Quest)", f"{t}", f"bound-fixed-{t}") for t in (512, 1024, 2048)),
    *(
        ("oracle ranking", law, setting, f"{arm} oracle")
        for law, setting, arm in (
            ("entropy (paper)", "12.5-50 %", "bound"),
            ("fixed share", "12.5 %", "bound-share-0.125"),
            ("fixed share", "20 %", "bound-share-0.2"),
            ("fixed tokens (Quest)", "1024", "bound-fixed-1024"),
        )
    ),
    *(
        (f"sketch, {c} channels", "fixed share", f"{s * 100:g} %", f"bound-share-{s} sketch-{c}")
        for c in (8, 16)
        for s in (0.125, 0.2)
    ),
    *(
        (
            f"sketch, {c} fixed channels",
            "fixed share",
            f"{s * 100:g} %",
            f"bound-share-{s} fixed-sketch-{c}",
        )
        for c in (8, 16)
        for s in (0.125, 0.2)
    ),
    *(
        (
            "`reused-mass`",
            "entropy (paper)",
            f"{lo * 100:g}-{hi * 100:g} %",
            f"reused-entropy-{lo}-{hi}",
        )
        for lo, hi in ((0.05, 0.3), (0.1, 0.5), (0.2, 0.6))
    ),
    *(
        ("`reused-mass`", "fixed share", f"{s * 100:g} %", f"reused-share-{s}")
        for s in (0.125, 0.2, 0.35)
    ),
    *(
        ("`reused-mass`", "fixed tokens (Quest)", f"{t}", f"reused-fixed-{t}")
        for t in (512, 1024, 2048)
    ),
    *(
        ("`reused-mass`", "top-p (Twilight)", f"p {p}", f"reused-top-p-{p}")
        for p in (0.8, 0.9, 0.99)
    ),
    *(
        ("`reused-mass`", "entropy + top-p", f"p {p}", f"reused-entropy+top-p-{p}")
        for p in (0.8, 0.9, 0.99)
    ),
    *(
        ("`reused-mass`", "attention entropy", f"{lo * 100:g}-{hi * 100:g} %", name)
        for lo, hi in ((0.05, 0.3), (0.1, 0.5), (0.2, 0.6))
        for name in (f"reused-attention-entropy-{lo}-{hi}",)
    ),
)
# A sketch reads its channels of every key besides the blocks it keeps; ranked in torch from the
# cache, its step is not a kernel's.
SKETCH = {"KV bytes read": forced("kv bytes read", "%", 0), "step": "-"}
# (Runs from commit 3625945 on label the share read as against dense's reads.)
FIXED_SKETCH = {"KV bytes read": forced("kv bytes read", "%", 0, vs="dense"), "step": "-"}
BUDGET_LAWS = Table(
    "pruning_budget_laws",
    ("ranking", "budget law", "setting"),
    (
        Column("KV bytes read", forced("blocks kept", "%", 0, vs=None)),
        Column("KL mean (nats)", forced("kl", "nats", 4)),
        Column("top-1 vs dense", forced("top-1 agreement", "%", 1)),
        Column("perplexity ratio", forced("perplexity", "x", 3)),
        Column("step vs dense", forced("decode step", "x", 2), "step"),
    ),
    tuple(
        Row(
            (scorer, law, setting),
            Pick(labels={"arm": arm}),
            {"step": "-"}
            if scorer == "oracle ranking"
            else FIXED_SKETCH
            if "fixed-sketch" in arm
            else SKETCH
            if "sketch" in arm
            else {},
        )
        for scorer, law, setting, arm in LAW_ARMS
    ),
    Pick(benchmark="fidelity", kind=AVX512, labels={"vs": "dense"}),
)
# (ranking, blocks kept by reused masses, the addition) and the study's name for the arm
ADDED_ARMS = (
    *(("oracle ranking", f"{s * 100:g} %", "-", f"bound-share-{s} oracle") for s in (0.125, 0.2)),
    *(("`bound`", f"{s * 100:g} %", "-", f"bound-share-{s}") for s in (0.125, 0.2)),
    *(
        (f"key mean + {k} spreads", f"{s * 100:g} %", "-", f"bound-share-{s} mean-spread-{k}")
        for k in (0, 1, 2)
        for s in (0.125, 0.2)
    ),
    *(
        ("`reused-mass`", f"{s * 100:g} %", added, f"reused-share-{s}{suffix}")
        for s in (0.08, 0.125, 0.2)
        for added, suffix in (
            ("-", ""),
            ("5 % of KV heads dense", " roles-0.05"),
            ("10 % of KV heads dense", " roles-0.1"),
            ("5 % of blocks by own key bounds", " own-bounds-0.05"),
            ("10 % of blocks by own key bounds", " own-bounds-0.1"),
        )
    ),
)
# Rankings computed in torch from the cache, to measure what they would choose: no kernel's step.
MEASURING = re.compile("oracle|mean-spread")
ADDED = Table(
    "pruning_added_rankings",
    ("ranking", "share of blocks", "added"),
    BUDGET_LAWS.columns,
    tuple(
        Row(row, Pick(labels={"arm": arm}), {"step": "-"} if MEASURING.search(arm) else {})
        for *row, arm in ADDED_ARMS
    ),
    BUDGET_LAWS.pick,
)
# The digest as the engine's scorer, in one run beside the rankings it is measured against.
DIGEST_ARMS = (
    ("`digest`, two spreads", "entropy (paper)", "12.5-50 %", "digest"),
    *(
        ("`digest`, two spreads", "fixed share", f"{s * 100:g} %", f"digest-share-{s}")
        for s in (0.125, 0.2)
    ),
    *(("`bound`", "fixed share", f"{s * 100:g} %", f"bound-share-{s}") for s in (0.125, 0.2)),
    ("`reused-mass`", "entropy (paper)", "12.5-50 %", "reused"),
    ("`reused-mass`", "fixed share", "12.5 %", "reused-share-0.125"),
    *(
        ("oracle ranking", "fixed share", f"{s * 100:g} %", f"bound-share-{s} oracle")
        for s in (0.125, 0.2)
    ),
)
DIGEST = Table(
    "pruning_digest",
    ("ranking", "budget law", "setting"),
    BUDGET_LAWS.columns,
    tuple(
        Row(row, Pick(labels={"arm": arm}), {"step": "-"} if "oracle" in arm else {})
        for *row, arm in DIGEST_ARMS
    ),
    BUDGET_LAWS.pick,
)
OWN_DIGEST = Table(
    "pruning_own_digest",
    ("blocks kept by reused masses", "added"),
    BUDGET_LAWS.columns,
    tuple(
        Row((f"{s * 100:g} %", added), Pick(labels={"arm": f"reused-share-{s}{suffix}"}))
        for s in (0.08, 0.125)
        for added, suffix in (
            ("-", ""),
            ("5 % of blocks by own key bounds", " own-bounds-0.05"),
            ("10 % of blocks by own key bounds", " own-bounds-0.1"),
            ("5 % of blocks by own key digest", " own-digest-0.05"),
            ("10 % of blocks by own key digest", " own-digest-0.1"),
        )
    ),
    BUDGET_LAWS.pick,
)
GEMMA_ARMS = (
    ("`bound`, entropy law", "bound"),
    ("`bound`, a fifth", "bound-share-0.2"),
    ("`reused-mass`, entropy law (default: selects at layer 5)", "reused"),
    ("`reused-mass`, 12.5 % of the blocks", "reused-share-0.125"),
    ("oracle ranking, entropy law", "bound oracle"),
    ("oracle ranking, a fifth", "bound-share-0.2 oracle"),
)
GEMMA = Table(
    "pruning_gemma",
    ("context, batch", "configuration"),
    (
        Column("KV bytes read", Pick(subject="kv bytes read", unit="%", decimals=0)),
        Column("KL mean (nats)", Pick(subject="kl", unit="nats", decimals=4)),
        Column("top-1 vs dense", Pick(subject="top-1 agreement", unit="%", decimals=1)),
        Column("perplexity ratio", Pick(subject="perplexity", unit="x", decimals=3)),
        Column("step vs dense", Pick(subject="decode step", unit="x", decimals=2), "step"),
    ),
    tuple(
        Row(
            (f"{context:,}, {batch}", name),
            Pick(labels={"arm": arm, "context": context, "batch": batch}),
            {"step": "-"} if "oracle" in arm else {},
        )
        for context, batch, arms in (
            (8192, 4, GEMMA_ARMS),
            (16384, 2, GEMMA_ARMS),
            (32000, 1, tuple(a for a in GEMMA_ARMS if a[1] in ("bound", "reused", "bound oracle"))),
        )
        for name, arm in arms
    ),
    Pick(
        benchmark="fidelity",
        kind=AVX512,
        labels={
            "workload": "teacher-forced",
            "vs": "dense",
            "block_size": None,
            "quantization": None,
            "key_copy": None,
        },
    ),
)
PASSKEY_ARMS = (
    ("dense", "dense"),
    ("`bound`, entropy law (default until now)", "bound"),
    ("`bound`, a fifth", "bound-share-0.2"),
    ("`reused-mass`, entropy law (default)", "reused"),
    ("`reused-mass`, 12.5 % of the blocks", "reused-share-0.125"),
    ("`reused-mass`, entropy law 5-30 %", "reused-entropy-0.05-0.3"),
    ("`reused-mass`, top-p 0.9", "reused-top-p-0.9"),
)
PASSKEYS_BY_LAW = Table(
    "pruning_passkeys_by_law",
    ("configuration",),
    (
        Column("repeated haystack", figure("passkeys found", "count", workload="repeated")),
        Column("real prose", figure("passkeys found", "count", workload="varied")),
    ),
    tuple(Row((name,), Pick(labels={"arm": arm})) for name, arm in PASSKEY_ARMS),
    Pick(
        benchmark="fidelity", kind=AVX512, result="fidelity/2026-11-28-19b6207-passkeys-by-law.json"
    ),
)
DIGEST_PASSKEYS = Table(
    "pruning_digest_passkeys",
    ("configuration",),
    PASSKEYS_BY_LAW.columns,
    tuple(
        Row((name,), Pick(labels={"arm": arm}))
        for name, arm in (
            ("dense", "dense"),
            ("`digest`, entropy law", "digest"),
            ("`digest`, a fifth", "digest-share-0.2"),
            ("`digest`, 12.5 % of the blocks", "digest-share-0.125"),
            ("`reused-mass`, entropy law (default)", "reused"),
        )
    ),
    Pick(
        benchmark="fidelity", kind=AVX512, result="fidelity/2026-11-28-f6fba14-digest-passkeys.json"
    ),
)
CROSSING = step_table(
    "pruning_crossing_held",
    (
        ("`bound`, from any context", "bound-ungated"),
        ("`reused-mass`, from any context", "reused-ungated"),
        ("`reused-mass`, the default (dense below 2,048)", "reused"),
    ),
    HELD,
    "pruning/2026-11-28-43c8aec-crossing-avx2-held.json",
)
# The same against a dense step in one native call (its pruned steps layer by layer).
CROSSING_ONE_CALL = step_table(
    "pruning_crossing_one_call",
    (
        ("`reused-mass`, from any context", "reused-ungated"),
        ("`reused-mass`, dense below 2,048 (the default then)", "reused"),
    ),
    HELD,
    "pruning/2026-11-28-16f47bc-crossing-one-call-avx2-held.json",
)
# Pruned steps of reused masses in native calls too, one per run of layers reading the same blocks.
CROSSING_NATIVE = step_table(
    "pruning_crossing_native",
    (
        ("`reused-mass`, from any context", "reused-ungated"),
        ("`reused-mass`, the default (dense below 3,072; from 8 sequences 1,024)", "reused"),
    ),
    HELD,
    "pruning/2026-11-28-2e8c739-crossing-native-avx2-held.json",
    contexts=(1024, 2048, 3072, 4096, 8000),
)
DIGEST_STEP = step_table(
    "pruning_digest_speed",
    (
        ("`digest`, from any context", "digest-ungated"),
        ("`reused-mass`, from any context", "reused-ungated"),
        ("`digest`, the default (dense below 4,096)", "digest"),
    ),
    AVX512,
)
GEMMA_STEP = step_table(
    "pruning_gemma_speed",
    (
        ("`reused-mass`, from any context", "reused-ungated"),
        ("`reused-mass`, the default (dense below 3,072; from 8 sequences 1,024)", "reused"),
    ),
    AVX512,
    "pruning/2026-11-29-3ffa12e-gemma-speed.json",
    contexts=(2048, 4096, 8192, 16384),
    model="gemma-3-270m",
)
ATTENTION_ROW = Table(
    "pruning_table1_long",
    ("configuration", "the paper: latency / throughput / η / quality"),
    RATIOS,
    (
        Row(
            ("Attention only (`reused-mass`)", PAPER["attention"]),
            Pick(labels={"arm": "attention"}),
        ),
    ),
    Pick(
        benchmark="ablation",
        kind=AVX512,
        unit="x",
        labels={"workload": "long", "vs": "baseline", "arms": "baseline attention"},
        decimals=2,
    ),
)
TABLES = (
    BUDGET_LAWS,
    ADDED,
    DIGEST,
    PASSKEYS_BY_LAW,
    DIGEST_PASSKEYS,
    OWN_DIGEST,
    GEMMA,
    CROSSING,
    CROSSING_ONE_CALL,
    CROSSING_NATIVE,
    DIGEST_STEP,
    GEMMA_STEP,
    ATTENTION_ROW,
)
