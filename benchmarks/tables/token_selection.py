"""Pruning finer than whole blocks: teacher-forced fidelity of tokens chosen one by one (an
engine of one-token blocks) beside 16-token blocks, both on the file's weights decoded to
float32, whose arithmetic adds no rounding of its own to the comparison."""

from benchmarks.layout import Column, Pick, Row, Table
from benchmarks.tables.common import AVX512, HELD
from benchmarks.tables.laws import step_table

FLOAT = {
    "workload": "teacher-forced", "batch": 4, "context": 6144, "quantization": "none",
    "vs": "dense",
}  # fmt: skip
TOKENS = {"block_size": 1}
BLOCKS = {"block_size": None}


SHARES = (0.125, 0.2)
BLOCK_RANKINGS = {  # ranking: the study's name for its arm before the share, and after it
    "oracle ranking (exact mass)": ("bound-share-", " oracle"),
    "`bound` (key bounds)": ("bound-share-", ""),
    "low-rank keys, rank 24, 4 bits": ("bound-share-", " low-rank-24"),
    "`digest`": ("digest-share-", ""),
    "`reused-mass`": ("reused-share-", ""),
}
TOKEN_RANKINGS = {
    "oracle ranking (exact mass)": ("bound-share-", " oracle"),
    "exact scores": ("bound-share-", ""),
    **{
        f"low-rank keys, rank {r}, 4 bits": ("bound-share-", f" low-rank-{r}") for r in (16, 24, 48)
    },
    **{
        f"query-aware copy, rank {r}, 8 bits": ("bound-share-", f" whitened-{r}")
        for r in (8, 16, 32, 48, 64)
    },
}


def fidelity_rows(blocks: dict[str, tuple[float, ...]], tokens: dict[str, tuple[float, ...]]):
    """A row per ranking (the keys of ``BLOCK_RANKINGS`` and ``TOKEN_RANKINGS``) and share kept,
    16-token blocks first, then single tokens."""
    for chosen, rankings, names, size in (
        ("blocks of 16", blocks, BLOCK_RANKINGS, BLOCKS),
        ("single tokens", tokens, TOKEN_RANKINGS, TOKENS),
    ):
        for ranking, shares in rankings.items():
            before, after = names[ranking]
            for s in shares:
                arm = Pick(labels={"arm": f"{before}{s}{after}"} | size)
                yield Row((chosen, ranking, f"{s * 100:g} %"), arm)


def fidelity_table(
    name: str, rows, labels: dict, lead=("chosen", "ranking", "share kept"), result=None
) -> Table:
    return Table(
        name,
        lead,
        (
            Column("KV bytes read", Pick(subject="kv bytes read", unit="%", decimals=1)),
            Column("KL mean (nats)", Pick(subject="kl", unit="nats", decimals=4)),
            Column("top-1 vs dense", Pick(subject="top-1 agreement", unit="%", decimals=1)),
            Column("perplexity ratio", Pick(subject="perplexity", unit="x", decimals=4)),
        ),
        tuple(rows),
        Pick(benchmark="fidelity", kind=AVX512, labels=labels, result=result),
    )


TOKEN_SELECTION = fidelity_table(
    "pruning_tokens",
    fidelity_rows(
        {
            "oracle ranking (exact mass)": (0.125, 0.175, 0.2),
            "`bound` (key bounds)": SHARES,
            "low-rank keys, rank 24, 4 bits": SHARES,
            "`digest`": SHARES,
            "`reused-mass`": SHARES,
        },
        dict.fromkeys(
            (
                "oracle ranking (exact mass)",
                "exact scores",
                "low-rank keys, rank 16, 4 bits",
                "low-rank keys, rank 24, 4 bits",
                "query-aware copy, rank 8, 8 bits",
                "query-aware copy, rank 16, 8 bits",
            ),
            SHARES,
        ),
    ),
    FLOAT,
)
GEMMA_TOKEN_SELECTION = fidelity_table(
    "pruning_tokens_gemma",
    fidelity_rows(
        {
            "oracle ranking (exact mass)": SHARES,
            "`bound` (key bounds)": SHARES,
            "`digest`": SHARES,
            "`reused-mass`": (0.125,),
        },
        dict.fromkeys(
            (
                "oracle ranking (exact mass)",
                "exact scores",
                "low-rank keys, rank 24, 4 bits",
                "low-rank keys, rank 48, 4 bits",
                "query-aware copy, rank 16, 8 bits",
                "query-aware copy, rank 32, 8 bits",
            ),
            SHARES,
        )
        | dict.fromkeys(
            ("query-aware copy, rank 48, 8 bits", "query-aware copy, rank 64, 8 bits"), (0.125,)
        ),
    ),
    FLOAT | {"context": 8192},
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

# The engine's scorers that read its key copy, beside the block oracle and the bounds, on the
# file's own weights and 16-token blocks, in one run.
KEY_COPY_RUN = "fidelity/2026-11-29-bc2afdb-key-copy.json"
ENGINE_COPY_ARMS = (
    ("oracle ranking (exact mass), blocks", "bound-share-", " oracle", (0.125, 0.2)),
    ("`bound` (key bounds), blocks", "bound-share-", "", (0.125, 0.2)),
    ("`sketch`: blocks by the key copy", "sketch-share-", "", (0.125, 0.2)),
    ("`sketch-tokens`: single tokens by the key copy", "tokens-share-", "", (0.08, 0.125, 0.175)),
)
GEMMA_COPY_ARMS = (
    ("oracle ranking (exact mass), blocks", "bound-share-", " oracle", (0.125,)),
    ("`bound` (key bounds), blocks", "bound-share-", "", (0.125,)),
    ("`sketch-tokens`: single tokens by the key copy", "tokens-share-", "", (0.08, 0.125)),
)


def with_token_shares(arms, shares: tuple[float, ...]):
    """``arms`` with their last one (single tokens) at ``shares``."""
    *blocks, (chosen, before, after, _) = arms
    return (*blocks, (chosen, before, after, shares))


def copy_table(name: str, arms, context: int, result: str, batch: int = 4) -> Table:
    """The key copy's arms beside the oracle's and the bounds', a row per share, in one run."""
    rows = (
        Row((chosen, f"{s * 100:g} %"), Pick(labels={"arm": f"{before}{s}{after}"}))
        for chosen, before, after, shares in arms
        for s in shares
    )
    labels = {"workload": "teacher-forced", "batch": batch, "context": context, "vs": "dense"}
    return fidelity_table(name, rows, labels, ("ranking", "share kept"), result)


ENGINE_KEY_COPY = copy_table("pruning_key_copy", ENGINE_COPY_ARMS, 6144, KEY_COPY_RUN)
GEMMA_ENGINE_KEY_COPY = copy_table(
    "pruning_key_copy_gemma",
    GEMMA_COPY_ARMS,
    8192,
    "fidelity/2026-11-29-d3d36cb-gemma-key-copy.json",
)
GEMMA_ENGINE_KEY_COPY_32K = copy_table(
    "pruning_key_copy_gemma_32k",
    GEMMA_COPY_ARMS,
    32000,
    "fidelity/2026-11-29-31fbad2-gemma-key-copy-32k.json",
    batch=1,
)
GEMMA_ENGINE_KEY_COPY_32K_BATCH2 = copy_table(
    "pruning_key_copy_gemma_32k_batch2",
    with_token_shares(GEMMA_COPY_ARMS, (0.08, 0.1, 0.125)),
    32000,
    "fidelity/2026-11-29-29da34e-gemma-key-copy-32k-batch2.json",
    batch=2,
)


def lower_rank_arms(rank: int, shares: tuple[float, ...]):
    """A key copy of a lower ``rank`` on Gemma 3 (fewer bytes than the default's 96), more of
    the tokens for the same reads, beside the oracle and the bounds at a fifth of the blocks."""
    return (
        ("oracle ranking (exact mass), blocks", "bound-share-", " oracle", (0.2,)),
        ("`bound` (key bounds), blocks", "bound-share-", "", (0.2,)),
        (f"`sketch-tokens`, rank {rank}", "tokens-share-", "", shares),
    )


GEMMA_ENGINE_KEY_COPY_32K_RANK48 = copy_table(
    "pruning_key_copy_gemma_32k_rank48",
    lower_rank_arms(48, (0.125, 0.15, 0.175)),
    32000,
    "fidelity/2026-11-29-4821260-gemma-key-copy-32k-rank48-batch2.json",
    batch=2,
)
GEMMA_ENGINE_KEY_COPY_32K_RANK48_BATCH4 = copy_table(
    "pruning_key_copy_gemma_32k_rank48_batch4",
    lower_rank_arms(48, (0.125, 0.15)),
    32000,
    "fidelity/2026-11-29-4821260-gemma-key-copy-32k-rank48-batch4.json",
)
GEMMA_ENGINE_KEY_COPY_32K_RANK32_BATCH4 = copy_table(
    "pruning_key_copy_gemma_32k_rank32_batch4",
    lower_rank_arms(32, (0.15, 0.175, 0.2)),
    32000,
    "fidelity/2026-11-29-b134d6e-gemma-key-copy-32k-rank32-batch4.json",
)
COPY_PASSKEYS = {  # rank (or setting): the run
    16: "fidelity/2026-11-29-0ec3fce-key-copy-passkeys-rank16.json",
    24: "fidelity/2026-11-29-58aa9f8-key-copy-passkeys.json",
    32: "fidelity/2026-11-29-d3d36cb-key-copy-passkeys-rank32.json",
    "two sink blocks": "fidelity/2026-11-29-54b24ac-key-copy-passkeys-sink2.json",
}
COPY_PASSKEY_ARMS = (
    ("dense", "dense", 24),
    *(
        (f"`sketch-tokens`, {s * 100:g} %, rank {r}", f"tokens-share-{s}", r)
        for s in (0.08, 0.125)
        for r in (16, 24, 32)
    ),
    *(
        (f"`sketch-tokens`, {s * 100:g} %, rank 24, two sink blocks", f"tokens-sink2-share-{s}",
         "two sink blocks")
        for s in (0.08, 0.125)
    ),
    *((f"`sketch`, 12.5 %, rank {r}", "sketch-share-0.125", r) for r in (16, 24)),
)  # fmt: skip
ENGINE_COPY_PASSKEYS = Table(
    "pruning_key_copy_passkeys",
    ("configuration",),
    TOKEN_PASSKEYS.columns,
    tuple(
        Row((name,), Pick(labels={"arm": arm}, result=COPY_PASSKEYS[rank]))
        for name, arm, rank in COPY_PASSKEY_ARMS
    ),
    Pick(benchmark="fidelity", kind=AVX512),
)

# Each case an arm lost that dense found, asked again of dense by the torch kernel.
RECHECKED_PASSKEYS = "fidelity/2026-11-29-6216e14-key-copy-passkeys-rechecked.json"
ENGINE_COPY_PASSKEYS_RECHECKED = Table(
    "pruning_key_copy_passkeys_rechecked",
    ("configuration",),
    (
        *TOKEN_PASSKEYS.columns,
        *(
            Column(
                f"lost that both dense kernels find, {name}",
                Pick(subject="passkeys lost", unit="count", labels={"workload": workload}),
                f"lost {workload}",
            )
            for name, workload in (("repeated", "repeated"), ("prose", "varied"))
        ),
    ),
    tuple(
        Row(
            (name,),
            Pick(labels={"arm": arm}),
            {"lost repeated": "-", "lost varied": "-"} if arm == "dense" else {},
        )
        for name, arm in (
            ("dense", "dense"),
            ("`sketch-tokens`, 8 %", "tokens-share-0.08"),
            ("`sketch-tokens`, 12.5 %", "tokens-share-0.125"),
            ("`sketch`, 12.5 %", "sketch-share-0.125"),
        )
    ),
    Pick(benchmark="fidelity", kind=AVX512, result=RECHECKED_PASSKEYS),
)

ENGINE_COPY_STEP = step_table(
    "pruning_key_copy_step_held",
    (
        ("`sketch-tokens`", "tokens-ungated"),
        ("`sketch`", "sketch-ungated"),
        ("`reused-mass`", "reused-ungated"),
    ),
    HELD,
    "pruning/2026-11-29-1059dfd-key-copy-speed-avx2-held.json",
)

TABLES = (
    ENGINE_COPY_STEP,
    TOKEN_SELECTION,
    GEMMA_TOKEN_SELECTION,
    TOKEN_PASSKEYS,
    ENGINE_KEY_COPY,
    GEMMA_ENGINE_KEY_COPY,
    GEMMA_ENGINE_KEY_COPY_32K,
    GEMMA_ENGINE_KEY_COPY_32K_BATCH2,
    GEMMA_ENGINE_KEY_COPY_32K_RANK48,
    GEMMA_ENGINE_KEY_COPY_32K_RANK48_BATCH4,
    GEMMA_ENGINE_KEY_COPY_32K_RANK32_BATCH4,
    ENGINE_COPY_PASSKEYS,
    ENGINE_COPY_PASSKEYS_RECHECKED,
)
