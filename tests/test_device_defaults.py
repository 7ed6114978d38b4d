"""What ``auto`` resolves to on each device, the variable that picks the device, and bfloat16
weights and cache (CUDA's default) against float32 on real text."""

import statistics

import pytest
import torch

from etinfer import LLM, EngineConfig
from etinfer.bench.common.fidelity import divergences, forced_log_probs
from etinfer.bench.speed.kv_cache import fidelity_texts
from etinfer.config import DEVICE_ENV
from tests.conftest import ON_CUDA

# Mean KL(float32 || bfloat16) per forced token; measured 0.0010 on the CPU (4 windows of 128
# tokens, 64 forced each; top-1 agreement 97.6 %, 97.2 % held to AVX2; with 256 tokens 0.0010
# and 96.8 %, in 1.2x the time: bfloat16 matmuls are slow without bfloat16 hardware).
KL_BOUND = 0.005


def test_auto_is_float32_weights_and_float16_cache_on_cpu_and_bfloat16_on_cuda():
    cpu, cuda = EngineConfig(device="cpu"), EngineConfig(device="cuda")
    assert (cpu.torch_dtype(), cpu.torch_kv_cache_dtype()) == (torch.float32, torch.float16)
    assert (cuda.torch_dtype(), cuda.torch_kv_cache_dtype()) == (torch.bfloat16, torch.bfloat16)
    chosen = EngineConfig(device="cuda", dtype="float32", kv_cache_dtype="float16")
    assert (chosen.torch_dtype(), chosen.torch_kv_cache_dtype()) == (torch.float32, torch.float16)


def test_the_device_variable_decides_auto_and_a_bad_one_is_named(monkeypatch):
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert EngineConfig().torch_device() == torch.device("cpu")
    assert EngineConfig(device="cpu").torch_device() == torch.device("cpu")
    monkeypatch.setenv(DEVICE_ENV, "tpu")
    with pytest.raises(ValueError, match=r"\$ETINFER_DEVICE .* got 'tpu'"):
        EngineConfig()
    assert EngineConfig(device="cpu").torch_device() == torch.device("cpu")  # explicit wins


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU")
def test_cuda_asked_for_where_there_is_none_says_so():
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        EngineConfig(device="cuda").torch_device()


@pytest.mark.skipif(not ON_CUDA, reason="the CUDA default (ETINFER_DEVICE=cuda)")
def test_the_default_engine_on_cuda_is_bfloat16(loaded_model):
    runner = LLM(loaded_model, num_kvcache_blocks=64).engine.runner
    assert runner.cache.dtype == torch.bfloat16
    assert runner.model.embed.dtype == torch.bfloat16


@pytest.mark.slow
def test_bfloat16_weights_and_cache_follow_float32_on_real_text(make_llm):
    """Teacher-forced over four windows of real text (128 tokens of context, 64 forced), on the
    suite's device: bfloat16 weights and cache give float32's top token nearly everywhere, at a
    small divergence."""
    passes = {}
    for dtype in ("float32", "bfloat16"):
        llm = make_llm(quantization="none", dtype=dtype, kv_cache_dtype=dtype)
        passes[dtype] = forced_log_probs(llm, fidelity_texts(llm, 4, 128 + 64), 128, 64)
    kl, agree = divergences(passes["float32"], passes["bfloat16"])
    assert statistics.fmean(kl) < KL_BOUND, statistics.fmean(kl)
    assert statistics.fmean(agree) >= 0.92, statistics.fmean(agree)
    assert max(kl) > 0
