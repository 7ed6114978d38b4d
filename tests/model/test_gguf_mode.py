"""Weights in their GGUF blocks on etinfer's own kernels: which formats stay in their blocks
under each mode, and the default model run that way (``quantization="gguf"``): close to the
float model, and each prompt's tokens the same alone or in a batch."""

import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from etinfer import LLM, SamplingParams
from etinfer.bench.common.fidelity import logit_agreement
from etinfer.bench.speed.memory import mapping_resident_mib
from etinfer.calibrate import collect
from etinfer.corpus import corpus_windows
from etinfer.model import native_kernels, quant_kernels
from etinfer.model.linear import BlockLinear, Int4Linear, TopRefinedLinear, make_linear
from etinfer.model.quantized import GGUFBlocks, Int4Weight, MixedBlocks, stack_rows, weight_format
from tests.conftest import assert_alone_equals_batched, cpu_only
from tests.model.test_quant_kernels import random_blocks

pytestmark = pytest.mark.skipif(not quant_kernels.available(), reason="no AVX2 kernels here")


def test_a_format_torch_has_no_kernel_for_stays_in_its_blocks():
    values = np.random.default_rng(1).standard_normal((32, 64)).astype(np.float32)
    blocks = GGUFBlocks(Q.Q5_0, torch.from_numpy(quantize(values, Q.Q5_0)), 64)
    assert weight_format(blocks, "auto", "w") == (blocks, None)
    layer = make_linear(blocks)
    assert isinstance(layer, BlockLinear)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    exact = x @ blocks.dequantize().T
    assert ((layer(x) - exact).norm() / exact.norm()).item() < 0.01  # the 8-bit activations


def test_gguf_modes_keep_q4_1_in_its_blocks_at_their_activations_bits():
    values = np.random.default_rng(2).standard_normal((16, 64)).astype(np.float32)
    blocks = GGUFBlocks(Q.Q4_1, torch.from_numpy(quantize(values, Q.Q4_1)), 64)
    assert weight_format(blocks, "gguf", "w")[0] == blocks
    assert weight_format(blocks, "gguf-a16", "w")[0] == replace(blocks, activation_bits=16)
    assert weight_format(blocks, "gguf-a32", "w")[0] == replace(blocks, activation_bits=32)
    # Where ``auto`` resolves to itself (no block kernels), torch's int4 kernel.
    assert isinstance(weight_format(blocks, "auto", "w")[0], Int4Weight)
    # Rows the kernels cannot interleave by eight have no float32 kernel: 8-bit activations.
    twelve = GGUFBlocks(Q.Q4_1, blocks.data[:12], 64)
    assert weight_format(twelve, "gguf-a32", "w")[0] == twelve


@cpu_only
def test_without_the_kernels_gguf_mode_says_so_once_and_runs_as_auto(
    loaded_model, monkeypatch, caplog
):
    monkeypatch.setenv("ETINFER_NATIVE", "0")
    # Both libraries are looked up once a process: forgotten here on both sides, so that the
    # tests after this one find them whichever ran first.
    quant_kernels.library.cache_clear()
    native_kernels.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="etinfer.model"):
            llm = LLM(loaded_model, quantization="gguf", num_kvcache_blocks=16)
    finally:
        monkeypatch.undo()
        quant_kernels.library.cache_clear()
        native_kernels.library.cache_clear()
    said = [r.getMessage() for r in caplog.records if "block kernels" in r.getMessage()]
    assert len(said) == 1 and "run as in 'auto'" in said[0]
    assert isinstance(llm.engine.runner.model.layers[0].gate_up, Int4Linear)


@pytest.fixture(scope="module")
def gguf_llm(make_llm):
    return make_llm(quantization="gguf", max_num_seqs=16)


@cpu_only
def test_every_matrix_of_the_default_file_runs_in_its_blocks(gguf_llm):
    model = gguf_llm.engine.runner.model
    layers = [m for layer in model.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(isinstance(m, BlockLinear) for m in layers)
    assert isinstance(model.lm_head, TopRefinedLinear) and isinstance(
        model.lm_head.layer, BlockLinear
    )
    # The tied embedding and the candidates read the head's prepared rows: one copy.
    assert model.embed is model.lm_head.layer is model.lm_head.weight


@cpu_only
@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="reads Linux's /proc")
def test_rows_read_at_random_bring_no_page_of_the_file_back(loaded_model, make_llm):
    """Once the weights are prepared the file's pages are let go; the embedding's rows and the
    head's candidates are read from the prepared copy, so a long generation brings none of the
    file back (reading the file's rows, half the embedding came back in 600 tokens)."""
    llm = make_llm(quantization="gguf")
    loaded_model.release_file_pages()  # what other engines over this model read before
    params = SamplingParams(temperature=1.0, max_tokens=256, seed=0, ignore_eos=True)
    llm.generate(["Write a story about a lighthouse."], params)
    assert mapping_resident_mib(loaded_model.file_mapping) == 0


@cpu_only
def test_gguf_mode_stays_close_to_the_float_model(gguf_llm, float_llm):
    """Teacher-forced on 1,024 positions of real text: 96.6 % top-1 agreement measured on 2,048
    (llama.cpp 95.3 % with its own 8-bit activations; torch's kernels in ``auto`` 98.8 %)."""
    windows = list(corpus_windows(gguf_llm.tokenizer, 256))[:5]
    reference = collect(float_llm.engine, iter(windows), 1024)[0]
    logits = collect(gguf_llm.engine, iter(windows), 1024)[0]
    figures = logit_agreement(logits, reference)
    assert figures["top1_agreement"] >= 0.95, figures
    assert figures["kl_mean"] < 0.005, figures


@cpu_only
def test_a_prompt_gives_the_same_tokens_and_logprobs_alone_and_in_a_batch(gguf_llm):
    assert_alone_equals_batched(gguf_llm)


@cpu_only
def test_16_bit_activations_follow_the_float_model_closer(make_llm, float_llm):
    """``gguf-a16`` on 1,024 positions of real text: 99.9 % top-1 agreement measured on 2,048
    (the target was 98 %), KL 6e-7 nat; row-invariant as ``gguf`` is."""
    precise = make_llm(quantization="gguf-a16", max_num_seqs=16)
    head = precise.engine.runner.model.lm_head.layer
    assert isinstance(head, BlockLinear) and head.product.precise
    windows = list(corpus_windows(precise.tokenizer, 256))[:5]
    reference = collect(float_llm.engine, iter(windows), 1024)[0]
    figures = logit_agreement(collect(precise.engine, iter(windows), 1024)[0], reference)
    assert figures["top1_agreement"] >= 0.98 and figures["kl_mean"] < 1e-4, figures
    assert_alone_equals_batched(precise)


def test_a_fused_projection_of_two_formats_stays_in_its_blocks():
    """Q4_K_M's q and k in Q4_K beside v in Q6_K: one layer, each part on its own kernel."""
    q, v = random_blocks(Q.Q4_K, 16, 512, seed=5), random_blocks(Q.Q6_K, 8, 512, seed=6)
    parts = [GGUFBlocks(Q.Q4_K, q, 512), GGUFBlocks(Q.Q6_K, v, 512)]
    stacked = stack_rows(parts)
    assert isinstance(stacked, MixedBlocks) and stacked.shape == (24, 512)
    assert weight_format(stacked, "auto", "qkv") == (stacked, None)
    exact = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(weight_format(stacked, "none", "qkv")[0], exact)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    expected = x @ exact.T
    got = make_linear(stacked)(x)
    assert ((got - expected).norm() / expected.norm()).item() < 0.02
    assert torch.equal(got[:, 16:], make_linear(parts[1])(x))  # the v part computed as alone
