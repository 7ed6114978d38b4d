"""Serving (structured output, the server under load, replicas, abusive clients) and
robustness (the calibration stress test, estimators in the loop, the feedback law's bound)."""

from benchmarks.layout import Column, Parts, Pick, Row, Table
from benchmarks.tables.common import AVX2, AVX512, figure, ratio_vs

FREE = Pick(prefix="(", suffix=" free)")
STRUCTURED = Table(
    "structured",
    ("decoding",),
    (
        Column("batch 1 (tok/s)", Pick(labels={"batch": 1}), "batch 1"),
        Column("batch 16", Pick(labels={"batch": 16})),
    ),
    tuple(
        Row(
            (a,),
            Pick(labels={"arm": a}),
            {}
            if a == "unconstrained"
            else {
                b: Parts(
                    (Pick(labels={"batch": n}), ratio_vs("decode", "free", batch=n).under(FREE)),
                    " ",
                )
                for b, n in (("batch 1", 1), ("batch 16", 16))
            },
        )
        for a in (
            "constrained, jump-forward off (the default)",
            "constrained, jump-forward on",
            "unconstrained",
        )
    ),
    Pick(benchmark="structured", kind=AVX512).under(figure("decode", "tok/s")),
)


def three(subject: str) -> Parts:
    return Parts(tuple(figure(f"{subject} {s}", "ms") for s in ("mean", "p50", "p99")))


SERVER = Table(
    "server_load",
    ("offered (req/s)",),
    (
        Column("done", figure("requests done", "count")),
        Column("req/s", figure("request throughput", "req/s")),
        Column("output tok/s", figure("throughput", "tok/s")),
        Column("TTFT mean / p50 / p99 (ms)", three("ttft")),
        Column("TPOT", three("tpot")),
        Column("ITL", three("itl")),
        Column("end to end", three("e2e")),
    ),
    tuple(Row((str(r),), Pick(labels={"rate": r})) for r in (1, 4)),
    Pick(benchmark="server", kind=AVX2),
)

ONE, POW2, BACKLOG = (
    "1 replica x 2 threads",
    "2 replicas x 1 thread, pow2",
    "2 replicas x 1 thread, backlog",
)
REPLICAS = Table(
    "replicas",
    ("trace", "arm"),
    (
        Column("output tok/s", figure("throughput", "tok/s")),
        Column("TTFT mean / p99 (s)", Parts((figure("ttft mean", "s"), figure("ttft p99", "s")))),
        Column("TPOT mean (s)", figure("tpot mean", "s")),
        Column(
            "end to end mean / p50 / p99 (s)",
            Parts(tuple(figure(f"e2e {s}", "s") for s in ("mean", "p50", "p99"))),
        ),
    ),
    (
        *(
            Row((f"seed 1 ({r})", a), Pick(labels={"repeat": r, "arm": a}))
            for r in ("a", "b")
            for a in (ONE, POW2)
        ),
        *(
            Row((t, a), Pick(labels={"trace": t, "arm": a}))
            for t in ("seed 1", "seed 2", "shared prefixes")
            for a in (POW2, BACKLOG)
        ),
    ),
    Pick(benchmark="serving", kind=AVX512),
)

NEW, OLD = "with request limits", "4f3002c (before them)"
ABUSE = Table(
    "abuse",
    ("abusive request",),
    (
        Column("with limits: status", figure("status", "", tree=NEW)),
        Column("a small request waits at most (s)", figure("small request max", "s", tree=NEW)),
        Column("before: status", figure("status", "", tree=OLD)),
        Column("answered in (s)", figure("answered in", "s", tree=OLD)),
        Column(
            "a small request waits at most", figure("small request max", "s", tree=OLD), "old max"
        ),
    ),
    tuple(
        Row((r,), Pick(labels={"request": r}))
        for r in (
            "prompt 20 MB",
            "chat 50 MB",
            "prompt 3 MB",
            "prompt 650 KB",
            "100k stop strings",
            "nested 100k deep",
        )
    ),
    Pick(benchmark="abuse", kind=AVX512),
)
STOPS = Table(
    "abuse_stops",
    ("stop strings that never match",),
    (
        Column("with limits (µs a token)", Pick(labels={"tree": NEW})),
        Column("4f3002c", Pick(labels={"tree": OLD})),
    ),
    tuple(Row((f"{n:,}",), Pick(labels={"stop_strings": n})) for n in (0, 16, 1000, 100000)),
    Pick(benchmark="abuse", kind=AVX512).under(figure("stop matching", "us")),
)

ARMS = ("no guards", "guards", "calibration", "both")
STRESS = Pick(benchmark="stress", kind=AVX512)
STRESS_TABLE = Table(
    "stress",
    ("stress",),
    tuple(
        Column(
            f"{arm}: blocks / ROUGE-L",
            Parts((figure("blocks read", "%", arm=arm), figure("rouge-l", "", arm=arm))),
        )
        for arm in ARMS
    ),
    tuple(
        Row((s,), Pick(labels={"stress": s}))
        for s in (
            "none",
            "scale 0.5",
            "scale 0.75",
            "scale 1.5",
            "scale 2",
            "bias -1 nat",
            "bias +1 nat",
        )
    ),
    STRESS,
)
STRESS_PASSKEYS = Table(
    "stress_passkeys",
    ("stress",),
    tuple(Column(arm, Pick(labels={"arm": arm})) for arm in ARMS),
    tuple(
        Row((s,), Pick(labels={"stress": s})) for s in ("none", "scale 1.5", "scale 2", "bias -1")
    ),
    STRESS.under(figure("passkeys found", "count")),
)
ESTIMATORS = Table(
    "stress_estimators",
    ("estimator",),
    (
        Column("blocks read", figure("blocks read", "%")),
        Column("scheduling decisions changed", figure("scheduling decisions changed", "%")),
        Column("throughput vs exact", ratio_vs("throughput", "exact")),
        Column("passkeys", figure("passkeys found", "count")),
        Column("ROUGE-L vs layers off", figure("rouge-l", "")),
    ),
    tuple(Row((e,), Pick(labels={"estimator": e})) for e in ("exact", "topk", "tail")),
    STRESS,
)
REGIMES = ("gain V <= 1", "1 < gain V <= 2", "gain V > 2")
ISS = Table(
    "iss_bound",
    ("what the law read",),
    tuple(
        Column(
            f"`{r}`: within the bound, median error / bound",
            Parts(
                (
                    figure("within bound", "%", regime=r),
                    figure("settled error / bound", "", regime=r),
                ),
                ", ",
            ),
        )
        for r in REGIMES
    ),
    tuple(
        Row((r,), Pick(labels={"reading": r}))
        for r in (
            "top-k (k = 64)",
            "tail midpoint",
            "constant bias 0.05",
            "constant bias 0.2",
            "constant bias 0.5",
            "uniform noise 0.05",
            "uniform noise 0.2",
            "uniform noise 0.5",
        )
    ),
    Pick(benchmark="iss", kind=AVX512),
)

TABLES = (
    STRUCTURED,
    SERVER,
    REPLICAS,
    ABUSE,
    STOPS,
    STRESS_TABLE,
    STRESS_PASSKEYS,
    ESTIMATORS,
    ISS,
)
