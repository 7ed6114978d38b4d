"""Hugging Face model folders of each supported family, written by transformers itself."""

import json
import statistics

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from etinfer import LLM, ControlConfig, SamplingParams
from etinfer.control.block_selection import PruningConfig
from etinfer.control.sparse_prefill import SparsePrefillConfig
from etinfer.model.quantized import as_float

transformers = pytest.importorskip("transformers")

VOCAB = 96
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.3,  # peaked distributions, so greedy picks are far from ties
    tie_word_embeddings=False,
)
FAMILIES = {
    "llama-rope-llama3": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    "qwen2-biases": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "mistral-sliding-window": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        {"sliding_window": 6},
    ),
    "qwen3-qk-norms": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16}),
    "phi3-fused-projections": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2},
    ),
    # Gemma 2: Gemma 3's layer without query/key norms, one RoPE base, scores and logits
    # soft-capped (caps small enough that tanh bends what this model computes).
    "gemma2-soft-caps": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 6,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    # One sliding layer and one global, each with its RoPE base; a query scale of its own.
    "gemma3-mixed-windows": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 6,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        },
    ),
}


def write_tiny_model(folder, family):
    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class(config_class(**TINY, **extra)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            # transformers initialises biases to zero, and Gemma's norms (which scale by 1 + w)
            if name.endswith("bias") or (family.startswith(("gemma", "qwen3")) and "norm" in name):
                parameter.normal_(0, 0.5)
    model.save_pretrained(folder)
    words = {f"w{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_model_folder_matches_transformers(tmp_path, family):
    reference = write_tiny_model(tmp_path, family)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_dtype="float32")
    assert_matches_transformers(llm, reference)


@pytest.mark.parametrize("family", ["gemma2-soft-caps", "gemma3-mixed-windows"])
# Over a float32 cache chunks after a prefix take SDPA; over a 16-bit one the prefill kernel's
# tensor-core dots (float16 here: Triton's interpreter gets bfloat16 dots wrong), whose rounding
# of the queries and weights the tolerance allows for.
@pytest.mark.parametrize(("cache", "tolerance"), [("float32", 1e-4), ("float16", 1e-2)])
def test_soft_caps_and_windows_hold_on_the_gpu_kernels(
    tmp_path, family, cache, tolerance, monkeypatch
):
    """The GPU's attention kernels (in Triton's interpreter without a GPU) take Gemma 2's soft
    cap and Gemma 3's windows: transformers' tokens and logprobs, prefilled in chunks after a
    prefix and decoded through the kernels (an H200 run found the capped torch path wrong)."""
    pytest.importorskip("triton")
    from etinfer.model.attention import triton_backend

    reference = write_tiny_model(tmp_path, family)
    calls = []
    kernel = triton_backend.paged_prefill
    monkeypatch.setattr(
        triton_backend, "paged_prefill", lambda *a, **k: calls.append(1) or kernel(*a, **k)
    )
    settings = {"dtype": "float32", "kv_cache_dtype": cache, "cuda_graphs": False}
    settings["attention_backend"] = "triton"
    llm = LLM(str(tmp_path), max_num_batched_tokens=8, **settings)
    assert_matches_transformers(llm, reference, tolerance)
    assert bool(calls) == (cache == "float16")  # the chunks after the first took the kernel


def assert_matches_transformers(llm: LLM, reference, tolerance: float = 1e-4) -> None:
    prompt = [(7 * i + 3) % VOCAB for i in range(13)]
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    )[0]
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + out.token_ids])).logits[0].log_softmax(-1)
    # Teacher-forced: at every step our token is transformers' argmax, with the same logprobs.
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        expected = logits[len(prompt) - 1 + step]
        assert token == int(expected.argmax()), step
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(expected[tid].item(), abs=tolerance)


def test_bfloat16_weights_run_with_float32_attention(tmp_path):
    write_tiny_model(tmp_path, "qwen2-biases")
    prompt = [(5 * i + 1) % VOCAB for i in range(9)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    full = LLM(str(tmp_path), dtype="float32").generate([prompt], params)[0]
    half = LLM(str(tmp_path), dtype="bfloat16").generate([prompt], params)[0]
    assert len(half.token_ids) == 6
    first = full.token_ids[0]
    assert half.logprobs[0][first].logprob == pytest.approx(
        full.logprobs[0][first].logprob, abs=0.1
    )


def test_real_model_exported_as_folder_equals_the_gguf(
    tmp_path, float_llm, loaded_model, hf_reference
):
    llm = float_llm  # the folder holds the file's weights dequantized: float, as "none" runs them
    # transformers will not save a model it read from GGUF, so write the folder the way it would:
    # its config.json, safetensors weights, tokenizer.json and tokenizer_config.json.
    hf_reference.config.save_pretrained(tmp_path)
    weights = {name: as_float(w) for name, w in loaded_model.weights.items()}
    save_file(weights, tmp_path / "model.safetensors")
    llm.tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    tokenizer_config = {
        "eos_token": "<|im_end|>",
        "bos_token": "<|im_start|>",
        "chat_template": llm.tokenizer.chat_template,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    folder = LLM(str(tmp_path), dtype="float32")
    assert folder.engine.model_config == llm.engine.model_config
    params = SamplingParams(temperature=0, max_tokens=32)
    messages = [{"role": "user", "content": "Name three fruits."}]
    assert folder.chat(messages, params)[0].token_ids == llm.chat(messages, params)[0].token_ids
    assert folder.tokenizer.eos_token_ids == llm.tokenizer.eos_token_ids


def test_gemma3_windows_hold_in_chunked_prefill_and_over_the_prefix_cache(tmp_path):
    """Gemma 3's sliding layers read the step's windowed view: prefill cut into chunks of 5
    (each chunk's mask over a cached prefix) and a second run over the prefix cache give the
    same tokens and logprobs as one whole prefill. Pruning prunes the global layer alone (the
    sliding one reads its window): a budget of every block gives the dense tokens, a quarter
    reads fewer blocks. Sparse prefill narrows the global layer alone: with a budget of the
    whole context it is dense prefill."""
    write_tiny_model(tmp_path, "gemma3-mixed-windows")
    prompt = [(11 * i + 2) % VOCAB for i in range(21)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    exact = {"dtype": "float32", "kv_cache_dtype": "float32"}
    whole = LLM(str(tmp_path), **exact).generate([prompt], params)[0]
    chunked = LLM(str(tmp_path), max_num_batched_tokens=5, enable_prefix_caching=True, **exact)
    again = chunked.generate([prompt], params) + chunked.generate([prompt], params)
    assert again[1].num_cached_tokens > 0
    for out in again:
        assert out.token_ids == whole.token_ids
        for got, want in zip(out.logprobs, whole.logprobs, strict=True):
            assert next(iter(got.values())).logprob == pytest.approx(
                next(iter(want.values())).logprob, abs=1e-5
            )
    # Prefill rows as decode rows (batch_invariant), and one sequence scored whole, in windows.
    invariant = LLM(str(tmp_path), batch_invariant=True, **exact)
    assert invariant.generate([prompt], params)[0].token_ids == whole.token_ids
    scored = invariant.engine.score(prompt + whole.token_ids)[len(prompt) - 1 : -1]
    assert scored.argmax(-1).tolist() == whole.token_ids
    every = dict(min_context=8, dense_layers=0, min_blocks=2, sink_blocks=1, recent_blocks=1)
    kept = {}
    for budget in (1.0, 0.25):
        config = PruningConfig(
            scorer="bound", **every, budget_low=budget, budget_high=budget, max_shrink=1.0
        )
        pruned = LLM(str(tmp_path), block_size=2, control=ControlConfig(pruning=config), **exact)
        # Head budgets and the bound-value scorer scale key bounds by the model's own scale.
        assert pruned.engine.selector.scale == pruned.engine.model_config.scale
        out = pruned.generate([prompt], params)[0]
        kept[budget] = statistics.fmean(out.blocks_kept)
        if budget == 1.0:
            assert out.token_ids == whole.token_ids
    # The sliding layer reads its window (3 of up to 17 blocks), the global one what it keeps.
    assert kept[0.25] < kept[1.0] < 0.75
    segments = dict(segment_size=4, min_context=4, sink=2, window=4)
    for budget, same in ((64, True), (6, False)):
        sparse = SparsePrefillConfig(**segments, base_budget=budget, max_budget_factor=1.0)
        control = ControlConfig(sparse_prefill=sparse)
        out = LLM(str(tmp_path), block_size=2, control=control, **exact).generate([prompt], params)
        assert (out[0].metrics.prefill_attention_skipped == 0.0) == same
        if same:
            assert out[0].token_ids == whole.token_ids


@pytest.mark.parametrize(
    "control",
    [
        ControlConfig(pruning=PruningConfig()),
        ControlConfig(sparse_prefill=True),
        ControlConfig(kv_compression=True),
    ],
    ids=["pruning", "sparse prefill", "kv compression"],
)
def test_layers_that_rank_raw_scores_refuse_soft_capped_attention(tmp_path, control):
    write_tiny_model(tmp_path, "gemma2-soft-caps")
    with pytest.raises(ValueError, match="rank attention scores without the soft cap"):
        LLM(str(tmp_path), control=control)
