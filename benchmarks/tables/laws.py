"""The control laws: entropy-stabilised sampling, entropic pruning and entropy-aware
scheduling."""

from benchmarks.layout import Claim, Column, Pick, Row, Table
from benchmarks.tables.common import AVX2, AVX512, H200, NOT_MEASURED, figure, ratio_vs

SAMPLERS = (
    "fixed T=1.0",
    "fixed T=0.7",
    "min-p 0.1",
    "mirostat v2 (tau 5 bits)",
    "EDT (theta 1, N 0.8)",
    "lagged law (the paper's), H*=2",
    "feedback, H*=2",
    "exact, H*=2",
)
SAMPLING = Pick(benchmark="sampling", kind=AVX2)
SAMPLERS_TABLE = Table(
    "sampling_samplers",
    ("sampler",),
    (
        Column("entropy mean (nats)", figure("entropy mean", "nats").under(Pick(decimals=2))),
        Column("sd", figure("entropy sd", "nats").under(Pick(decimals=2))),
        Column("tracking error (MAE)", figure("tracking mae", "nats").under(Pick(decimals=2))),
        Column("mean T", figure("temperature mean", "").under(Pick(decimals=2))),
        Column("loop rate", figure("loop rate", "").under(Pick(decimals=3))),
        Column("distinct-2", figure("distinct-2", "").under(Pick(decimals=3))),
        Column("self-BLEU", figure("self-bleu", "").under(Pick(decimals=3))),
    ),
    tuple(Row((s,), Pick(labels={"sampler": s})) for s in SAMPLERS),
    SAMPLING,
)
ESTIMATORS = (
    "exact, greedy rows",
    "exact, sampled rows",
    "top-k + tail bounds, k=64",
    "feedback law",
    "exact law",
)
OVERHEAD = Table(
    "sampling_overhead",
    ("batch", "estimator"),
    (
        Column("ms a step", figure("estimator cost", "ms")),
        Column("share of the decode step", figure("estimator cost", "%", vs="decode step")),
    ),
    tuple(
        Row((str(b), e), Pick(labels={"batch": b, "estimator": e}))
        for b in (1, 32)
        for e in ESTIMATORS
    ),
    SAMPLING,
)
ESTIMATOR_FIDELITY = Table(
    "sampling_estimators",
    ("k", "estimator"),
    (
        Column("mean error (nats)", figure("entropy mae", "nats")),
        Column("feedback step off by more than 1 %", figure("temperature differs", "%")),
    ),
    tuple(
        Row((str(k), e), Pick(labels={"k": k, "estimator": e}))
        for k in (64, 256)
        for e in ("top-k", "tail (midpoint)")
    ),
    SAMPLING,
)
QUARTER, LAW = "bound-quarter", "bound"
# The default model's runs: another model's carry its name (``setting_labels``).
PRUNING = Pick(benchmark="pruning", labels={"model": None})


def step(kind: str, batch: int, context: int | str, bounds: str | None = None) -> Pick:
    labels = {"batch": batch, "context": context} | ({"key_bounds": bounds} if bounds else {})
    return Pick(kind=kind, labels=labels)


PRUNED_STEP = Table(
    "pruning_speed",
    ("host", "batch", "context"),
    (
        Column("a quarter of the blocks", Pick(labels={"arm": QUARTER}), "quarter"),
        Column("the default law (`bound`)", Pick(labels={"arm": LAW})),
    ),
    (
        Row(
            (AVX2, "1", "about 7K, four documents"),
            step(AVX2, 1, "about 7K"),
            {"quarter": NOT_MEASURED},
        ),
        Row((AVX512, "1", "4,096"), step(AVX512, 1, 4096, "float32")),
        Row((AVX512, "1", "8,000"), step(AVX512, 1, 8000, "float16")),
        Row((AVX512, "8", "4,096"), step(AVX512, 8, 4096, "float32")),
        Row((AVX512, "8", "8,000"), step(AVX512, 8, 8000, "float16")),
        Row((H200, "1", "8,000"), step(H200, 1, 8000)),
        Row((H200, "8", "8,000"), step(H200, 8, 8000)),
    ),
    PRUNING.under(ratio_vs("decode step", "dense")),
)

FIDELITY_COLUMNS = (
    Column("blocks read", figure("blocks read", "%")),
    Column("KL mean (nats)", figure("kl", "nats")),
    Column("KL p99", figure("kl p99", "nats")),
    Column("top-1 vs dense", figure("top-1 agreement", "%")),
    Column("perplexity ratio", figure("perplexity ratio", "x")),
)
PRUNED_FIDELITY = Table(
    "pruning_fidelity",
    ("configuration",),
    FIDELITY_COLUMNS,
    tuple(
        Row((c,), Pick(labels={"arm": c}))
        for c in (
            "bound",
            "bound-fifth",
            "bound-half",
            "mass",
            "bound oracle",
            "bound-fifth oracle",
            "bound-half oracle",
        )
    ),
    PRUNING.under(Pick(kind=AVX2, labels={"batch": 8, "context": 6144})),
)
PRUNED_FIDELITY_GPU = Table(
    "pruning_fidelity_gpu",
    ("batch", "configuration"),
    (*FIDELITY_COLUMNS, Column("teacher-forced step against dense", figure("forced step", "x"))),
    tuple(
        Row((str(b), c), Pick(labels={"batch": b, "arm": c}))
        for b in (1, 8)
        for c in (LAW, QUARTER)
    ),
    PRUNING.under(Pick(kind=H200, labels={"context": 8000})),
)
PASSKEYS = Table(
    "pruning_passkeys",
    ("host", "lengths, haystack"),
    (
        Column("dense", Pick(labels={"arm": "dense"})),
        Column("`bound`", Pick(labels={"arm": LAW})),
        Column("a quarter of the blocks", Pick(labels={"arm": QUARTER}), "quarter"),
    ),
    (
        Row(
            (AVX2, "4K-8K, repeated"),
            Pick(kind=AVX2, labels={"context": "4K-8K"}),
            {"quarter": NOT_MEASURED},
        ),
        Row((H200, "8K, repeated"), Pick(kind=H200, labels={"context": "8K"})),
    ),
    PRUNING.under(figure("passkeys found", "count", haystack="repeated")),
)
HEADS = Table(
    "pruning_heads",
    ("blocks read", "scorer, budgets"),
    (
        Column("top-1 vs dense", figure("top-1 agreement", "%")),
        Column("KL mean (nats)", figure("kl", "nats")),
        Column("KL p99", figure("kl p99", "nats")),
        Column("perplexity ratio", figure("perplexity ratio", "x")),
        Column("step (ms; dense 141)", figure("decode step", "ms", vs=None), "step"),
    ),
    tuple(
        Row(
            (f"{share} %", s),
            Pick(labels={"blocks_read": share, "arm": s}),
            {} if i < 2 else {"step": "-"},
        )
        for share in (26, 54)
        for i, s in enumerate(
            (
                "bound",
                "bound, per-head budgets",
                "oracle ranking",
                "oracle ranking, per-head budgets",
            )
        )
    ),
    Pick(benchmark="fidelity", kind=AVX512, labels={"vs": "dense"}),
)


def step_table(
    name: str,
    arms: tuple[tuple[str, str], ...],
    kind: str,
    result: str | None = None,
    contexts: tuple[int, ...] = (1024, 2048, 4096, 8000),
    model: str | None = None,
) -> Table:
    """A decode step over dense's per (batch, context) at ``contexts`` tokens, a column per
    (header, arm), from the pruning runs of host ``kind`` (wall clock; ``result``: that run
    alone; ``model``: another model's runs)."""
    return Table(
        name,
        ("batch", "context"),
        tuple(Column(header, Pick(labels={"arm": arm}, decimals=2)) for header, arm in arms),
        tuple(
            Row((str(b), f"{c:,}"), Pick(labels={"batch": b, "context": c}))
            for b in (1, 8)
            for c in contexts
        ),
        Pick(
            kind=kind,
            subject="decode step",
            unit="x",
            labels={"vs": "dense", "clock": "wall", "model": model},
            result=result,
        ).under(PRUNING),
    )


REUSED_STEP = step_table(
    "pruning_reused_speed",
    (
        ("`bound`, a quarter", "bound-quarter"),
        ("`reused-mass`, a quarter", "reused-quarter"),
        ("`bound`", "bound"),
        ("`reused-mass`", "reused"),
    ),
    AVX512,
)

TARGETS = {
    "e2e mean": Claim("<=", 0.88),
    "e2e p99": Claim("<=", 1.10),
    "max queue time": Claim("<=", 1.10),
    "request throughput": Claim(">=", 1.0),
}
SCHEDULING = Table(
    "scheduling",
    ("setting",),
    (
        Column("mean latency", Pick(subject="e2e mean")),
        Column("p99", Pick(subject="e2e p99")),
        Column("longest queue", Pick(subject="max queue time")),
        Column("throughput", Pick(subject="request throughput")),
        Column(
            "targets hold",
            holds=(("mean latency", "p99", "longest queue", "throughput"),),
            key="holds",
        ),
    ),
    (
        Row(
            ("past saturation (2x capacity)",),
            Pick(benchmark="serving-sweep", labels={"setting": "2x capacity"}),
            claims=TARGETS,
        ),
        Row(
            ("heavy KV pressure",),
            Pick(benchmark="serving", labels={"setting": "heavy KV pressure"}),
            claims=TARGETS,
        ),
        Row(
            ("at capacity (1x)",),
            Pick(benchmark="serving-sweep", labels={"setting": "1x capacity"}),
            {"holds": "nothing queues to reorder"},
        ),
        Row(
            ("below (0.5x)",),
            Pick(benchmark="serving-sweep", labels={"setting": "0.5x capacity"}),
            {"holds": "nothing queues to reorder"},
        ),
    ),
    Pick(kind=AVX2, unit="x", labels={"vs": "fcfs"}),
)

TABLES = (
    SAMPLERS_TABLE,
    OVERHEAD,
    ESTIMATOR_FIDELITY,
    PRUNED_STEP,
    PRUNED_FIDELITY,
    PRUNED_FIDELITY_GPU,
    PASSKEYS,
    REUSED_STEP,
    HEADS,
    SCHEDULING,
)
