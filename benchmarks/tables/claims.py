"""The first screen's claims against what was measured: the paper's Table 1, the seed systems'
claims and serving's targets, each from the newest runs of every host kind."""

from benchmarks.layout import Claim, Column, Parts, Pick, Row, Table
from benchmarks.tables.common import AVX2, AVX512, H200, figure, ratio_vs


def paper_row(latency: float, throughput: float, eta: float, quality: float) -> dict[str, Claim]:
    return {
        "latency": Claim("<=", latency),
        "throughput": Claim(">=", throughput),
        "eta": Claim(">=", eta),
        "quality": Claim(">=", quality),
    }


def workload(kind: str, name: str, subjects: tuple[str, ...], **labels: object) -> Parts:
    picks = (
        Pick(subject=s, kind=kind, labels={"workload": name} | labels, bare=True, decimals=2)
        for s in subjects
    )
    return Parts(tuple(picks))


FOUR = ("latency", "throughput", "eta", "quality")
TWO = ("latency", "throughput")
FULL = paper_row(0.70, 1.40, 1.55, 1.00)
TABLE1_TABLE = Table(
    "headline_table1",
    ("configuration", "the paper: latency / throughput / η / quality"),
    (
        # Capacity in a closed loop of 8 clients, three repeats (other loops ran once).
        Column(
            "CPU, mixed (L / T / η / Q)",
            workload(AVX512, "mixed", FOUR, concurrency=8),
            "cpu_mixed",
        ),
        Column("CPU, long", workload(AVX512, "long", FOUR), "cpu_long"),
        Column("H200, mixed (L / T)", workload(H200, "mixed", TWO), "h200_mixed"),
        Column("H200, long", workload(H200, "long", TWO), "h200_long"),
        Column(
            "holds (CPU mixed / long, H200 mixed / long)",
            holds=("cpu_mixed", "cpu_long", "h200_mixed", "h200_long"),
        ),
    ),
    (
        Row(
            ("Sampling only", "0.98 / 1.02 / 1.08 / 1.00"),
            Pick(labels={"arm": "sampling"}),
            claims=paper_row(0.98, 1.02, 1.08, 1.00),
        ),
        Row(
            ("Scheduling only", "0.88 / 1.15 / 1.12 / 1.00"),
            Pick(labels={"arm": "scheduling"}),
            claims=paper_row(0.88, 1.15, 1.12, 1.00),
        ),
        Row(
            ("Attention only", "0.85 / 1.20 / 1.25 / 0.98"),
            Pick(labels={"arm": "attention"}),
            claims=paper_row(0.85, 1.20, 1.25, 0.98),
        ),
        Row(
            ("Full system", "0.70 / 1.40 / 1.55 / 1.00"), Pick(labels={"arm": "full"}), claims=FULL
        ),
        Row(
            ("etinfer full (not in the paper)", "held to the full system's row"),
            Pick(labels={"arm": "etinfer full"}),
            claims=FULL,
        ),
    ),
    Pick(benchmark="ablation", unit="x", labels={"vs": "baseline", "arms": None}),
)

LONG = Pick(benchmark="longcontext")
SPARSE = LONG.under(Pick(subject="ttft", unit="x", labels={"vs": "dense"}))
SPECULATIVE = Pick(benchmark="speculative").under(
    ratio_vs("decode", "plain", setting="ngram entropy (default)", batch=1)
)
SEEDS_TABLE = Table(
    "headline_seeds",
    ("system", "claim"),
    (Column("measured"), Column("holds", holds=("measured",))),
    (
        Row(
            ("prompt-lookup speculation, copying, batch 1", "at least 1.3x plain decoding"),
            SPECULATIVE.under(Pick(labels={"workload": "copy"})),
            claims={"decode": Claim(">=", 1.3)},
        ),
        Row(
            ("prompt-lookup speculation, chat, batch 1", "no slower than plain decoding (0.95x)"),
            SPECULATIVE.under(Pick(labels={"workload": "chat"})),
            claims={"decode": Claim(">=", 0.95)},
        ),
        Row(
            (
                "Entropy Adaptive Decoding",
                "95 % of the large model's quality with it on at most half the tokens "
                "(the paper: 96.7 % at 43 %)",
            ),
            Pick(benchmark="switching", labels={"setting": "EAD threshold 2"}),
            {
                "measured": Parts(
                    (
                        Pick(subject="quality", unit="%"),
                        Pick(subject="large share", prefix="with it on ", suffix=" of the tokens"),
                    ),
                    " ",
                )
            },
            claims={"quality": Claim(">=", 95)},
        ),
        Row(
            ("EntropyInfer: sparse prefill", "time to first token at most 0.6x dense at 7K and 8K"),
            SPARSE.under(Pick(labels={"arm": "sparse prefill"})),
            {
                "measured": Parts(
                    (
                        Pick(labels={"tokens": 7168}, suffix=" at 7,168 tokens"),
                        Pick(labels={"tokens": 8064}, suffix=" at 8,064"),
                    ),
                    ", ",
                )
            },
            claims={"ttft": Claim("<=", 0.6)},
        ),
        Row(
            ("EntropyInfer: KV compression", "at most 30 % of dense's KV blocks at 8K"),
            figure("kv blocks", "%", arm="kv compression", tokens=8064, vs="dense").under(LONG),
            claims={"kv blocks": Claim("<=", 30)},
        ),
        Row(
            ("EntropyInfer: KV compression", "every passkey dense finds, kept at 8K"),
            figure("passkeys found", "count", tokens=8064).under(LONG),
            {
                "measured": Parts(
                    (
                        Pick(labels={"arm": "kv compression"}),
                        Pick(labels={"arm": "dense"}, prefix="dense ", checked=False),
                    ),
                    ", ",
                )
            },
            claims={"passkeys found": Claim(">=", figure("passkeys found", "count", arm="dense"))},
        ),
        Row(
            ("EntropyInfer: KV compression", "at least 1.5x dense's throughput under KV pressure"),
            ratio_vs("throughput", "dense", arm="kv compression", workload="KV pressure").under(
                LONG
            ),
            claims={"throughput": Claim(">=", 1.5)},
        ),
        Row(
            (
                "per-head decode budgets",
                "lower KL than one budget for all heads, at a quarter of the blocks",
            ),
            figure("kl", "nats", blocks_read=26, vs="dense").under(Pick(benchmark="fidelity")),
            {
                "measured": Parts(
                    (
                        Pick(labels={"arm": "bound, per-head budgets"}, prefix="KL "),
                        Pick(labels={"arm": "bound"}, prefix="against ", checked=False),
                    ),
                    " ",
                )
            },
            claims={
                "kl": Claim("<", figure("kl", "nats", arm="bound", blocks_read=26, vs="dense"))
            },
        ),
    ),
    Pick(kind=AVX512),
)

DEFAULT_GRAMMAR = ratio_vs("decode", "free", arm="constrained, jump-forward off (the default)")
SERVING_TABLE = Table(
    "headline_serving",
    ("what", "target"),
    (Column("measured"), Column("holds", holds=("measured",))),
    (
        Row(
            ("the OpenAI-compatible server, 48 requests offered at 4 req/s", "-"),
            Pick(benchmark="server", kind=AVX2, labels={"rate": 4}),
            {
                "measured": Parts(
                    (
                        Pick(subject="request throughput", suffix=" req/s served"),
                        Pick(subject="ttft p99", prefix="time to first token p99 ", suffix=" ms"),
                    ),
                    ", ",
                )
            },
        ),
        Row(
            (
                "structured output, 20 JSON schemas",
                "every reply valid; constrained at least 0.9x free",
            ),
            Pick(benchmark="structured", kind=AVX512),
            {
                "measured": Parts(
                    (
                        figure("valid replies", "count").under(Pick(suffix=" valid replies")),
                        DEFAULT_GRAMMAR.under(Pick(labels={"batch": 1}, prefix="batch 1 ")),
                        DEFAULT_GRAMMAR.under(Pick(labels={"batch": 16}, prefix="batch 16 ")),
                    ),
                    ", ",
                )
            },
            claims={"valid replies": Claim(">=", 200), "decode": Claim(">=", 0.9)},
        ),
        Row(
            ("two engine replicas of one thread against one of two threads (Ray Serve)", "-"),
            Pick(benchmark="serving", kind=AVX512),
            {
                "measured": ratio_vs("throughput", "1 replica x 2 threads").under(
                    Pick(suffix=" output tok/s")
                )
            },
        ),
        Row(
            ("a small request beside a 20 MB prompt", "-"),
            Pick(benchmark="abuse", kind=AVX512, labels={"request": "prompt 20 MB"}),
            {
                "measured": Parts(
                    (
                        figure("small request max", "s", tree="with request limits").under(
                            Pick(suffix=" s")
                        ),
                        figure("small request max", "s", tree="4f3002c (before them)").under(
                            Pick(prefix="before the limits ", suffix=" s")
                        ),
                    ),
                    ", ",
                )
            },
        ),
        Row(
            (
                "entropy scheduling past saturation (2x capacity)",
                "mean latency at most 0.88x FCFS, throughput at least FCFS's",
            ),
            Pick(
                benchmark="serving-sweep",
                kind=AVX2,
                labels={"setting": "2x capacity", "vs": "fcfs"},
            ),
            {
                "measured": Parts(
                    (
                        Pick(subject="e2e mean", prefix="mean latency "),
                        Pick(subject="request throughput", prefix="throughput "),
                    ),
                    ", ",
                )
            },
            claims={"e2e mean": Claim("<=", 0.88), "request throughput": Claim(">=", 1.0)},
        ),
    ),
)

TABLES = (TABLE1_TABLE, SEEDS_TABLE, SERVING_TABLE)
