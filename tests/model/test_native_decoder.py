"""A decode step's layers in one native call (``model/native_decoder.py``): its rotation and
activation against torch's, and whole steps bit for bit equal to the layer-by-layer path (the
engine mixes both: steps with prefill rows go layer by layer), on the real model and on a
random one with query, key and value biases."""

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from etinfer import LLM, SamplingParams
from etinfer.control.block_selection import PruningConfig
from etinfer.control.config import ControlConfig
from etinfer.model import native_kernels, quant_kernels
from etinfer.model.loader import LoadedModel
from etinfer.model.native_decoder import (
    NativeDecoder,
    NativeDecoders,
    gated_activation,
    rotate_heads,
)
from etinfer.model.native_token_step import TokenStep
from etinfer.model.quantized import GGUFBlocks
from etinfer.model.rotary import RotaryEmbedding
from tests.conftest import PROMPTS

pytestmark = pytest.mark.skipif(
    not (quant_kernels.available() and native_kernels.available()), reason="no native kernels"
)


def test_native_rotation_matches_torchs(loaded_model):
    rope = RotaryEmbedding(loaded_model.config, 4096, torch.device("cpu"), torch.float32)
    heads, dim = 12, loaded_model.config.head_dim
    qkv = torch.randn(5, heads + 4, dim, generator=torch.Generator().manual_seed(0))
    angles = rope.rows(torch.tensor([0, 7, 300, 2047, 4095]))
    expected = RotaryEmbedding.apply(qkv[:, :heads], angles)
    rotated = qkv.clone()
    rotate_heads(rotated, heads, angles)
    torch.testing.assert_close(rotated[:, :heads], expected, rtol=0, atol=2e-6)
    assert torch.equal(rotated[:, heads:], qkv[:, heads:])  # the values' heads stay as they are


def test_native_gated_activation_matches_torchs():
    gate_up = torch.randn(3, 2 * 96, generator=torch.Generator().manual_seed(1)) * 6
    gate_up[0, :4] = torch.tensor([0.0, -90.0, 90.0, -1e-30])
    gate, up = gate_up.split(96, dim=-1)
    gelu = F.gelu(gate, approximate="tanh")
    for name, torch_form in (("silu", F.silu(gate)), ("gelu_tanh", gelu)):
        native = gated_activation(gate_up, name)
        torch.testing.assert_close(native, torch_form * up, rtol=1e-5, atol=1e-6)


def tokens_and_logprobs(llm: LLM, prompts: list[str], layer_by_layer: bool, monkeypatch) -> list:
    """Greedy tokens and logprobs of ``prompts`` arriving at steps 1, 3, 5 and 9 (so that some
    decode steps share their batch with prefill rows), with the native decoder or without."""
    with monkeypatch.context() as patch:
        if layer_by_layer:
            patch.setattr(NativeDecoders, "for_step", lambda self, cache, meta: None)
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
        ids = [engine.add_request(prompts[0], params)]
        outputs, steps = {}, 0
        while engine.has_unfinished_requests():
            steps += 1
            if steps in (3, 5, 9) and len(ids) < len(prompts):
                ids.append(engine.add_request(prompts[len(ids)], params))
            for output in engine.step():
                if output.finish_reason is not None:
                    outputs[output.request_id] = output
    return [(outputs[i].token_ids, outputs[i].logprobs) for i in ids]


def native_decoder_built(llm: LLM) -> bool:
    return llm.engine.runner.model.decoders.decoder is not None


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "int8"])
def test_the_native_decoder_computes_the_layer_by_layer_steps_bit_for_bit(
    make_llm, monkeypatch, kv_cache_dtype
):
    llm = make_llm(quantization="gguf", kv_cache_dtype=kv_cache_dtype, max_num_seqs=4)
    fused = tokens_and_logprobs(llm, PROMPTS[:4], False, monkeypatch)
    assert native_decoder_built(llm)
    assert fused == tokens_and_logprobs(llm, PROMPTS[:4], True, monkeypatch)


def test_the_native_decoder_adds_query_key_and_value_biases(tiny_model, monkeypatch):
    config = dataclasses.replace(tiny_model.config, attention_bias=True)
    generator = torch.Generator().manual_seed(3)
    weights = {}
    for name, weight in tiny_model.weights.items():
        if ".self_attn." in name or ".mlp." in name:
            values = weight.numpy().astype(np.float32)
            weight = GGUFBlocks(Q.Q8_0, torch.from_numpy(quantize(values, Q.Q8_0)), values.shape[1])
        weights[name] = weight
    for i in range(config.num_layers):
        for part, width in (("q", config.num_heads), ("k", config.num_kv_heads), ("v", 2)):
            rows = (config.num_kv_heads if part == "v" else width) * config.head_dim
            bias = torch.randn(rows, generator=generator) * 0.5
            weights[f"model.layers.{i}.self_attn.{part}_proj.bias"] = bias
    model = LoadedModel(tiny_model.path, config, weights, tiny_model.tokenizer)
    llm = LLM(model, quantization="gguf", max_num_seqs=4, kv_cache_dtype="float16")
    fused = tokens_and_logprobs(llm, PROMPTS[:4], False, monkeypatch)
    assert native_decoder_built(llm)
    assert fused == tokens_and_logprobs(llm, PROMPTS[:4], True, monkeypatch)


@pytest.mark.parametrize("scorer", ["reused-mass", "mass", "digest", "sketch-tokens"])
def test_a_pruning_engines_dense_steps_keep_its_masses_and_summaries(make_llm, monkeypatch, scorer):
    """Steps where no layer is pruned (contexts under 48 tokens here) take the native decoder,
    and so do pruned steps of reused masses, a call per run of layers reading the same blocks;
    the block summaries and masses it keeps after them decide the pruned steps that follow
    (blocks of 4 tokens, two to four kept of up to 17), so the two paths give the same tokens and
    logprobs only if they keep the same ones (without either, the scorers that read it parted)."""
    pruning = PruningConfig(
        scorer=scorer, min_context=48, min_blocks=2, sink_blocks=1, recent_blocks=1,
        dense_layers=0, budget_low=0.125, budget_high=0.25,
    )  # fmt: skip
    llm = make_llm(
        control=ControlConfig(pruning=pruning),
        max_num_seqs=4,
        enable_prefix_caching=False,
        block_size=4,
    )
    path = llm.engine.runner.model.decode_path(llm.engine.runner.cache)
    runs, chosen = [], []  # the native calls' layers, where a pattern narrowed them
    call, choose = NativeDecoder.__call__, TokenStep.of

    def counting(self, x, angles, meta, layers, pattern=None):
        if pattern is not None:
            runs.append(layers)
        return call(self, x, angles, meta, layers, pattern)

    def choosing(choice, shape, meta, num_layers):
        step = choose(choice, shape, meta, num_layers)
        chosen.append(step is not None)
        return step

    monkeypatch.setattr(NativeDecoder, "__call__", counting)
    monkeypatch.setattr(TokenStep, "of", choosing)
    fused = tokens_and_logprobs(llm, PROMPTS[:4], False, monkeypatch)
    assert native_decoder_built(llm)
    assert fused == tokens_and_logprobs(llm, PROMPTS[:4], True, monkeypatch)
    if scorer == "reused-mass":
        # Pruned steps too, a call per run of layers after each selection layer (0 and 18).
        assert path == "in one native call, or one per run of layers reading the same blocks"
        assert set(runs) == {range(1, 18), range(19, 30)}
    elif scorer == "sketch-tokens":  # pruned steps in one call, tokens chosen inside it
        assert path == "in one native call, single tokens chosen inside it" and not runs
        assert any(chosen) and not all(chosen)  # pruned steps, and dense ones
    else:  # the others rank by each layer's query: pruned steps go layer by layer
        assert path == "in one native call where no layer is pruned" and not runs


def test_the_native_decoder_can_be_switched_off(make_llm, monkeypatch):
    monkeypatch.setenv("ETINFER_NATIVE_DECODER", "0")
    llm = make_llm(quantization="gguf", max_num_seqs=2)
    llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=4))
    assert not native_decoder_built(llm)
