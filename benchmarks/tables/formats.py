"""Weight formats, the KV cache's element types, and memory against the file."""

from benchmarks.layout import Column, Pick, Ratio, Row, Table
from benchmarks.tables.common import (
    AVX512,
    GEMMA,
    GEMMA_FILE,
    HELD,
    SMOLLM,
    SMOLLM_FILE,
    figure,
    ratio_vs,
)


def over_float32(mode: str, batch: int) -> Ratio:
    """A mode's decode rate over float32's, for runs that kept the rates alone."""
    return Ratio(
        figure("decode", "tok/s", mode=mode, batch=batch),
        figure("decode", "tok/s", mode="none", batch=batch),
    )


def mode(kind: str, name: str) -> Pick:
    return Pick(kind=kind, labels={"mode": name})


MODES = Table(
    "formats_modes",
    ("host", "mode"),
    (
        Column("decode, batch 1", ratio_vs("decode", "float32", batch=1), "b1"),
        Column("batch 16", ratio_vs("decode", "float32", batch=16), "b16"),
        Column("top-1 vs float32", figure("top-1 agreement", "%", vs="float32")),
        Column("KL (nats)", figure("kl", "nats", vs="float32")),
    ),
    (
        Row((AVX512, "`int8`"), mode(AVX512, "int8")),
        Row((AVX512, "`int4`"), mode(AVX512, "int4")),
        Row((AVX512, "`auto`"), mode(AVX512, "auto")),
        Row((AVX512, "`auto`, batch-invariant"), mode(AVX512, "auto+batch-invariant")),
        Row((AVX512, "`auto`, native kernels off"), mode(AVX512, "auto+no-native")),
        Row((AVX512, "`gguf`"), mode(AVX512, "gguf")),
        Row((AVX512, "`gguf-a16`"), mode(AVX512, "gguf-a16")),
        Row((HELD, "`auto`"), mode(HELD, "auto"), {"b1": over_float32("auto", 1)}),
        Row((HELD, "`gguf`"), mode(HELD, "gguf"), {"b1": over_float32("gguf", 1)}),
        Row((HELD, "`gguf-a16`"), mode(HELD, "gguf-a16")),
    ),
    Pick(benchmark="quantization", labels={"model": SMOLLM, "engine": "etinfer"}),
)

KV_CACHE = Table(
    "kv_cache",
    ("`kv_cache_dtype`",),
    (
        Column("bytes a token", figure("bytes per token", "")),
        Column("top-1 vs float32", figure("top-1 agreement", "%")),
        Column("KL mean (nats)", figure("kl", "nats")),
        Column("KL max", figure("kl max", "nats")),
        Column("passkeys at 8K", figure("passkeys found", "count")),
        Column("decode step at 8K, batch 1", ratio_vs("decode step", "float32", batch=1)),
        Column("batch 8", ratio_vs("decode step", "float32", batch=8)),
    ),
    tuple(
        Row(
            (f"`{t}`" + (" (`auto`)" if t == "float16" else ""),),
            Pick(labels={"kv_cache_dtype": t}),
        )
        for t in ("float32", "float16", "bfloat16", "int8")
    ),
    Pick(benchmark="kv-cache", kind=AVX512),
)

MEMORY = Table(
    "memory",
    ("model (file)", "mode"),
    (Column("resident once serving, over file + KV pool", Pick()),),
    (
        Row(
            ("SmolLM2-135M Q4_1, 94 MiB", "`auto`"), Pick(labels={"model": SMOLLM, "mode": "auto"})
        ),
        Row(
            ("SmolLM2-135M Q4_1, 94 MiB", "`gguf`"), Pick(labels={"model": SMOLLM, "mode": "gguf"})
        ),
        Row(
            ("SmolLM2-135M Q4_1, 94 MiB", "`none`"), Pick(labels={"model": SMOLLM, "mode": "none"})
        ),
        Row(
            ("Gemma 3 270M Q4_K_M, 241 MiB", "not named"),
            Pick(labels={"model": "Gemma 3 270M Q4_K_M"}),
        ),
    ),
    ratio_vs("resident memory", "file + KV pool").under(Pick(benchmark="memory", kind=AVX512)),
)

PERPLEXITY = Table(
    "perplexity",
    ("model (file)", "engine"),
    (
        Column("perplexity", Pick(subject="perplexity", unit="", decimals=3)),
        Column(
            "over transformers float32",
            Pick(subject="perplexity", unit="x", labels={"vs": "hf"}, decimals=4),
            "ratio",
        ),
    ),
    tuple(
        Row(
            (name, engine),
            Pick(labels={"model": file, "engine": engine}),
            {"ratio": "the reference"} if engine.startswith("transformers") else {},
        )
        for name, file, engines in (
            (SMOLLM, SMOLLM_FILE, ("etinfer auto", "etinfer none", "llama.cpp")),
            (GEMMA, GEMMA_FILE, ("etinfer auto", "etinfer gguf", "etinfer none", "llama.cpp")),
        )
        for engine in (*engines, "transformers float32")
    ),
    Pick(benchmark="perplexity", kind=AVX512),
)

PROMPT_LOGPROBS = Table(
    "prompt_logprobs_cost",
    ("model (file)", "`prompt_logprobs`"),
    (
        Column("prefill of 1,024 tokens", figure("prefill", "x", vs="off"), "prefill"),
        Column("what scoring adds, over the head alone", figure("prompt logprobs extra", "x")),
    ),
    tuple(
        Row((name, str(count)), Pick(labels={"model": file, "prompt_logprobs": count}))
        for name, file in ((SMOLLM, SMOLLM_FILE), (GEMMA, GEMMA_FILE))
        for count in (1, 5)
    ),
    Pick(benchmark="prompt-logprobs", kind=AVX512, decimals=2),
)

TABLES = (MODES, KV_CACHE, MEMORY, PERPLEXITY, PROMPT_LOGPROBS)
