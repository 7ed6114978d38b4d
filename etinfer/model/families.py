"""The model families by the architecture name a file gives (config.json's ``model_type``)."""

from __future__ import annotations

from etinfer.model.config import ModelConfig
from etinfer.model.family import Family
from etinfer.model.gemma3 import GEMMA3
from etinfer.model.llama import LLAMA

FAMILIES: dict[str, Family] = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "qwen3": LLAMA,  # the Llama layer with query/key norms, which it reads where they are
    "phi3": LLAMA,  # its fused projections are split at load (hf_folder.py)
    "gemma2": GEMMA3,  # Gemma 3's layer without query/key norms (read where they are)
    "gemma3_text": GEMMA3,
}


def family_of(config: ModelConfig) -> Family:
    return FAMILIES[config.architecture]
