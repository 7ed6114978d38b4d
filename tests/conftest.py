"""Shared fixtures: the real default model, read once per session, and engines over it."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

from etinfer import LLM, SamplingParams
from etinfer.config import DEVICE_ENV
from etinfer.model.attention.pattern import DecodePattern
from etinfer.model.catalog import default_model_path
from etinfer.model.loader import LoadedModel, load_model

# The device every engine of the suite runs on (``device="auto"`` reads it): the CPU unless the
# run says otherwise, as `ETINFER_DEVICE=cuda pytest` does on a machine with a GPU. Servers the
# tests start inherit it.
os.environ.setdefault(DEVICE_ENV, "cpu")
ON_CUDA = os.environ[DEVICE_ENV].startswith("cuda")
# Without a GPU the GPU's Triton kernels run in Triton's CPU interpreter (their tests check them
# there). Triton reads the variable when a kernel is defined, so it is set before anything can
# import Triton: transformers does, and a kernel defined after that read saw it unset.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
cpu_only = pytest.mark.skipif(ON_CUDA, reason="a CPU kernel or a CPU-specific default")
# What the suite's shared engines assert (the same tokens however a batch is cut, after
# preemption, with each layer at its identity) is exact in float32. On the CPU ``auto`` is
# float32 weights already; on CUDA it is bfloat16 weights and cache, whose roundings turn
# float32's last-bit differences between two paths (cuBLAS picks its kernels by the row
# count) into differences of 1e-3, so there the shared engines take float32 weights and cache,
# and bfloat16 has tests of its own (test_device_defaults.py).
ENGINE_DEFAULTS = {"dtype": "float32", "kv_cache_dtype": "float32"} if ON_CUDA else {}
# The engine fuzz's long run (tests/engine/test_engine_fuzz.py): 600 runs of 50 rules.
settings.register_profile(
    "fuzz-long",
    max_examples=600,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)

# What the markers mean (pyproject.toml lists them; ``make test-unit`` runs the rest):
# ``model``: the test computes with the real model's weights, through one of these fixtures or
# one built on ``loaded_model`` (the tiny random model reads only its tokenizer and shapes);
# ``server``: it starts a server (every test under tests/server/ and tests/cluster/, and those
# marked so elsewhere); ``gpu``: it checks a GPU kernel or path (tests/gpu/, in Triton's
# interpreter where there is no GPU); ``slow``: more than a few seconds however it is built.
MODEL_FIXTURES = {"llm", "float_llm", "make_llm", "hf_reference"}
FOLDER_MARKERS = {"server": "server", "cluster": "server", "gpu": "gpu"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        folder = item.path.parent.name
        if folder in FOLDER_MARKERS:
            item.add_marker(FOLDER_MARKERS[folder])
        if _computes_with_the_model(item):
            item.add_marker("model")


def _computes_with_the_model(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    if MODEL_FIXTURES & set(info.names_closure) or "loaded_model" in info.argnames:
        return True
    # A module's own fixture built on the model (an engine, a server) makes its tests the model's.
    return any(
        "loaded_model" in definition.argnames
        for name, definitions in info.name2fixturedefs.items()
        if name not in ("tiny_model", "loaded_model")
        for definition in definitions
    )


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
def loaded_model() -> Iterator[LoadedModel]:
    """Read once a session. Tests build engines one after another, and engines share a prepared
    form of the weights only while one holds it: the session keeps every form it prepared, or
    each engine would prepare its form again (0.4 s in 4 bits, 1.6 s in float32)."""
    model = load_model()
    with model.keeping_prepared():
        yield model


@pytest.fixture(scope="session")
def tiny_model(loaded_model: LoadedModel) -> LoadedModel:
    """Random weights of a two-layer model with the real tokenizer and vocabulary: for tests of
    mechanics that need thousands of steps, never of what a model says."""
    config = dataclasses.replace(
        loaded_model.config,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    generator = torch.Generator().manual_seed(0)

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.2

    hidden, inner = config.hidden_size, config.intermediate_size
    kv = config.num_kv_heads * config.head_dim
    weights = {
        "model.embed_tokens.weight": random(config.vocab_size, hidden),
        "model.norm.weight": torch.ones(hidden),
    }
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        weights |= {
            prefix + "input_layernorm.weight": torch.ones(hidden),
            prefix + "post_attention_layernorm.weight": torch.ones(hidden),
            prefix + "self_attn.q_proj.weight": random(hidden, hidden),
            prefix + "self_attn.k_proj.weight": random(kv, hidden),
            prefix + "self_attn.v_proj.weight": random(kv, hidden),
            prefix + "self_attn.o_proj.weight": random(hidden, hidden),
            prefix + "mlp.gate_proj.weight": random(inner, hidden),
            prefix + "mlp.up_proj.weight": random(inner, hidden),
            prefix + "mlp.down_proj.weight": random(hidden, inner),
        }
    return LoadedModel(loaded_model.path, config, weights, loaded_model.tokenizer)


@pytest.fixture(scope="session")
def llm(loaded_model: LoadedModel) -> LLM:
    """The default engine over the real model: the file's own 4-bit weights on the CPU."""
    return LLM(loaded_model, max_num_seqs=16, **ENGINE_DEFAULTS)


@pytest.fixture(scope="session")
def float_llm(loaded_model: LoadedModel) -> LLM:
    """The engine on weights dequantized to float32 and a float32 KV cache: token for token what
    transformers computes."""
    return LLM(
        loaded_model,
        max_num_seqs=16,
        quantization="none",
        dtype="float32",
        kv_cache_dtype="float32",
    )


@pytest.fixture(scope="session")
def make_llm(loaded_model: LoadedModel):
    """Engines with other settings over the same weights (no second read of the file)."""

    def make(**kwargs) -> LLM:
        return LLM(loaded_model, **ENGINE_DEFAULTS | kwargs)

    return make


@contextlib.contextmanager
def gguf_files_parsed_once() -> Iterator[None]:
    """transformers parses a GGUF file's header with gguf's reader at each read: twice for a
    model (its config, then its weights) and once more for a tokenizer, 16 s each for Gemma 3's
    262K-token vocabulary on a slow host. The reader only reads (a read-only memory map), so in
    this block one reader a file serves every read, and transformers builds the same model."""
    import gguf

    read = functools.cache(gguf.GGUFReader)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", read)
        try:
            yield
        finally:
            read.cache_clear()


@pytest.fixture(scope="session")
def hf_reference(loaded_model: LoadedModel):
    """transformers' own model, read by transformers' own GGUF loader from the same file."""
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    with gguf_files_parsed_once():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    model.eval()
    return model


def rows_read(pattern: DecodePattern) -> list[list[int]]:
    """Per query row of a decode pattern, the cache rows it attends to (masked entries out)."""
    inside = torch.ones(pattern.nnz, dtype=torch.bool)
    inside[pattern.masked] = False
    bounds = pattern.crow.tolist()
    return [pattern.cols[a:b][inside[a:b]].tolist() for a, b in itertools.pairwise(bounds)]


def assert_pool_free(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.kv.pool.num_free_blocks == engine.num_blocks
    assert all(count == 0 for count in engine.kv.pool.ref_counts)


def assert_alone_equals_batched(llm: LLM) -> None:
    """A prompt's greedy tokens and logprobs are the same alone and in a batch of three."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    alone = llm.generate([PROMPTS[3]], params)[0]
    batched = llm.generate([PROMPTS[0], PROMPTS[3], PROMPTS[6]], params)[1]
    assert batched.token_ids == alone.token_ids
    assert [p[t].logprob for p, t in zip(batched.logprobs, batched.token_ids, strict=True)] == [
        p[t].logprob for p, t in zip(alone.logprobs, alone.token_ids, strict=True)
    ]
