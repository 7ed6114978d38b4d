"""What sets a model family apart from the Llama decoder's shared machinery (``llama.py``): its
decoder layer, and the few things the model does around the layers differently."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    # Builds one decoder layer: (ModelConfig, WeightReader, weight-name prefix) -> the layer.
    layer: Callable[..., Any]
    # Added to every RMSNorm weight as read (Gemma's norms scale by 1 + weight).
    norm_offset: float = 0.0
    # Embeddings are multiplied by sqrt(hidden_size), rounded to the weights' dtype (Gemma).
    scales_embeddings: bool = False
