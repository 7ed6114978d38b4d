"""The KV cache's element types on the real model: how far each is from a float32 cache, the
native and torch paths reading them alike, the pool's size, and the choice's errors."""

import pytest
import torch

from etinfer import SamplingParams
from etinfer.bench.common.fidelity import divergences, forced_log_probs
from etinfer.bench.speed.kv_cache import fidelity_texts
from etinfer.config import EngineConfig
from etinfer.control.block_selection import PruningConfig
from etinfer.control.config import ControlConfig
from etinfer.model import native_kernels
from tests.conftest import ON_CUDA, PROMPTS, cpu_only

# Teacher-forced against a float32 cache on float weights, 256 tokens of context then 32 forced
# (BENCHMARKS.md, "A 16-bit KV cache", has the figures at 2K): the largest mean KL each may have.
KL_BOUNDS = {"float16": 1e-5, "bfloat16": 2e-4, "int8": 3e-3}


@pytest.fixture(scope="module")
def forced(make_llm):
    """Each cache type's forced pass over the same text, on float weights."""
    passes = {}
    for name in ("float32", *KL_BOUNDS):
        llm = make_llm(quantization="none", dtype="float32", kv_cache_dtype=name, max_num_seqs=4)
        texts = fidelity_texts(llm, 2, 256 + 32)
        passes[name] = forced_log_probs(llm, texts, 256, 32)
    return passes


@pytest.mark.parametrize("name", list(KL_BOUNDS))
def test_each_cache_type_follows_a_float32_cache_on_real_text(forced, name):
    kl, agree = divergences(forced["float32"], forced[name])
    assert sum(kl) / len(kl) < KL_BOUNDS[name]
    assert sum(agree) / len(agree) >= 0.95
    assert max(kl) > 0  # the cache rounds: a pass that read float32 would show nothing


def test_the_default_cache_is_16_bit_and_holds_twice_the_blocks(make_llm):
    default = make_llm(kv_cache_gib=0.05, kv_cache_dtype="auto")
    # float16 on the CPU (F16C widens it as the kernel loads), bfloat16 on CUDA.
    assert default.engine.runner.cache.dtype == (torch.bfloat16 if ON_CUDA else torch.float16)
    wide = make_llm(kv_cache_gib=0.05, kv_cache_dtype="float32")
    narrow = make_llm(kv_cache_gib=0.05, kv_cache_dtype="int8")
    # A block is 16 tokens of 30 layers x 3 KV heads x (key, value) rows of 64 elements; an int8
    # row carries a float32 scale: 68 bytes against 128 (float16) and 256 (float32).
    pool, rows = int(0.05 * 2**30), 16 * 30 * 3 * 2
    for llm, row_bytes in ((wide, 256), (default, 128), (narrow, 68)):
        assert llm.engine.num_blocks == pool // (rows * row_bytes)


@cpu_only
@pytest.mark.skipif(not native_kernels.available(), reason="no native kernels")
@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16", "int8"])
def test_the_torch_path_reads_the_cache_as_the_native_kernel_does(make_llm, name):
    """Decode over each cache type in torch operations (off the CPU, without a compiler), in an
    engine that picks the torch backend by name: the first decode step, over what prefill
    stored (SDPA's in both engines), gives the native kernel's logprobs within float32
    rounding. Later steps read keys written after a step of each path; a last-bit difference
    can move a 16- or 8-bit rounding of those, so only the tokens are compared. int8: a
    last-bit difference moves a code by one step of 1/127 of its block's range (1.0e-3 held to
    AVX2); a misread scale or offset moves it by far more."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    native, torch_path = (
        make_llm(
            quantization="none", kv_cache_dtype=name, max_num_seqs=4, attention_backend=backend
        ).generate(PROMPTS[:3], params)
        for backend in ("native", "torch")
    )
    for a, b in zip(native, torch_path, strict=True):
        assert a.token_ids == b.token_ids
        token = a.token_ids[1]  # the first decode step's
        within = 3e-3 if name == "int8" else 5e-4
        expected = pytest.approx(b.logprobs[1][token].logprob, abs=within)
        assert a.logprobs[1][token].logprob == expected


def test_pruning_and_prefix_caching_run_on_an_int8_cache(make_llm):
    """The pruning layer's key bounds hold the stored keys; a prompt served again from the
    prefix cache decodes as it did the first time."""
    llm = make_llm(
        kv_cache_dtype="int8",
        control=ControlConfig(pruning=PruningConfig(min_context=64, min_blocks=3, dense_layers=0)),
        max_num_seqs=4,
    )
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = PROMPTS[3] * 6
    first, again = (llm.generate([prompt], params)[0] for _ in range(2))
    assert again.num_cached_tokens > 0
    assert again.token_ids == first.token_ids
    assert first.blocks_kept and min(first.blocks_kept) < 1.0


def test_an_unknown_cache_type_lists_the_accepted_ones():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*'float16'.*'int8'"):
        EngineConfig(kv_cache_dtype="fp8")
