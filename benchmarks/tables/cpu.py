"""Speed on the CPU: against llama.cpp by host kind, llama.cpp against itself, and against
transformers."""

from benchmarks.layout import Column, Parts, Pick, Row, Table
from benchmarks.tables.common import (
    AVX2,
    AVX512,
    GEMMA,
    HELD,
    LLAMA_1B,
    LLAMA_CPP,
    NOT_MEASURED,
    SMOLLM,
    figure,
    ratio_vs,
)

LC = LLAMA_CPP
QUANTIZATION = Pick(benchmark="quantization")
ONE_PLACE = Pick(decimals=1)
TWO_PLACES = Pick(decimals=2)


def model(name: str, **labels) -> Pick:
    return Pick(labels={"model": name, **labels})


def engine(name: str, mode: str | None = None) -> Pick:
    return Pick(labels={"engine": name, "mode": mode})


AVX2_HOST = Table(
    "cpu_avx2_host",
    ("model (file)",),
    (
        Column("batch 1, `auto`", ratio_vs("decode", LC, batch=1, mode="auto"), "b1auto"),
        Column("batch 1, `gguf`", ratio_vs("decode", LC, batch=1, mode="gguf"), "b1gguf"),
        Column("prefill", ratio_vs("prefill", LC).under(Pick(note="mode")), "prefill"),
        Column(
            "load (s): etinfer", figure("load time", "s", engine="etinfer").under(ONE_PLACE), "load"
        ),
        Column("llama.cpp", figure("load time", "s", engine=LC).under(ONE_PLACE), "load_lc"),
        Column(
            "resident (MiB): etinfer", figure("resident memory", "MiB", engine="etinfer"), "rss"
        ),
        Column("llama.cpp", figure("resident memory", "MiB", engine=LC), "rss_lc"),
        Column("batch 16 over our float32", ratio_vs("decode", "float32", batch=16), "b16"),
    ),
    (
        Row(
            (f"{SMOLLM}, 94 MiB",),
            model(SMOLLM),
            {"rss": NOT_MEASURED, "rss_lc": NOT_MEASURED, "b16": "-"},
        ),
        Row(
            (f"{GEMMA}, 241 MiB",),
            model(GEMMA),
            {"rss": NOT_MEASURED, "rss_lc": NOT_MEASURED, "b16": "-"},
        ),
        Row(
            (f"{LLAMA_1B}, 630 MiB",),
            model(LLAMA_1B),
            {
                "prefill": Parts(
                    (Pick(labels={"mode": "gguf"}), Pick(labels={"mode": "auto"})), ", "
                ),
                "b16": "-",
            },
        ),
        Row(
            ("the model is not named",),
            model(None),
            {c: "-" for c in ("b1auto", "b1gguf", "prefill", "load", "load_lc", "rss", "rss_lc")},
        ),
    ),
    QUANTIZATION.under(Pick(kind=AVX2)),
)

SPEED_COLUMNS = (
    Column("decode, batch 1 (tok/s)", figure("decode", "tok/s", batch=1)),
    Column("batch 16", figure("decode", "tok/s", batch=16)),
    Column("prefill, 2,048 tokens (tok/s)", figure("prefill", "tok/s", tokens=2048)),
    Column("resident (MiB)", figure("resident memory", "MiB")),
    Column("top-1 vs float32", figure("top-1 agreement", "%", vs="float32", path=None), "top1"),
    Column("KL (nats)", figure("kl", "nats", vs="float32"), "kl"),
)
REFERENCE = {"top1": "-", "kl": "-"}

HELD_TABLE = Table(
    "cpu_held",
    ("engine",),
    SPEED_COLUMNS,
    (
        Row(("float32 (`none`)",), engine("etinfer", "none"), REFERENCE),
        Row(("`auto`",), engine("etinfer", "auto")),
        Row(("`gguf`",), engine("etinfer", "gguf")),
        Row(("`gguf-a16`",), engine("etinfer", "gguf-a16")),
        Row(("llama.cpp, AVX2 build",), engine(LC)),
    ),
    QUANTIZATION.under(model(SMOLLM).under(Pick(kind=HELD))),
)

AVX512_TABLE = Table(
    "cpu_avx512",
    ("engine",),
    (
        *SPEED_COLUMNS,
        Column("top-1 vs llama.cpp", figure("top-1 agreement", "%", vs=LC), "top1lc"),
    ),
    (
        Row(("float32 (`none`)",), engine("etinfer", "none"), REFERENCE | {"top1lc": NOT_MEASURED}),
        Row(("`auto`",), engine("etinfer", "auto")),
        Row(("`gguf`",), engine("etinfer", "gguf")),
        Row(("`gguf-a16`",), engine("etinfer", "gguf-a16")),
        Row(("llama.cpp, built for the host",), engine(LC), {"top1lc": "-"}),
    ),
    QUANTIZATION.under(model(SMOLLM).under(Pick(kind=AVX512))),
)

GEMMA_TABLE = Table(
    "cpu_gemma",
    ("engine",),
    (
        Column("decode, batch 1", Pick(labels={"batch": 1})),
        Column("batch 16", Pick(labels={"batch": 16})),
        Column(
            "prefill, 2,048 tokens", Pick(subject="prefill", labels={"tokens": 2048}), "prefill"
        ),
    ),
    (
        Row(("`gguf` (tok/s)",), figure("decode", "tok/s", engine="etinfer", mode="gguf")),
        Row(("llama.cpp (tok/s)",), figure("decode", "tok/s", engine=LC)),
        Row(("`gguf` against llama.cpp",), ratio_vs("decode", LC, mode="gguf")),
        Row(
            ("`auto` against llama.cpp",),
            ratio_vs("decode", LC, mode="auto"),
            {"prefill": NOT_MEASURED},
        ),
    ),
    QUANTIZATION.under(model(GEMMA).under(Pick(kind=AVX512))),
)

OWN = "llama.cpp one token a call"
BATCHED = "llama.cpp batched"


def agreement(name: str, vs: str, **labels) -> Pick:
    return Pick(labels={"model": name, "vs": vs, **labels})


AGREEMENT_TABLE = Table(
    "cpu_agreement",
    ("model", "these logits", "against"),
    (
        Column("top-1", Pick(subject="top-1 agreement", unit="%")),
        Column("KL (nats)", Pick(subject="kl", unit="nats"), "kl"),
    ),
    (
        Row(("Gemma 3 270M", OWN, BATCHED), agreement(GEMMA, BATCHED, engine=LC, arm=OWN)),
        Row(
            ("Gemma 3 270M", "etinfer `gguf`", BATCHED),
            agreement(GEMMA, BATCHED, engine="etinfer", mode="gguf"),
            {"kl": "-"},
        ),
        Row(("Gemma 3 270M", BATCHED, "float32"), agreement(GEMMA, "float32", engine=LC, arm=None)),
        Row(
            ("Gemma 3 270M", "etinfer `gguf`", "float32"), agreement(GEMMA, "float32", mode="gguf")
        ),
        Row(
            ("Gemma 3 270M", "etinfer `gguf-a16`", "float32"),
            agreement(GEMMA, "float32", mode="gguf-a16"),
        ),
        Row(("SmolLM2-135M", OWN, BATCHED), agreement(SMOLLM, BATCHED, engine=LC, arm=OWN)),
        Row(
            ("SmolLM2-135M", "etinfer `auto`", BATCHED),
            agreement(SMOLLM, BATCHED, mode="auto"),
            {"kl": "-"},
        ),
        Row(
            ("SmolLM2-135M", "etinfer `gguf`", BATCHED),
            agreement(SMOLLM, BATCHED, mode="gguf"),
            {"kl": "-"},
        ),
    ),
    QUANTIZATION.under(Pick(kind=AVX512)),
)

HF = "transformers"
HF_THROUGHPUT = Table(
    "cpu_hf_throughput",
    ("batch",),
    (
        Column("etinfer (tok/s)", figure("throughput", "tok/s", engine="etinfer")),
        Column("transformers (tok/s)", figure("throughput", "tok/s", engine=HF)),
        Column("ratio", ratio_vs("throughput", HF)),
    ),
    tuple(Row((str(b),), Pick(labels={"batch": b})) for b in (1, 16, 32)),
    Pick(benchmark="speed", kind=AVX2),
)
HF_STEP = Table(
    "cpu_hf_step",
    ("batch", "context"),
    (
        Column("etinfer (ms)", figure("decode step", "ms", engine="etinfer")),
        Column("transformers (ms)", figure("decode step", "ms", engine=HF)),
        Column("ratio", ratio_vs("decode step", HF)),
    ),
    tuple(
        Row((str(b), f"{c:,}"), Pick(labels={"batch": b, "context": c}))
        for b in (1, 8)
        for c in (512, 2048, 8000)
    ),
    Pick(benchmark="speed", kind=AVX2),
)

LOAD_RUNS = "quantization/2026-11-29-2d4673d-"
LOAD_TABLE = Table(
    "cpu_load",
    ("model (file)",),
    (
        Column(
            "load (s): etinfer",
            figure("load time", "s", engine="etinfer").under(TWO_PLACES),
            "load",
        ),
        Column("llama.cpp", figure("load time", "s", engine=LC).under(TWO_PLACES), "load_lc"),
        Column(
            "decode, batch 1",
            ratio_vs("decode", LC, batch=1, mode="auto").under(TWO_PLACES),
            "b1",
        ),
        Column(
            "prefill, 2,048 tokens (tok/s): etinfer",
            figure("prefill", "tok/s", engine="etinfer").under(Pick(decimals=0)),
            "prefill",
        ),
        Column(
            "llama.cpp", figure("prefill", "tok/s", engine=LC).under(Pick(decimals=0)), "prefill_lc"
        ),
    ),
    (
        Row((f"{SMOLLM}, 94 MiB",), Pick(result=LOAD_RUNS + "smollm2-load.json")),
        Row((f"{GEMMA}, 241 MiB",), Pick(result=LOAD_RUNS + "gemma-load.json")),
    ),
    QUANTIZATION.under(Pick(kind=AVX512)),
)

B16_RUNS = "quantization/2026-11-29-ac86ff7-smollm2-b16"
BATCH16_TABLE = Table(
    "cpu_batch16",
    ("host",),
    (
        Column(
            "float32, batch 16 (tok/s)",
            figure("decode", "tok/s", batch=16, mode="none").under(Pick(decimals=0)),
        ),
        Column(
            "`auto`, batch 16 (tok/s)",
            figure("decode", "tok/s", batch=16, mode="auto").under(Pick(decimals=0)),
        ),
        Column(
            "`auto` over float32",
            ratio_vs("decode", "none", batch=16, mode="auto").under(TWO_PLACES),
        ),
    ),
    (
        Row((HELD,), Pick(kind=HELD, result=B16_RUNS + "-avx2.json")),
        Row((AVX512,), Pick(kind=AVX512, result=B16_RUNS + ".json")),
    ),
    QUANTIZATION.under(Pick(labels={"vs": None})),
)

TABLES = (
    AVX2_HOST,
    HELD_TABLE,
    AVX512_TABLE,
    GEMMA_TABLE,
    AGREEMENT_TABLE,
    HF_THROUGHPUT,
    HF_STEP,
    LOAD_TABLE,
    BATCH16_TABLE,
)
