"""Shared fixtures: the real default model, read once per session, and engines over it."""

from __future__ import annotations

import pytest
import torch

from etinfer import LLM
from etinfer.model.loader import LoadedModel, default_model_path, load_model

# Prompts of varied kinds and lengths; their greedy continuations do not end within 64 tokens
# for every one of them, so EOS handling is exercised too.
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the mountains, there lived an old clockmaker who",
    "1, 2, 3, 4, 5,",
    "The three primary colors are",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Photosynthesis is the process by which plants",
]


@pytest.fixture(scope="session")
def loaded_model() -> LoadedModel:
    return load_model()


@pytest.fixture(scope="session")
def llm(loaded_model: LoadedModel) -> LLM:
    """The default engine over the real model (float32, CPU)."""
    return LLM(loaded_model, max_num_seqs=16)


@pytest.fixture(scope="session")
def make_llm(loaded_model: LoadedModel):
    """Engines with other settings over the same weights (no second read of the file)."""

    def make(**kwargs) -> LLM:
        return LLM(loaded_model, **kwargs)

    return make


@pytest.fixture(scope="session")
def hf_reference(loaded_model: LoadedModel):
    """transformers' own model, read by transformers' own GGUF loader from the same file."""
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    model.eval()
    return model


def assert_pool_free(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.kv.pool.num_free_blocks == engine.num_blocks
    assert all(count == 0 for count in engine.kv.pool.ref_counts)
