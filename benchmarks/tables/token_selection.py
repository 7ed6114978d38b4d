"""Pruning finer than whole blocks: teacher-forced fidelity of tokens chosen one by one (an
engine of one-token blocks) beside 16-token blocks, both on the file's weights decoded to
float32, whose arithmetic adds no rounding of its own to the comparison."""

from benchmarks.layout import Column, Pick, Row, Table
from benchmarks.tables.common import AVX512

FLOAT = {
    "workload": "teacher-forced", "batch": 4, "context": 6144, "quantization": "none",
    "vs": "dense",
}  # fmt: skip
TOKENS = {"block_size": 1}
BLOCKS = {"block_size": None}


def share(s: float) -> str:
    return f"{s * 100:g} %"


# (what is chosen, ranking, share kept, the arm, its block size labels)
ARMS = (
    *(
        ("blocks of 16", name, share(s), f"bound-share-{s}{suffix}", BLOCKS)
        for name, suffix, shares in (
            ("oracle ranking (exact mass)", " oracle", (0.125, 0.175, 0.2)),
            ("`bound` (key bounds)", "", (0.125, 0.2)),
            ("low-rank keys, rank 24, 4 bits", " low-rank-24", (0.125, 0.2)),
        )
        for s in shares
    ),
    *(("blocks of 16", "`digest`", share(s), f"digest-share-{s}", BLOCKS) for s in (0.125, 0.2)),
    *(
        ("blocks of 16", "`reused-mass`", share(s), f"reused-share-{s}", BLOCKS)
        for s in (0.125, 0.2)
    ),
    *(
        ("single tokens", name, share(s), f"bound-share-{s}{suffix}", TOKENS)
        for name, suffix in (
            ("oracle ranking (exact mass)", " oracle"),
            ("exact scores", ""),
            ("low-rank keys, rank 16, 4 bits", " low-rank-16"),
            ("low-rank keys, rank 24, 4 bits", " low-rank-24"),
            ("query-aware copy, rank 8, 8 bits", " whitened-8"),
            ("query-aware copy, rank 16, 8 bits", " whitened-16"),
        )
        for s in (0.125, 0.2)
    ),
)
TOKEN_SELECTION = Table(
    "pruning_tokens",
    ("chosen", "ranking", "share kept"),
    (
        Column("KV bytes read", Pick(subject="kv bytes read", unit="%", decimals=1)),
        Column("KL mean (nats)", Pick(subject="kl", unit="nats", decimals=4)),
        Column("top-1 vs dense", Pick(subject="top-1 agreement", unit="%", decimals=1)),
        Column("perplexity ratio", Pick(subject="perplexity", unit="x", decimals=4)),
    ),
    tuple(
        Row((chosen, ranking, kept), Pick(labels={"arm": arm} | size))
        for chosen, ranking, kept, arm, size in ARMS
    ),
    Pick(benchmark="fidelity", kind=AVX512, labels=FLOAT),
)

GEMMA_ARMS = (
    *(
        ("blocks of 16", name, share(s), f"{arm}{s}{suffix}", BLOCKS)
        for name, arm, suffix, shares in (
            ("oracle ranking (exact mass)", "bound-share-", " oracle", (0.125, 0.2)),
            ("`bound` (key bounds)", "bound-share-", "", (0.125, 0.2)),
            ("`digest`", "digest-share-", "", (0.125, 0.2)),
            ("`reused-mass`", "reused-share-", "", (0.125,)),
        )
        for s in shares
    ),
    *(
        ("single tokens", name, share(s), f"bound-share-{s}{suffix}", TOKENS)
        for name, suffix in (
            ("oracle ranking (exact mass)", " oracle"),
            ("exact scores", ""),
            ("low-rank keys, rank 24, 4 bits", " low-rank-24"),
            ("low-rank keys, rank 48, 4 bits", " low-rank-48"),
            ("query-aware copy, rank 16, 8 bits", " whitened-16"),
            ("query-aware copy, rank 32, 8 bits", " whitened-32"),
        )
        for s in (0.125, 0.2)
    ),
    *(
        ("single tokens", f"query-aware copy, rank {r}, 8 bits", "12.5 %", arm, TOKENS)
        for r in (48, 64)
        for arm in (f"bound-share-0.125 whitened-{r}",)
    ),
)
GEMMA_TOKEN_SELECTION = Table(
    "pruning_tokens_gemma",
    TOKEN_SELECTION.lead,
    TOKEN_SELECTION.columns,
    tuple(
        Row((chosen, ranking, kept), Pick(labels={"arm": arm} | size))
        for chosen, ranking, kept, arm, size in GEMMA_ARMS
    ),
    Pick(benchmark="fidelity", kind=AVX512, labels=FLOAT | {"context": 8192}),
)

KEY_COPY_PASSKEYS = "fidelity/2026-11-29-e3dd7ee-token-passkeys.json"
QUERY_AWARE_PASSKEYS = "fidelity/2026-11-29-1b79f61-whitened-passkeys.json"
# (configuration, arm, the run)
TOKEN_PASSKEY_ARMS = (
    ("dense", "dense", KEY_COPY_PASSKEYS),
    ("single tokens by exact scores, 12.5 %", "bound-share-0.125", KEY_COPY_PASSKEYS),
    ("single tokens by exact scores, 20 %", "bound-share-0.2", KEY_COPY_PASSKEYS),
    ("single tokens by the keys' rank-24 copy, 12.5 %", "bound-share-0.125 low-rank-24",
     KEY_COPY_PASSKEYS),
    ("single tokens by the keys' rank-24 copy, 20 %", "bound-share-0.2 low-rank-24",
     KEY_COPY_PASSKEYS),
    ("single tokens by the query-aware rank-16 copy, 12.5 %", "bound-share-0.125 whitened-16",
     QUERY_AWARE_PASSKEYS),
)  # fmt: skip
TOKEN_PASSKEYS = Table(
    "pruning_token_passkeys",
    ("configuration",),
    (
        Column(
            "repeated haystack",
            Pick(subject="passkeys found", unit="count", labels={"workload": "repeated"}),
        ),
        Column(
            "real prose",
            Pick(subject="passkeys found", unit="count", labels={"workload": "varied"}),
        ),
    ),
    tuple(
        Row((name,), Pick(labels={"arm": arm}, result=run)) for name, arm, run in TOKEN_PASSKEY_ARMS
    ),
    Pick(benchmark="fidelity", kind=AVX512, labels=TOKENS | {"quantization": "none"}),
)

TABLES = (TOKEN_SELECTION, GEMMA_TOKEN_SELECTION, TOKEN_PASSKEYS)
