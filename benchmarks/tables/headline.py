"""The first screen's speed: against llama.cpp and against transformers, by host kind."""

from benchmarks.layout import Column, Parts, Pick, Ratio, Row, Table
from benchmarks.tables.common import (
    AVX2,
    AVX512,
    GEMMA,
    GEMMA_FILE,
    H100,
    H200,
    HELD,
    LLAMA3_8B,
    LLAMA32_1B,
    LLAMA_1B,
    LLAMA_CPP,
    NOT_MEASURED,
    SMOLLM,
    SMOLLM_FILE,
    figure,
    ratio_vs,
)

LC = LLAMA_CPP


def tok_s_ratio(subject: str, mode: str, suffix: str = "", **labels) -> Ratio:
    """etinfer's ``mode`` over llama.cpp, from the tok/s of a run that kept no ratio."""
    return Ratio(
        figure(subject, "tok/s", engine="etinfer", mode=mode, **labels),
        figure(subject, "tok/s", engine=LC, **labels),
        suffix,
    )


def mode(name: str) -> Pick:
    return Pick(labels={"mode": name})


NOTED = Pick(note="mode")
NOT_HERE = {"b16": NOT_MEASURED, "top1": NOT_MEASURED, "top1lc": NOT_MEASURED}
RANDOM = "random weights"  # agreement with float32 says nothing of a format on them
# Past the cache: ``auto`` runs the block kernels there, so its column is theirs.
BEYOND = {
    "b16": mode("auto"),
    "prefill": tok_s_ratio("prefill", "auto", " (auto)"),
    "top1": RANDOM,
    "top1lc": RANDOM,
}
# Where ``auto`` is ``gguf`` with decode steps in one native call: its figures are ``gguf``'s.
ONE_CALL = {
    "b1gguf": "= auto",
    "b16": mode("auto"),
    "prefill": tok_s_ratio("prefill", "auto", " (auto)"),
    "top1": mode("auto"),
}
LLAMA_CPP_TABLE = Table(
    "headline_llamacpp",
    ("host", "model (file)"),
    (
        Column("batch 1, `auto`", ratio_vs("decode", LC, batch=1, mode="auto"), "b1auto"),
        Column("batch 1, `gguf`", ratio_vs("decode", LC, batch=1, mode="gguf"), "b1gguf"),
        Column("batch 16", ratio_vs("decode", LC, batch=16).under(NOTED), "b16"),
        Column("prefill", ratio_vs("prefill", LC).under(NOTED), "prefill"),
        Column(
            "top-1 vs float32: etinfer",
            figure("top-1 agreement", "%", vs="float32", engine="etinfer", path=None).under(NOTED),
            "top1",
        ),
        Column(
            "llama.cpp", figure("top-1 agreement", "%", vs="float32", engine=LC, arm=None), "top1lc"
        ),
    ),
    (
        Row((AVX2, f"{SMOLLM}, 94 MiB"), Pick(kind=AVX2, labels={"model": SMOLLM}), NOT_HERE),
        Row((AVX2, f"{GEMMA}, 241 MiB"), Pick(kind=AVX2, labels={"model": GEMMA}), NOT_HERE),
        Row(
            (AVX2, f"{LLAMA_1B}, 630 MiB (past the 32 MiB L3)"),
            Pick(kind=AVX2, labels={"model": LLAMA_1B}),
            NOT_HERE | {"prefill": Parts((mode("gguf"), mode("auto")), ", ")},
        ),
        Row(
            (HELD, f"{SMOLLM}, 94 MiB"),
            Pick(kind=HELD, labels={"model": SMOLLM_FILE}),
            ONE_CALL,
        ),
        Row(
            (HELD, f"{GEMMA}, 241 MiB (`auto` is `gguf`)"),
            Pick(kind=HELD, labels={"model": GEMMA_FILE}),
            ONE_CALL | {"top1": NOT_MEASURED, "top1lc": NOT_MEASURED},
        ),
        Row(
            (AVX512, f"{SMOLLM}, 94 MiB"),
            Pick(kind=AVX512, labels={"model": SMOLLM_FILE}),
            ONE_CALL,
        ),
        Row(
            (AVX512, f"{GEMMA}, 241 MiB"),
            Pick(kind=AVX512, labels={"model": GEMMA}),
            {"b16": mode("gguf"), "prefill": mode("gguf"), "top1": mode("gguf")},
        ),
        Row(
            (AVX512, f"{GEMMA}, 241 MiB (`auto` is `gguf`)"),
            # The run of two rounds at batches 1 and 16, not the one-round agreement run after it.
            Pick(
                kind=AVX512,
                labels={"model": GEMMA_FILE},
                result="quantization/2026-11-29-85d0a7b-gemma-dense-prefill.json",
            ),
            ONE_CALL,
        ),
        Row(
            (HELD, "Llama 3.2 1B shape, random weights, Q4_0, 578 MiB (past the 480 MiB L3)"),
            Pick(kind=HELD, labels={"model": LLAMA32_1B}),
            BEYOND | {"b1gguf": "= auto"},
        ),
        Row(
            (AVX512, "Llama 3.2 1B shape, random weights, Q4_0, 578 MiB (past the 480 MiB L3)"),
            Pick(kind=AVX512, labels={"model": LLAMA32_1B}),
            BEYOND,
        ),
        Row(
            (AVX512, "Llama 3 8B shape, random weights, Q4_0, 3,963 MiB"),
            Pick(kind=AVX512, labels={"model": LLAMA3_8B}),
            BEYOND | {"b16": NOT_MEASURED},
        ),
    ),
    Pick(benchmark="quantization", decimals=2),
)

VS_HF = "transformers"
TRANSFORMERS_TABLE = Table(
    "headline_transformers",
    ("host", "model, precision"),
    (
        Column("throughput, batch 1", ratio_vs("throughput", VS_HF, batch=1)),
        Column("batch 16", ratio_vs("throughput", VS_HF, batch=16)),
        Column("largest batch", ratio_vs("throughput", VS_HF).under(Pick(note="batch")), "big"),
        Column(
            "decode step at 8K tokens, batch 1",
            ratio_vs("decode step", VS_HF, batch=1, context=8000),
        ),
        Column("batch 8", ratio_vs("decode step", VS_HF, batch=8, context=8000), "step8"),
        Column("prefill of 8K tokens", ratio_vs("prefill", VS_HF, tokens=8000), "prefill"),
    ),
    (
        Row(
            (AVX2, "SmolLM2-135M, float32 both"),
            Pick(kind=AVX2),
            {"big": Pick(labels={"batch": 32}), "prefill": NOT_MEASURED},
        ),
        Row(
            (H100, "SmolLM2-135M's shapes, random weights, bfloat16 both"),
            Pick(kind=H100),
            {"big": Pick(labels={"batch": 256})},
        ),
        Row(
            (H200, "SmolLM2-135M, bfloat16 both"),
            Pick(kind=H200),
            {"big": Pick(labels={"batch": 256})},
        ),
    ),
    Pick(benchmark="speed"),
)

TABLES = (LLAMA_CPP_TABLE, TRANSFORMERS_TABLE)
