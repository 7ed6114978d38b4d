"""Speed on GPUs: the CUDA path against transformers, a decode step, the prefill kernel, and
weight-only kernels."""

from benchmarks.layout import Column, Pick, Row, Table
from benchmarks.tables.common import H100, H200, figure

HF = "transformers"
MEASURES = (
    ("throughput, batch 1 (tok/s)", figure("throughput", "tok/s", batch=1)),
    ("throughput, batch 16", figure("throughput", "tok/s", batch=16)),
    ("throughput, batch 64", figure("throughput", "tok/s", batch=64)),
    ("throughput, batch 256", figure("throughput", "tok/s", batch=256)),
    (
        "decode step at 8,000 tokens, batch 1 (ms)",
        figure("decode step", "ms", batch=1, context=8000),
    ),
    (
        "decode step at 8,000 tokens, batch 8 (ms)",
        figure("decode step", "ms", batch=8, context=8000),
    ),
    ("prefill of 8,000 tokens (tok/s)", figure("prefill", "tok/s", tokens=8000)),
)


def device_columns(kind: str, name: str) -> tuple[Column, ...]:
    return (
        Column(f"{name}: etinfer", Pick(kind=kind, labels={"engine": "etinfer"})),
        Column("transformers", Pick(kind=kind, labels={"engine": HF}), f"{name} hf"),
        Column(
            "ratio",
            Pick(kind=kind, unit="x", labels={"engine": "etinfer", "vs": HF}),
            f"{name} ratio",
        ),
    )


TRANSFORMERS = Table(
    "gpu_transformers",
    ("measure",),
    (*device_columns(H100, "H100"), *device_columns(H200, "H200")),
    tuple(Row((text,), pick) for text, pick in MEASURES),
    Pick(benchmark="speed", labels={"mode": None}),
)

STEP = Table(
    "gpu_step",
    ("a batch-16 decode step, graphs replayed",),
    (
        Column("host syncs", figure("host syncs", "count")),
        Column("host time (ms)", figure("host time", "ms")),
        Column("device time (ms)", figure("device time", "ms")),
        Column("kernel launches", figure("kernel launches", "count")),
        Column("host-device copies", figure("host-device copies", "count")),
    ),
    (Row(("SmolLM2-135M, bfloat16",)),),
    Pick(benchmark="step-profile", kind=H200, labels={"batch": 16}),
)

MS, TILED = Pick(decimals=2), Pick(decimals=2, note="tiles")
PREFILL_KERNEL = Table(
    "gpu_prefill_kernel",
    ("heads / KV heads / head dim",),
    (
        Column(
            "SDPA, gathered prefix (ms)", figure("prefill attention", "ms", arm="SDPA").under(MS)
        ),
        Column(
            "16-bit dots on tensor cores (ms; tiles)",
            figure("prefill attention", "ms", arm="tensor cores").under(TILED),
        ),
        Column("largest difference from SDPA", figure("max error", "", arm="tensor cores")),
        Column(
            "float32 dots (ms; tiles)",
            figure("prefill attention", "ms", arm="float32 dots").under(TILED),
        ),
        Column("largest difference", figure("max error", "", arm="float32 dots"), "f32 error"),
    ),
    tuple(
        Row((shape,), Pick(labels={"shape": shape}))
        for shape in ("9 / 3 / 64 (SmolLM2)", "32 / 8 / 128 (Llama-style)", "4 / 1 / 256 (Gemma 3)")
    ),
    Pick(benchmark="prefill-attention", kind=H200),
)

WEIGHT_ONLY = Table(
    "gpu_weight_only",
    ("measure",),
    (
        Column("bfloat16", Pick(labels={"mode": "none"})),
        Column("`int4`", Pick(labels={"mode": "int4"})),
        Column("`int8`", Pick(labels={"mode": "int8"})),
    ),
    tuple(Row((text,), pick) for text, pick in MEASURES if "batch 8" not in text),
    Pick(benchmark="speed", kind=H200, labels={"engine": "etinfer"}),
)

PRECISION = Table(
    "gpu_precision",
    ("weights",),
    (
        Column("top-1 vs float32", figure("top-1 agreement", "%")),
        Column("KL (nats)", figure("kl", "nats")),
    ),
    (
        Row(("bfloat16 weights and cache (CUDA's `auto`)",), Pick(labels={"mode": "auto"})),
        Row(("`int8`, the GPU's kernel",), Pick(labels={"mode": "int8"})),
        Row(("`int4`, the GPU's kernel",), Pick(labels={"mode": "int4"})),
    ),
    Pick(benchmark="quantization", kind=H200, labels={"vs": "float32"}),
)

TABLES = (TRANSFORMERS, STEP, PREFILL_KERNEL, WEIGHT_ONLY, PRECISION)
