"""The paper's Table 1 on each workload and host: every configuration against the baseline."""

from benchmarks.layout import Column, Pick, Row, Table
from benchmarks.tables.common import AVX512, H200, figure

ARMS = (
    ("Sampling only", "sampling"),
    ("Scheduling only", "scheduling"),
    ("Attention only", "attention"),
    ("Full system", "full"),
    ("etinfer full", "etinfer full"),
)
PAPER = {
    "sampling": "0.98 / 1.02 / 1.08 / 1.00",
    "scheduling": "0.88 / 1.15 / 1.12 / 1.00",
    "attention": "0.85 / 1.20 / 1.25 / 0.98",
    "full": "0.70 / 1.40 / 1.55 / 1.00",
    "etinfer full": "not in the paper",
}
RATIOS = (
    Column("latency", Pick(subject="latency")),
    Column("throughput", Pick(subject="throughput")),
    Column("η", Pick(subject="eta")),
    Column("quality", Pick(subject="quality")),
)


def cpu_table(name: str, workload: str, concurrency: int | None = None) -> Table:
    """``concurrency``: a closed loop of that many clients (throughput is capacity); None:
    the workload's own arrivals."""
    return Table(
        name,
        ("configuration", "the paper: latency / throughput / η / quality"),
        RATIOS,
        tuple(Row((text, PAPER[arm]), Pick(labels={"arm": arm})) for text, arm in ARMS),
        Pick(
            benchmark="ablation",
            kind=AVX512,
            unit="x",
            decimals=2,
            # All arms ran (no "arms" label).
            labels={
                "workload": workload,
                "vs": "baseline",
                "arms": None,
                "concurrency": concurrency,
            },
        ),
    )


MIXED = cpu_table("table1_mixed", "mixed")
LONG = cpu_table("table1_long", "long")
MIXED_CAPACITY = cpu_table("table1_mixed_capacity", "mixed", 8)

MIXED_FIGURES = Table(
    "table1_mixed_figures",
    ("configuration",),
    (
        Column(
            "latency per output token (ms, CPU clock)", figure("latency per output token", "ms")
        ),
        Column("KV bytes read per decode step (MB)", figure("kv read per decode step", "MB")),
        Column("CPU time stepping the engine (s)", figure("cpu time stepping", "s")),
    ),
    (
        Row(("Baseline",), Pick(labels={"arm": "baseline"})),
        *(Row((text,), Pick(labels={"arm": arm})) for text, arm in ARMS),
    ),
    Pick(
        benchmark="ablation",
        kind=AVX512,
        labels={"workload": "mixed", "arms": None, "concurrency": None},
    ),
)


# The long workload in a closed loop of 8 clients, with the scheduler taking the policy's order
# alone and with decode rows first, each run its baseline beside the arms.
ORDERINGS = (
    ("the policy's order alone", "ablation/2026-11-29-c0f729e-long-order-alone.json"),
    ("decode rows first", "ablation/2026-11-29-a11824d-long-decodes-first.json"),
)
ETINFER_LONG = "ablation/2026-11-29-bf504bb-long-etinfer-c8.json"  # beside a baseline of its own
LONG_ORDERING = Table(
    "table1_long_ordering",
    ("scheduler", "configuration"),
    (
        Column("latency (x baseline)", Pick(subject="latency", unit="x")),
        Column("time per output token (x)", Pick(subject="time per output token", unit="x")),
        Column("throughput, capacity (x)", Pick(subject="throughput", unit="x")),
        Column(
            "running sequences left out per step",
            Pick(
                subject="running sequences left out per step",
                unit="",
                labels={"vs": None},
                decimals=3,
            ),
        ),
        Column(
            "CPU in steps with a prompt chunk (%)",
            Pick(subject="cpu share of steps with a prompt chunk", unit="%", labels={"vs": None}),
        ),
    ),
    (
        *(
            Row((order, text), Pick(result=result, labels={"arm": arm}))
            for order, result in ORDERINGS
            for text, arm in (("Scheduling only", "scheduling"), ("Full system", "full"))
        ),
        Row(
            ("decode rows first", "etinfer full"),
            Pick(result=ETINFER_LONG, labels={"arm": "etinfer full"}),
        ),
    ),
    # One repeat each: the value alone (no spread to show).
    Pick(benchmark="ablation", decimals=2, bare=True, labels={"vs": "baseline"}),
)

# The scored long workload (66 cases) in a closed loop of 8 clients: quality with the 95 %
# interval of its cases drawn again, and its parts.
ABSOLUTE = {"vs": None}
LONG_SCORED = Table(
    "table1_long_scored",
    ("configuration",),
    (
        Column("quality (x baseline)", Pick(subject="quality", unit="x", bare=False), "quality"),
        Column("passkeys found (%)", Pick(subject="passkey accuracy", unit="%", labels=ABSOLUTE)),
        Column(
            "ROUGE-L against the human text",
            Pick(subject="rouge-l against the human text", unit="", labels=ABSOLUTE, decimals=3),
        ),
        Column(
            "perplexity of the forced human text",
            Pick(subject="perplexity of the forced human text", unit="", labels=ABSOLUTE),
        ),
        Column(
            "KV bytes read per decode step (MB)",
            Pick(subject="kv read per decode step", unit="MB", labels=ABSOLUTE, decimals=1),
        ),
        Column("throughput, capacity (x)", Pick(subject="throughput", unit="x"), "capacity"),
    ),
    (
        Row(
            ("Baseline",),
            Pick(labels={"arm": "baseline", "vs": None}),
            {"quality": "the reference", "capacity": "the reference"},
        ),
        Row(("Attention only",), Pick(labels={"arm": "attention"})),
        Row(("Full system",), Pick(labels={"arm": "full"})),
    ),
    Pick(
        benchmark="ablation",
        result="ablation/2026-11-29-a11824d-long-scored-c8.json",
        decimals=2,
        bare=True,
        labels={"vs": "baseline"},
    ),
)

# Super-additivity in a closed loop of 8 clients, 3 repeats: each workload on each model:
# the full system's gain factor, the single layers' compounded, and the excess (above 1 better).
ADDITIVITY_RUNS = (
    ("SmolLM2-135M", "ablation/2026-11-28-9b63c6dcf717-mixed-capacity-c8.json"),
    ("Gemma 3 270M", "ablation/2026-11-29-57d1fa0-gemma-mixed-capacity-c8.json"),
    ("SmolLM2-135M, long workload", "ablation/2026-11-29-65695c0-long-capacity-c8.json"),
    ("Gemma 3 270M, long workload", "ablation/2026-11-29-2fd35ca-gemma-long-capacity-c8.json"),
)
# Capacity by the number of clients of the closed loop (8 and 64 three repeats each, 4 and 16
# one): the baseline's tokens per CPU-second, each other arm's ratio to it.
CLIENTS = (4, 8, 16, 64)
ONE_REPEAT = (4, 16)
MIXED_CLIENTS = Table(
    "table1_mixed_clients",
    ("configuration",),
    # A single repeat's figures alone: its "spread" of 0 would read as a precision.
    tuple(
        Column(
            f"{n} clients", Pick(labels={"concurrency": n}, bare=n in ONE_REPEAT or None), str(n)
        )
        for n in CLIENTS
    ),
    (
        Row(("Baseline",), Pick(unit="tok/s", decimals=1, labels={"arm": "baseline"})),
        *(
            Row((text,), Pick(unit="x", labels={"arm": arm, "vs": "baseline"}))
            for text, arm in ARMS
        ),
    ),
    Pick(
        benchmark="ablation",
        kind=AVX512,
        subject="throughput",
        decimals=2,
        labels={"workload": "mixed", "arms": None},
    ),
)
ADDITIVITY = Table(
    "table1_additivity",
    ("model", "column"),
    (
        Column("full system (x)", Pick(subject="full system's gain factor")),
        Column(
            "single layers compounded (x)", Pick(subject="single layers' gain factors compounded")
        ),
        Column("excess (x)", Pick(subject="super-additivity excess")),
    ),
    tuple(
        Row((model, column), Pick(result=result, labels={"column": column}))
        for model, result in ADDITIVITY_RUNS
        for column in ("latency", "throughput", "eta", "quality")
    ),
    Pick(benchmark="ablation", unit="x", decimals=2),
)

SWEPT_RATES = (0.15, 0.25, 0.35)
GOODPUT = Table(
    "table1_mixed_goodput",
    ("configuration",),
    (
        *(
            Column(
                f"SLO met at {rate} req/s",
                Pick(subject="slo attainment", unit="%", labels={"rate": rate}, decimals=0),
                str(rate),
            )
            for rate in SWEPT_RATES
        ),
        Column("goodput (req/s) at 0.35", figure("goodput", "req/s", rate=0.35), "goodput"),
    ),
    (
        Row(("Baseline",), Pick(labels={"arm": "baseline"})),
        # The sweep labels each arm by its configuration's name ("etinfer", not "etinfer full").
        *(Row((text,), Pick(labels={"arm": arm.split()[0]})) for text, arm in ARMS),
    ),
    Pick(
        benchmark="ablation",
        kind=AVX512,
        labels={"workload": "mixed", "slo_ttft_s": 15.0},
        decimals=2,
    ),
)


def gpu(workload: str, subject: str) -> Pick:
    return Pick(subject=subject, labels={"workload": workload})


GPU = Table(
    "table1_gpu",
    ("configuration",),
    (
        Column("mixed: latency", gpu("mixed", "latency")),
        Column("throughput", gpu("mixed", "throughput")),
        Column("long: latency", gpu("long", "latency")),
        Column("throughput", gpu("long", "throughput"), "long throughput"),
    ),
    tuple(Row((text,), Pick(labels={"arm": arm})) for text, arm in ARMS),
    Pick(benchmark="ablation", kind=H200, unit="x", labels={"vs": "baseline", "arms": None}),
)

TABLES = (
    MIXED,
    LONG,
    LONG_ORDERING,
    LONG_SCORED,
    MIXED_FIGURES,
    MIXED_CAPACITY,
    MIXED_CLIENTS,
    ADDITIVITY,
    GOODPUT,
    GPU,
)
