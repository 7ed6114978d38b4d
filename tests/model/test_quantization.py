"""Weights in their own quantization: the GGUF blocks map exactly onto the kernels' formats, the
kernels compute each row alone, and the default (quantized) engine computes the float model's
function up to rounding."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from etinfer import LLM, SamplingParams
from etinfer.bench.common.fidelity import logit_agreement
from etinfer.calibrate import collect
from etinfer.config import EngineConfig
from etinfer.corpus import corpus_windows
from etinfer.model import quant_kernels
from etinfer.model.linear import BlockLinear, Int4Linear, Int8Linear, make_linear
from etinfer.model.quantized import GGUFBlocks, Int4Weight, Int8Weight, weight_format
from tests.conftest import PROMPTS, assert_alone_equals_batched, cpu_only


def blocks_of(values: np.ndarray, qtype: Q) -> GGUFBlocks:
    return GGUFBlocks(qtype, torch.from_numpy(quantize(values, qtype)), values.shape[1])


def kernel_weights(weight: Int4Weight | Int8Weight | GGUFBlocks) -> torch.Tensor:
    """The [out, in] weights a layer multiplies by, read back through the kernel in float32
    (an identity matrix of inputs returns them column by column)."""
    layer = make_linear(weight, dtype=torch.float32)
    return layer(torch.eye(layer.in_features)).T


def file_tensors(loaded_model):
    """The default file's block tensors: every Q4_1 type of layer 0 and the Q8_0 embedding."""
    names = [n for n in loaded_model.weights if n.startswith("model.layers.0.")]
    names.append("model.embed_tokens.weight")
    return [
        (n, loaded_model.weights[n])
        for n in names
        if isinstance(loaded_model.weights[n], GGUFBlocks)
    ]


def test_the_default_files_blocks_run_as_gguf_dequantizes_them(loaded_model):
    tensors = file_tensors(loaded_model)
    assert {w.qtype for _, w in tensors} == {Q.Q4_1, Q.Q8_0}
    for name, blocks in tensors:
        reference = blocks.dequantize()
        weight, dequantized = weight_format(blocks, "auto", name)  # auto without the kernels
        assert dequantized is None
        assert isinstance(weight, Int4Weight if blocks.qtype == Q.Q4_1 else Int8Weight)
        assert torch.equal(weight.dequantize(), reference), name  # what embedding rows read
        if blocks.qtype == Q.Q8_0:  # the head: rows of the embedding, 24,576 at a time
            head = Int8Weight(weight.codes[:4096], weight.scale[:4096], weight.group_size)
            assert torch.equal(kernel_weights(head), reference[:4096]), name
        else:
            assert torch.equal(kernel_weights(weight), reference), name


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_each_native_type_maps_exactly(qtype):
    values = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    values[3] = 0.0  # a block of zeros: scale 0
    blocks = blocks_of(values, qtype)
    weight, _ = weight_format(blocks, "auto", "w")
    assert torch.equal(kernel_weights(weight), blocks.dequantize())
    assert torch.equal(weight.dequantize(torch.tensor([5, 3])), blocks.dequantize()[[5, 3]])
    rows = torch.tensor([[5, 3], [0, 47]])  # the blocks' own rows, by torch operations
    assert torch.equal(blocks.dequantize(rows), blocks.dequantize()[rows])


def test_unsupported_block_types_run_as_float_and_say_so():
    values = np.random.default_rng(1).standard_normal((32, 64)).astype(np.float32)
    blocks = blocks_of(values, Q.Q5_1)
    weight, note = weight_format(blocks, "auto", "model.layers.0.mlp.down_proj.weight")
    assert torch.equal(weight, blocks.dequantize())
    assert note == "model.layers.0.mlp.down_proj.weight (Q5_1: no kernel, dequantized to float)"
    # int4 and int8 quantize it like any float weight
    assert isinstance(weight_format(blocks, "int4", "w")[0], Int4Weight)
    assert isinstance(weight_format(blocks, "int8", "w")[0], Int8Weight)


def test_round_to_nearest_stays_within_half_a_step():
    weight = torch.randn(64, 128)
    int4 = Int4Weight.quantize(weight, "w")
    step = int4.scale.repeat_interleave(32, -1)
    assert ((int4.dequantize() - weight).abs() <= step / 2 + 1e-6).all()
    int8 = Int8Weight.quantize(weight)
    assert ((int8.dequantize() - weight).abs() <= int8.scale / 2 + 1e-6).all()
    assert torch.equal(kernel_weights(int4), int4.dequantize())
    assert torch.allclose(kernel_weights(int8), int8.dequantize(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["int4", "int4-padded", "int8", "planes"])
def test_kernels_compute_each_row_alone(kind):
    """A row's output has the same bits whether it is alone or among 1 to 300 others."""
    out = 40 if kind == "int4-padded" else 96  # 40 rows are padded to 48 for the int4 packing
    weight = torch.randn(out, 128)
    layer = {
        "int4": lambda: Int4Linear(Int4Weight.quantize(weight, "w")),
        "int4-padded": lambda: Int4Linear(Int4Weight.quantize(weight, "w")),
        "int8": lambda: Int8Linear(Int8Weight.quantize(weight)),
        "planes": lambda: make_linear(Int8Weight.from_gguf(blocks_of(weight.numpy(), Q.Q8_0))),
    }[kind]()
    x = torch.randn(300, 128)
    full = layer(x)
    assert full.shape == (300, out)
    for rows in (1, 2, 5, 16, 33, 128):
        assert torch.equal(layer(x[:rows]), full[:rows])
    assert torch.equal(layer(x[7:8]), full[7:8])


def test_int4_refuses_shapes_the_kernel_cannot_take():
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.weight: int4 needs .* 48"):
        Int4Weight.quantize(torch.randn(64, 48), "model.layers.0.mlp.down_proj.weight")


def test_an_unknown_mode_names_the_accepted_ones():
    with pytest.raises(
        ValueError, match="quantization must be one of 'auto', 'none', 'int8', 'int4'"
    ):
        EngineConfig(quantization="q4")


@pytest.fixture(scope="module")
def teacher_forced(llm, float_llm):
    """Logits of 1,024 positions of real text (the Python reference) under both weight sets."""
    windows = list(corpus_windows(llm.tokenizer, 256))[:5]
    return collect(float_llm.engine, iter(windows), 1024)[0], collect(
        llm.engine, iter(windows), 1024
    )[0]


def test_auto_computes_the_float_models_function_up_to_rounding(teacher_forced):
    """The file's blocks times 8-bit activations, as llama.cpp computes: measured 96.4 % top-1
    here (2026-11-28), where llama.cpp agrees with float32 on 95.3-96.7 % (BENCHMARKS.md)."""
    reference, quantized = teacher_forced
    figures = logit_agreement(quantized, reference)
    assert figures["top1_agreement"] >= 0.95, figures
    assert figures["kl_mean"] < 0.02, figures


def test_auto_and_none_agree_on_the_first_greedy_tokens(llm, float_llm):
    """8-bit activations move a near-tie now and then, and greedy text parts from there: the
    tokens the two share from the start were 5, 8, 13, 2, 16, 8, 16 and 7 of 16 (2026-11-28)."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    shared = []
    pairs = zip(llm.generate(PROMPTS, params), float_llm.generate(PROMPTS, params), strict=True)
    for a, b in pairs:
        same = [x == y for x, y in zip(a.token_ids, b.token_ids, strict=True)]
        shared.append(same.index(False) if False in same else len(same))
    assert sum(n >= 4 for n in shared) >= 3 * len(PROMPTS) // 4, shared


def test_separately_loaded_engines_give_the_same_logits(loaded_model):
    """Kernel choice is fixed by the weight format: two engines (two replicas) agree bit for bit."""
    ids = loaded_model.tokenizer.encode(PROMPTS[3])
    a, b = (LLM(loaded_model, num_kvcache_blocks=16).engine.score(ids) for _ in range(2))
    assert torch.equal(a, b)


@cpu_only
def test_default_engine_runs_quantized_kernels(llm, float_llm):
    model = llm.engine.runner.model
    if quant_kernels.available():
        # Q4_1 in its blocks with 8-bit activations, and decode steps in one native call.
        assert isinstance(model.layers[0].gate_up, BlockLinear)
        assert model.decode_path(llm.engine.runner.cache) == "in one native call"
    else:
        assert isinstance(model.layers[0].gate_up, Int4Linear)
    if quant_kernels.available():
        # The Q8_0 head on the block kernels; the tied embedding and the head's candidates read
        # the rows of its prepared copy, so the matrix is held once.
        assert isinstance(model.lm_head.layer, BlockLinear)
        assert model.lm_head.weight is model.lm_head.layer is model.embed
    else:  # torch's int8 kernel on a per-row requantization, the candidates the file's blocks
        assert isinstance(model.lm_head.layer, Int8Linear) and model.lm_head.weight is model.embed
        assert isinstance(model.embed, Int8Weight)
    assert isinstance(float_llm.engine.runner.model.embed, torch.Tensor)


@cpu_only
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_float_weights_quantized_at_load_batch_invariantly(tiny_model, mode):
    """A float model quantized at load: every matrix on a kernel, and a prompt's greedy tokens
    and logprobs the same alone or in a batch with others."""
    quantized = LLM(tiny_model, quantization=mode, num_kvcache_blocks=64)
    kind = Int8Linear if mode == "int8" else Int4Linear
    model = quantized.engine.runner.model
    assert all(isinstance(layer.qkv, kind) for layer in model.layers)
    assert isinstance(model.lm_head.layer, kind)
    assert_alone_equals_batched(quantized)
