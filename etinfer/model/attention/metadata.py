"""What every attention layer reads of a step's batch, built once a step by the model runner
(``engine/runner/step_inputs.py``): cache slots, the decode rows' layout and pattern, the prefill
chunks and their masks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from etinfer.model.attention.pattern import DecodePattern
from etinfer.model.block_layout import DecodeBlocks, PrefillContext
from etinfer.model.pruning_telemetry import PruningTelemetry


@dataclass
class PrefillChunk:
    start: int  # first row of the chunk in the step's flat batch
    length: int
    # Cache slots of positions [0, context) when the chunk follows a cached prefix, else None:
    # then the chunk's fresh keys and values are the whole context.
    context_slots: torch.Tensor | None
    mask: torch.Tensor | None  # [length, context] True where a query may attend
    # What a prefill selector needs to narrow the chunk's attention (None: dense); then
    # ``context_slots`` is always set.
    sparse: PrefillContext | None = None


@dataclass
class AttentionMetadata:
    """What every layer needs to know about this step's batch; built once per step."""

    slot_mapping: torch.Tensor  # [rows] cache slot each new token's key and value go to
    num_decode: int  # decode rows come first in the batch
    decode_blocks: DecodeBlocks | None
    # The decode rows' pattern where the backend reads one (``AttentionBackend.decode_metadata``)
    dense_pattern: DecodePattern | None
    prefills: list[PrefillChunk]
    fresh_blocks: torch.Tensor | None = None  # blocks receiving their first token this step
    telemetry: PruningTelemetry | None = None
    # KV compression: rows whose queries every layer copies out into ``captured[layer]``.
    capture_rows: torch.Tensor | None = None
    captured: torch.Tensor | None = None
    # Where some layers slide and others do not (Gemma 3): the step as the sliding layers see
    # it, the same batch with the window's decode pattern and prefill masks.
    local: AttentionMetadata | None = None


def prefill_mask(
    start: int, length: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor | None:
    """Visibility of keys [0, start + length) to the chunk's queries at positions start + i.

    None when plain causal masking over the chunk alone is exact (no prefix, no window).
    """
    context = start + length
    if start == 0 and (sliding_window is None or sliding_window >= length):
        return None
    query_pos = torch.arange(start, context, device=device)[:, None]
    key_pos = torch.arange(context, device=device)[None, :]
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    return mask
