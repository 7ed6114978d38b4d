"""The seed systems: speculative decoding, Entropy Adaptive Decoding and EntropyInfer's sparse
prefill and KV compression."""

from benchmarks.layout import Column, Parts, Pick, Row, Table
from benchmarks.tables.common import AVX512, GEMMA, H200, figure, ratio_vs

SPEC = Pick(benchmark="speculative", kind=AVX512)


def drafted(setting: str) -> Parts:
    return Parts(
        (
            ratio_vs("decode", "plain", setting=setting),
            figure("acceptance", "%", setting=setting).under(Pick(suffix=" accepted")),
        ),
        ", ",
    )


SPEC_BATCH1 = Table(
    "spec_batch1",
    ("workload",),
    (
        Column("plain (tok/s)", figure("decode", "tok/s", setting="plain")),
        Column("n-gram, fixed length", drafted("ngram fixed")),
        Column("heuristic length", drafted("ngram heuristic")),
        Column("heuristic and the entropy gate (the default)", drafted("ngram entropy (default)")),
    ),
    tuple(Row((w,), Pick(labels={"workload": w})) for w in ("copy", "chat")),
    SPEC.under(Pick(labels={"batch": 1})),
)
SPEC_BATCHES = Table(
    "spec_batches",
    ("workload", "drafting"),
    (Column("batch 4", Pick(labels={"batch": 4})), Column("batch 16", Pick(labels={"batch": 16}))),
    tuple(
        Row((w, s), Pick(labels={"workload": w, "setting": s}))
        for w in ("copy", "chat")
        for s in ("ngram fixed", "ngram heuristic", "ngram entropy gate alone")
    ),
    SPEC.under(ratio_vs("decode", "plain")),
)
EXITS = tuple(
    f"self:{n}, {how}"
    for n in (8, 22, 26)
    for how in ("entropy (adapter)" if n == 8 else "entropy", "fixed length")
)
SPEC_EXIT = Table(
    "spec_early_exit",
    ("drafter: the first N layers",),
    (
        Column("chat", ratio_vs("decode", "plain", workload="chat")),
        Column("accepted", figure("acceptance", "%", workload="chat")),
        Column("copy", ratio_vs("decode", "plain", workload="copy")),
        Column("accepted", figure("acceptance", "%", workload="copy"), "copy accepted"),
    ),
    tuple(Row((e,), Pick(labels={"setting": e})) for e in EXITS),
    SPEC.under(Pick(labels={"batch": 1})),
)
# Each drafter with its drafts weighed against their measured cost (the default) and without.
COST_ARMS = (
    ("prompt lookup", "fixed length", "-", "ngram fixed"),
    ("prompt lookup", "heuristic", "yes", "ngram heuristic"),
    ("prompt lookup", "heuristic and entropy gate (default)", "yes", "ngram entropy (default)"),
    ("prompt lookup", "heuristic and entropy gate", "no", "ngram entropy, cost not weighed"),
    ("first 10 layers", "fixed length", "-", "self:10 fixed"),
    ("first 10 layers", "heuristic and entropy gate", "yes", "self:10 entropy"),
    ("first 10 layers", "heuristic and entropy gate", "no", "self:10 entropy, cost not weighed"),
    ("first 22 layers", "heuristic and entropy gate", "yes", "self:22 entropy"),
    ("first 22 layers", "heuristic and entropy gate", "no", "self:22 entropy, cost not weighed"),
)
# Where a setting drafted nothing in a workload, it has no acceptance.
NO_DRAFTS = {
    "self:10 entropy": ("copy accepted", "chat accepted"),
    "self:22 entropy": ("chat accepted",),
}
SPEC_COST = Table(
    "spec_cost_weighed",
    ("drafter", "length", "cost weighed"),
    tuple(
        column
        for w in ("copy", "chat")
        for column in (
            Column(w, Pick(subject="throughput", unit="x", labels={"workload": w, "vs": "plain"})),
            Column(
                "accepted",
                Pick(subject="acceptance", unit="%", decimals=0, labels={"workload": w}),
                f"{w} accepted",
            ),
        )
    ),
    tuple(
        Row(
            (drafter, length, weighed),
            Pick(labels={"arm": arm}),
            {cell: "-" for cell in NO_DRAFTS.get(arm, ())},
        )
        for drafter, length, weighed, arm in COST_ARMS
    ),
    Pick(
        benchmark="speculative",
        kind=AVX512,
        result="speculative/2026-11-29-b7d3c2e-cost-weighed-rounds.json",
        labels={"batch": 1},
        decimals=2,
    ),
)
# The same drafters where finished requests set where new sequences start (one run, 5 rounds):
# the ratio to plain decoding, and the tokens asked of the drafter per 100 generated, the
# median over rounds and the first round's (where the engine learns what its drafter earns).
START_REST_ARMS = (
    ("prompt lookup", "heuristic", "ngram heuristic"),
    ("prompt lookup", "heuristic and entropy gate (default)", "ngram entropy (default)"),
    ("first 10 layers", "heuristic and entropy gate", "self:10 entropy"),
    ("first 22 layers", "heuristic and entropy gate", "self:22 entropy"),
)
ASKED = Pick(subject="drafter tokens asked", unit="per 100", decimals=1, bare=True)


def start_rest_columns(workload: str) -> tuple[Column, ...]:
    on = Pick(labels={"workload": workload})
    ratio = Pick(subject="throughput", unit="x", decimals=2, labels={"vs": "plain"})
    return (
        Column(workload, ratio.under(on)),
        Column(
            "asked per 100",
            ASKED.under(Pick(labels={"workload": workload, "round": None})),
            f"{workload} asked",
        ),
        Column(
            "first round",
            ASKED.under(Pick(labels={"workload": workload, "round": "first"})),
            f"{workload} first",
        ),
    )


SPEC_START_REST = Table(
    "spec_start_rest",
    ("drafter", "length"),
    start_rest_columns("copy") + start_rest_columns("chat"),
    tuple(Row((d, length), Pick(labels={"arm": arm})) for d, length, arm in START_REST_ARMS),
    Pick(benchmark="speculative", kind=AVX512, labels={"batch": 1}),
)
EAD = Table(
    "ead_curve",
    ("setting",),
    (
        Column("large model's share", figure("large share", "%")),
        Column("passkeys", figure("passkey accuracy", "%")),
        Column("ROUGE-L", figure("rouge-l", "")),
        Column("perplexity", figure("perplexity", "")),
        Column("quality vs large", figure("quality", "%")),
        Column("wall time", figure("wall time", "x")),
    ),
    tuple(
        Row((s,), Pick(labels={"setting": s}))
        for s in (
            "large alone",
            *(f"EAD threshold {t}" for t in ("0.5", "1", "1.5", "2", "3", "5")),
        )
    ),
    Pick(benchmark="switching", kind=AVX512),
)

LONG = Pick(benchmark="longcontext")
SPARSE = Table(
    "sparse_prefill",
    ("arm", "tokens"),
    (
        Column("time to first token (s)", figure("ttft", "s")),
        Column("vs dense", ratio_vs("ttft", "dense")),
        Column("blocks skipped", figure("blocks skipped", "%")),
        Column("passkeys", figure("passkeys found", "count"), "passkeys"),
        Column("top-1 vs dense", figure("top-1 agreement", "%")),
        Column("KL (nats)", figure("kl", "nats")),
    ),
    tuple(
        Row(
            (a, f"{t:,}"),
            Pick(labels={"arm": a, "tokens": t}),
            {"passkeys": "-"} if "uniform" in a else {},
        )
        for a in ("dense", "sparse prefill", "uniform 868 (CritiPrefill-like)")
        for t in (7168, 8064)
    ),
    LONG.under(Pick(kind=AVX512)),
)
COMPRESSION_ARMS = (
    "kv compression",
    "all (sparse prefill + compression)",
    "N_d = 0 (SnapKV-like)",
    "attention only (no novel keys)",
    "the question votes",
)
COMPRESSION = Table(
    "kv_compression",
    ("arm, 8,064 tokens",),
    (
        Column("time to first token vs dense", ratio_vs("ttft", "dense")),
        Column("decode (tok/s)", figure("decode", "tok/s")),
        Column("KV blocks", figure("kv blocks", "count")),
        Column("passkeys at 7,168", figure("passkeys found", "count", tokens=7168)),
        Column("at 8,064", figure("passkeys found", "count")),
        Column("top-1 vs dense", figure("top-1 agreement", "%")),
        Column("KL (nats)", figure("kl", "nats")),
    ),
    tuple(Row((a,), Pick(labels={"arm": a})) for a in COMPRESSION_ARMS),
    LONG.under(Pick(kind=AVX512, labels={"tokens": 8064})),
)
PRESSURE = Table(
    "kv_pressure",
    ("arm",),
    (
        Column("wall (s)", figure("wall time", "s")),
        Column("in prefill steps (s)", figure("prefill steps time", "s")),
        Column("output tok/s", figure("throughput", "tok/s")),
        Column("vs dense", ratio_vs("throughput", "dense")),
        Column("were decode free", ratio_vs("throughput bound", "dense")),
        Column("mean batch", figure("mean batch", "")),
        Column("KV blocks a request", figure("kv blocks per request", "count")),
    ),
    tuple(
        Row((a,), Pick(labels={"arm": a}))
        for a in ("dense", "kv compression", "all (sparse prefill + compression)")
    ),
    LONG.under(Pick(kind=AVX512, labels={"workload": "KV pressure"})),
)
GEMMA_COMPRESSION = Table(
    "kv_compression_gemma",
    ("arm, 3,072 tokens",),
    (
        Column("KV blocks", figure("kv blocks", "count")),
        Column("top-1 vs dense", figure("top-1 agreement", "%")),
        Column("KL (nats)", figure("kl", "nats")),
        Column("decode (tok/s)", figure("decode", "tok/s")),
    ),
    tuple(
        Row((a,), Pick(labels={"arm": a}))
        for a in (
            "dense",
            "kv compression",
            "N_d = 0 (voted by the prompt alone)",
            "ranked by attention alone",
            "the question votes",
        )
    ),
    LONG.under(Pick(kind=AVX512, labels={"model": GEMMA})),
)
SPARSE_GPU = Table(
    "sparse_prefill_gpu",
    ("arm, 8,064 tokens",),
    (
        Column("time to first token (s)", figure("ttft", "s")),
        Column("vs dense", ratio_vs("ttft", "dense")),
        Column("top-1 vs dense", figure("top-1 agreement", "%")),
        Column("KL (nats)", figure("kl", "nats")),
        Column("decode after (tok/s)", figure("decode", "tok/s")),
    ),
    tuple(
        Row((a,), Pick(labels={"arm": a}))
        for a in ("dense", "sparse prefill", "sparse prefill, uniform budget")
    ),
    LONG.under(Pick(kind=H200)),
)

TABLES = (
    SPEC_BATCH1,
    SPEC_BATCHES,
    SPEC_EXIT,
    SPEC_COST,
    SPEC_START_REST,
    EAD,
    SPARSE,
    COMPRESSION,
    PRESSURE,
    GEMMA_COMPRESSION,
    SPARSE_GPU,
)
