"""Which features combine: one table, as data, and the one check that reads it.

The features are what a configuration switches on (the control layers, speculative decoding,
jump-forward, batch invariance, CUDA graphs), what a model brings (soft caps, sliding windows),
the device and the KV cache's dtype. Every pair that does not combine is a ``Pair`` of
``REFUSED`` with its reason; ``NOTES`` says where a pair combines with a caveat (which kernel
computes it, what then runs eagerly). ``check_compatible`` is the one place a combination is
refused: ``EngineConfig`` calls it for what the config decides, the engine's build again once
the model is known. The README's table is ``render_markdown()``
(``python -m etinfer.compatibility`` prints it). Which attention backend runs where is not a
pair of this table but each backend's ``refusal`` (``model/attention/``): it turns on what this
host has (the native library built, Triton installed or interpreted), not only on settings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from etinfer.model.config import ModelConfig

LAYER, MODEL, DEVICE, KV_DTYPE = "layer", "model", "device", "KV cache dtype"


@dataclass(frozen=True, eq=False)
class Feature:
    name: str  # as the table shows it
    setting: str  # what switches it on, as errors name it
    group: str  # LAYER, MODEL, DEVICE or KV_DTYPE
    # Whether it is on: read from the EngineConfig, or for a MODEL feature the ModelConfig.
    on: Callable[[Any], bool]
    # Features that are values of one setting (a device, a drafter) are alternatives, never a
    # pair: the setting they share.
    choice: str | None = None


def _kv_dtype(config: Any) -> str:
    return str(config.torch_kv_cache_dtype()).removeprefix("torch.")


def _speculative(method: str) -> Feature:
    return Feature(
        method,
        f"speculative (method {method!r})",
        LAYER,
        lambda c: c.speculative is not None and c.speculative.method == method,
        choice="speculative.method",
    )


SAMPLING = Feature("sampling", "control.sampling", LAYER, lambda c: c.control.sampling)
PRUNING = Feature("pruning", "control.pruning", LAYER, lambda c: bool(c.control.pruning_config))
SCHEDULING = Feature(
    "scheduling", "control.scheduling", LAYER, lambda c: bool(c.control.scheduling_config)
)
SPARSE_PREFILL = Feature(
    "sparse prefill",
    "control.sparse_prefill",
    LAYER,
    lambda c: bool(c.control.sparse_prefill_config),
)
KV_COMPRESSION = Feature(
    "KV compression",
    "control.kv_compression",
    LAYER,
    lambda c: bool(c.control.kv_compression_config),
)
SWITCHING = Feature(
    "switching", "control.switching", LAYER, lambda c: bool(c.control.switching_config)
)
NGRAM, DRAFT = _speculative("ngram"), _speculative("draft")
STEP_SHAPER = Feature(
    "own step shaper", "step_shaper (not 'plain')", LAYER, lambda c: c.step_shaper != "plain"
)
JUMP_FORWARD = Feature("jump-forward", "jump_forward", LAYER, lambda c: c.jump_forward)
BATCH_INVARIANT = Feature("batch invariant", "batch_invariant", LAYER, lambda c: c.batch_invariant)
CUDA_GRAPHS = Feature("CUDA graphs", "cuda_graphs", LAYER, lambda c: c.cuda_graphs)
SOFT_CAPS = Feature(
    "soft caps",
    "a model whose attention scores are soft-capped (Gemma 2's attention_softcap)",
    MODEL,
    lambda m: m.attention_softcap is not None,
)
WINDOW_EVERYWHERE = Feature(
    "window on every layer",
    "a model whose every layer slides (Mistral's sliding_window)",
    MODEL,
    lambda m: m.uniform_window is not None,
    choice="the model's windows",
)
MIXED_WINDOWS = Feature(
    "mixed windows",
    "a model whose layers differ in their window (Gemma 3's layer_windows)",
    MODEL,
    lambda m: m.mixed_windows,
    choice="the model's windows",
)


def _device(kind: str) -> Feature:
    return Feature(kind, f"device={kind!r}", DEVICE, lambda c: c.device_type() == kind, "device")


def _kv(dtype: str) -> Feature:
    setting = f"kv_cache_dtype={dtype!r}"
    return Feature(dtype, setting, KV_DTYPE, lambda c: _kv_dtype(c) == dtype, "kv_cache_dtype")


CPU, CUDA = _device("cpu"), _device("cuda")
FLOAT32, FLOAT16, BFLOAT16, INT8 = (_kv(n) for n in ("float32", "float16", "bfloat16", "int8"))

FEATURES: tuple[Feature, ...] = (
    SAMPLING,
    PRUNING,
    SCHEDULING,
    SPARSE_PREFILL,
    KV_COMPRESSION,
    SWITCHING,
    NGRAM,
    DRAFT,
    STEP_SHAPER,
    JUMP_FORWARD,
    BATCH_INVARIANT,
    CUDA_GRAPHS,
    SOFT_CAPS,
    WINDOW_EVERYWHERE,
    MIXED_WINDOWS,
    CPU,
    CUDA,
    FLOAT32,
    FLOAT16,
    BFLOAT16,
    INT8,
)


@dataclass(frozen=True)
class Pair:
    first: Feature
    second: Feature
    reason: str

    def joins(self, a: Feature, b: Feature) -> bool:
        return {a, b} == {self.first, self.second}


COMPRESSED_CACHE = (
    "a compressed cache (fewer entries than positions) does not yet take steps that compute "
    "several positions of a sequence (drafts, a catch-up) or roll it back"
)
CHOOSES_BLOCKS = (
    "pruning and sparse prefill choose per step which blocks a row reads, so a row's result "
    "depends on its step anyway"
)
UNCAPPED_RANKING = (
    "pruning, sparse prefill and KV compression rank attention scores without the soft cap"
)
SHAPED_TWICE = (
    "switching and speculative decoding each decide who writes a sequence's next tokens, and "
    "do not share that decision yet"
)
SPECULATION_SHAPES = "speculative decoding shapes the steps itself"
GATHERED_PREFIX = (
    "a prefill chunk after a cached prefix gathers the prefix for SDPA; the paged-prefill "
    "kernel reads only a 16-bit cache in place"
)
DRAFTS_EAGER = "steps with drafts run eagerly; plain decode steps replay"
NO_GRAPHS = "no graphs are captured, every step runs eagerly (a graph replays a plain step)"

REFUSED: tuple[Pair, ...] = (
    Pair(KV_COMPRESSION, NGRAM, COMPRESSED_CACHE),
    Pair(KV_COMPRESSION, DRAFT, COMPRESSED_CACHE),
    Pair(KV_COMPRESSION, SWITCHING, COMPRESSED_CACHE),
    Pair(JUMP_FORWARD, KV_COMPRESSION, COMPRESSED_CACHE),
    Pair(SWITCHING, NGRAM, SHAPED_TWICE),
    Pair(SWITCHING, DRAFT, SHAPED_TWICE),
    Pair(
        SWITCHING,
        SPARSE_PREFILL,
        "switching's catch-up chunks are prefill over generated tokens, which must stay exact",
    ),
    Pair(JUMP_FORWARD, SWITCHING, "switching's small-model rows take no drafts"),
    Pair(BATCH_INVARIANT, PRUNING, CHOOSES_BLOCKS),
    Pair(BATCH_INVARIANT, SPARSE_PREFILL, CHOOSES_BLOCKS),
    Pair(NGRAM, STEP_SHAPER, SPECULATION_SHAPES),
    Pair(DRAFT, STEP_SHAPER, SPECULATION_SHAPES),
    Pair(PRUNING, SOFT_CAPS, UNCAPPED_RANKING),
    Pair(SPARSE_PREFILL, SOFT_CAPS, UNCAPPED_RANKING),
    Pair(KV_COMPRESSION, SOFT_CAPS, UNCAPPED_RANKING),
    Pair(
        SPARSE_PREFILL,
        WINDOW_EVERYWHERE,
        "a window on every layer leaves no layer that reads the whole context to narrow",
    ),
    Pair(
        KV_COMPRESSION,
        WINDOW_EVERYWHERE,
        "KV compression needs layers that see the whole context, and every layer reads no more "
        "than its window",
    ),
)

NOTES: tuple[Pair, ...] = (
    Pair(
        SOFT_CAPS,
        CPU,
        "decode attention takes its torch form, which computes the cap; the native C kernel "
        "computes plain scores, and the engine does not pick it",
    ),
    Pair(SOFT_CAPS, CUDA, "the GPU's decode kernel (Triton) computes the cap"),
    Pair(MIXED_WINDOWS, PRUNING, "the sliding layers read their window; the others are pruned"),
    Pair(
        MIXED_WINDOWS,
        SPARSE_PREFILL,
        "the sliding layers read their window; the others are narrowed",
    ),
    Pair(
        MIXED_WINDOWS,
        KV_COMPRESSION,
        "the other layers vote, the sliding ones keep their most recent positions: "
        "control.kv_compression.budget must hold the window (checked when the engine is built)",
    ),
    Pair(CUDA_GRAPHS, CPU, "CUDA only: on the CPU every step runs eagerly"),
    Pair(FLOAT32, CUDA, GATHERED_PREFIX),
    Pair(INT8, CUDA, GATHERED_PREFIX),
    Pair(CUDA_GRAPHS, PRUNING, NO_GRAPHS),
    Pair(CUDA_GRAPHS, SPARSE_PREFILL, NO_GRAPHS),
    Pair(CUDA_GRAPHS, KV_COMPRESSION, NO_GRAPHS),
    Pair(CUDA_GRAPHS, BATCH_INVARIANT, NO_GRAPHS),
    Pair(CUDA_GRAPHS, NGRAM, DRAFTS_EAGER),
    Pair(CUDA_GRAPHS, DRAFT, DRAFTS_EAGER),
    Pair(CUDA_GRAPHS, JUMP_FORWARD, DRAFTS_EAGER),
    Pair(CUDA_GRAPHS, SWITCHING, "the small model's rows run eagerly; the large model's replay"),
)


def refusal(a: Feature, b: Feature) -> Pair | None:
    """The table's entry refusing ``a`` with ``b``, in either order, if there is one."""
    return _entry(REFUSED, a, b)


def note(a: Feature, b: Feature) -> Pair | None:
    """The caveat of ``a`` with ``b``, in either order, if there is one."""
    return _entry(NOTES, a, b)


def _entry(pairs: tuple[Pair, ...], a: Feature, b: Feature) -> Pair | None:
    return next((pair for pair in pairs if pair.joins(a, b)), None)


def switched_on(config: Any, model: ModelConfig | None = None) -> list[Feature]:
    """The features ``config`` (an EngineConfig) switches on, its device and KV dtype, and
    ``model``'s features where it is given."""

    def on(feature: Feature) -> bool:
        if feature.group == MODEL:
            return model is not None and feature.on(model)
        return feature.on(config)

    return [feature for feature in FEATURES if on(feature)]


def check_compatible(config: Any, model: ModelConfig | None = None) -> None:
    """Refuse ``config`` (an EngineConfig) where two features it switches on, or one of them and
    a feature of its device, its KV dtype or (once known) ``model``, do not combine: a
    ``ValueError`` naming both settings and the table's reason."""
    on = switched_on(config, model)
    for pair in REFUSED:
        if pair.first in on and pair.second in on:
            raise ValueError(
                f"{pair.first.setting} and {pair.second.setting} cannot be combined: {pair.reason}"
            )


def render_markdown() -> str:
    """The table as the README shows it: a row for every feature, a column for every one a
    configuration switches and for each device; ✓ combines, ✗ is refused, a number is the
    footnote giving the reason or the caveat, — a feature with itself or an alternative of the
    same setting."""
    columns = [feature for feature in FEATURES if feature.group in (LAYER, DEVICE)]
    footnotes: dict[str, int] = {}

    def cell(row: Feature, column: Feature) -> str:
        if row is column or (row.choice is not None and row.choice == column.choice):
            return "—"
        refused, noted = refusal(row, column), note(row, column)
        entry = refused or noted
        if entry is None:
            return "✓"
        number = footnotes.setdefault(entry.reason, len(footnotes) + 1)
        return f"{'✗' if refused else '✓'} {number}"

    lines = [
        "| | " + " | ".join(column.name for column in columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for row in FEATURES:
        label = row.name if row.group == LAYER else f"{row.group}: {row.name}"
        lines.append(f"| {label} | " + " | ".join(cell(row, c) for c in columns) + " |")
    lines.append("")
    lines += [f"{number}. {reason}" for reason, number in footnotes.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_markdown(), end="")
