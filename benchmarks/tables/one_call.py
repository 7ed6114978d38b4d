"""A decode step in one native call: the native decoder against the same engine layer by layer,
against what ``auto`` took before, and against llama.cpp, each row from the run that measured
it side by side."""

from benchmarks.layout import Column, Pick, Row, Table
from benchmarks.tables.common import AVX512, HELD, LLAMA_CPP, NOT_MEASURED, figure, ratio_vs

LC = LLAMA_CPP
RUNS = "quantization/2026-11-28-"
HELD_AB = RUNS + "73ee57e-one-call-avx2.json"  # auto against auto+layer-by-layer
HELD_RUN = RUNS + "36aed75-smollm2-avx2.json"  # auto against gguf-a32
AVX512_RUN = RUNS + "36aed75-smollm2.json"  # auto against int4
GEMMA_RUN = RUNS + "36aed75-gemma.json"


def arm(result: str, engine: str, mode: str | None = None) -> Pick:
    return Pick(result=result, labels={"engine": engine, "mode": mode})


def tok_s(subject: str, **labels) -> Pick:
    return figure(subject, "tok/s", **labels).under(Pick(decimals=1))


NO_FIDELITY = {"top1": NOT_MEASURED}
ONE_CALL_TABLE = Table(
    "cpu_one_call",
    ("host", "model", "engine"),
    (
        Column("decode, batch 1 (tok/s)", tok_s("decode", batch=1)),
        Column("batch 16", tok_s("decode", batch=16)),
        Column("prefill, 2,048 tokens (tok/s)", tok_s("prefill", tokens=2048)),
        Column(
            "top-1 vs float32",
            figure("top-1 agreement", "%", vs="float32").under(Pick(decimals=2)),
            "top1",
        ),
    ),
    (
        Row(
            (HELD, "SmolLM2-135M", "`auto`, one call"),
            arm(HELD_AB, "etinfer", "auto"),
            NO_FIDELITY,
        ),
        Row(
            (HELD, "SmolLM2-135M", "`auto`, layer by layer"),
            arm(HELD_AB, "etinfer", "auto+layer-by-layer"),
            NO_FIDELITY,
        ),
        Row((HELD, "SmolLM2-135M", "llama.cpp, AVX2 build"), arm(HELD_AB, LC), NO_FIDELITY),
        Row((HELD, "SmolLM2-135M", "`auto`, one call"), arm(HELD_RUN, "etinfer", "auto")),
        Row(
            (HELD, "SmolLM2-135M", "`gguf-a32` (float32 activations; `auto` before), one call"),
            arm(HELD_RUN, "etinfer", "gguf-a32"),
        ),
        Row((HELD, "SmolLM2-135M", "llama.cpp, AVX2 build"), arm(HELD_RUN, LC)),
        Row((AVX512, "SmolLM2-135M", "`auto`, one call"), arm(AVX512_RUN, "etinfer", "auto")),
        Row(
            (AVX512, "SmolLM2-135M", "`int4` (torch's int4 kernel), layer by layer"),
            arm(AVX512_RUN, "etinfer", "int4"),
        ),
        Row((AVX512, "SmolLM2-135M", "llama.cpp, built for the host"), arm(AVX512_RUN, LC)),
        Row((AVX512, "Gemma 3 270M", "`auto`, one call"), arm(GEMMA_RUN, "etinfer", "auto")),
        Row((AVX512, "Gemma 3 270M", "llama.cpp, built for the host"), arm(GEMMA_RUN, LC)),
    ),
    Pick(benchmark="quantization"),
)

SPEEDUP_TABLE = Table(
    "cpu_one_call_ratios",
    ("host", "model", "engine"),
    (
        Column("batch 1 over llama.cpp", ratio_vs("decode", LC, batch=1)),
        Column("batch 16", ratio_vs("decode", LC, batch=16)),
    ),
    (
        Row((HELD, "SmolLM2-135M", "`auto`, one call"), arm(HELD_AB, "etinfer", "auto")),
        Row(
            (HELD, "SmolLM2-135M", "`auto`, layer by layer"),
            arm(HELD_AB, "etinfer", "auto+layer-by-layer"),
        ),
        Row((AVX512, "SmolLM2-135M", "`auto`, one call"), arm(AVX512_RUN, "etinfer", "auto")),
        Row((AVX512, "Gemma 3 270M", "`auto`, one call"), arm(GEMMA_RUN, "etinfer", "auto")),
    ),
    Pick(benchmark="quantization", decimals=2),
)

TABLES = (ONE_CALL_TABLE, SPEEDUP_TABLE)
