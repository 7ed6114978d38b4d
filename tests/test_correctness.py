"""Greedy outputs of the real model: equal to transformers on float weights, and the same however
batched on the default (quantized) ones."""

import pytest
import torch

from etinfer import LLM, SamplingParams
from etinfer.control.entropy import softmax_entropy
from tests.conftest import ON_CUDA, PROMPTS, assert_pool_free

GREEDY_64 = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def reference_tokens(llm, hf_reference):
    """transformers' greedy continuation of each prompt, 64 tokens, not stopping at EOS: the
    eight in one batch, padded on the left and masked (4 s, where one at a time took 21 s; the
    same tokens as one at a time, checked with and without AVX-512)."""
    prompts = [llm.tokenizer.encode(prompt) for prompt in PROMPTS]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf_reference.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=64,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[:, width:].tolist()


def test_greedy_equals_transformers_token_for_token(float_llm, reference_tokens):
    outs = float_llm.generate(PROMPTS, GREEDY_64)  # all eight in one batch
    for prompt, out, expected in zip(PROMPTS, outs, reference_tokens, strict=True):
        assert out.token_ids == expected, prompt
    assert_pool_free(float_llm)


def test_prompt_logits_match_transformers(make_llm, hf_reference):
    """The whole prompt computed here, in one chunk: from the session's float engine its blocks
    may come from the prefix cache, computed in another batch's chunks, which moves the last
    float32 bits of the logits (3e-4 in a logprob, in a full run)."""
    llm = make_llm(
        max_num_seqs=16,
        quantization="none",
        dtype="float32",
        kv_cache_dtype="float32",
        enable_prefix_caching=False,
    )
    ids = llm.tokenizer.encode(PROMPTS[3])
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0]
    with torch.no_grad():
        expected = hf_reference(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
    for token, entry in out.logprobs[0].items():
        assert entry.logprob == pytest.approx(expected[token].item(), abs=1e-4)


def greedy(llm, prompts, max_tokens=24):
    return [
        o.token_ids
        for o in llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        )
    ]


@pytest.fixture(scope="module")
def alone(llm):
    return greedy(llm, [PROMPTS[3]])[0]


def test_same_tokens_in_a_mixed_batch(llm, alone):
    mixed = greedy(llm, [PROMPTS[0], PROMPTS[3], PROMPTS[2] * 3, PROMPTS[6]])
    assert mixed[1] == alone


# Prefill attention (SDPA per chunk) is not bit for bit the same for a row whatever the chunking,
# nor the same as decode's: on float weights the difference is about 1e-7 and no token moves; the
# integer kernels round activations to bfloat16, which can turn it into a different bfloat16 and
# a different token. `batch_invariant` takes prefill rows through decode's row kernel: then a
# token's logits are the same bit for bit however its row is computed (the weight kernels compute
# each row alone, test_quantization).
ON_BOTH_WEIGHTS = pytest.mark.parametrize("quantization", ["none", "auto"])


@pytest.fixture(scope="module")
def alone_by_weights(llm, float_llm):
    return {"auto": greedy(llm, [PROMPTS[3]])[0], "none": greedy(float_llm, [PROMPTS[3]])[0]}


def test_same_tokens_with_chunked_prefill(make_llm, alone_by_weights):
    small_chunks = make_llm(max_num_batched_tokens=5, quantization="none")
    assert greedy(small_chunks, [PROMPTS[3], PROMPTS[1]])[0] == alone_by_weights["none"]
    assert_pool_free(small_chunks)


def logprob_trace(out):
    return [p[t].logprob for p, t in zip(out.logprobs, out.token_ids, strict=True)]


def invariant(values: list[float], expected: list[float]) -> bool:
    """Bit for bit on the CPU, whose kernels are row-invariant; on CUDA to float32's rounding:
    cuBLAS picks its matmul kernel by the row count, so a row's last bits move with its batch."""
    return values == (pytest.approx(expected, abs=1e-4) if ON_CUDA else expected)


def test_batch_invariant_rows_are_bit_exact_however_computed(make_llm):
    """On the default (4-bit) weights: the same logprobs, bit for bit (on CUDA to float32's
    rounding: ``invariant``), from a whole prefill, from chunks of 5 tokens in a mixed batch,
    from a prefill of the prompt with the tokens that decode generated (recompute after
    preemption) and from scoring them, against decode's own."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    whole = make_llm(batch_invariant=True)
    chunked = make_llm(batch_invariant=True, max_num_batched_tokens=5)
    ids = whole.tokenizer.encode(PROMPTS[3])
    alone = whole.generate([ids], params)[0]
    mixed = chunked.generate([PROMPTS[1], ids, PROMPTS[6]], params)[1]
    assert mixed.token_ids == alone.token_ids
    assert invariant(logprob_trace(mixed), logprob_trace(alone))
    # Token 12 as decode computed it, and as the prefill of everything before it computes it.
    resumed = whole.generate([ids + alone.token_ids[:12]], params)[0]
    resumed_12 = resumed.logprobs[0][alone.token_ids[12]].logprob
    assert invariant([resumed_12], logprob_trace(alone)[12:13])
    assert_pool_free(chunked)
    # And teacher-forced, every position in one call (engine.score), as the sampler reads them.
    scored = whole.engine.score(ids + alone.token_ids)[len(ids) - 1 : -1]
    generated = torch.tensor(alone.token_ids, device=scored.device)[:, None]
    forced = softmax_entropy(scored).logprobs(scored).gather(1, generated)[:, 0]
    assert invariant(forced.tolist(), logprob_trace(alone))


def test_same_tokens_after_a_prefix_cache_hit(llm, alone):
    hits_before = llm.engine.kv.prefix_cache_hits
    out = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[
        0
    ]
    assert out.num_cached_tokens >= 16  # at least one full block came from the cache
    assert llm.engine.kv.prefix_cache_hits > hits_before
    assert out.token_ids == alone


@ON_BOTH_WEIGHTS
def test_same_tokens_after_forced_preemption(make_llm, alone_by_weights, quantization):
    # Eight blocks of 16 tokens hold fewer than two of these requests at full length.
    tiny = make_llm(num_kvcache_blocks=8, enable_prefix_caching=False, quantization=quantization)
    prompts = [PROMPTS[3], PROMPTS[0], PROMPTS[7], PROMPTS[2]]
    outs = tiny.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert sum(o.num_preemptions for o in outs) > 0
    assert tiny.engine.scheduler.num_preemptions > 0
    assert outs[0].token_ids == alone_by_weights[quantization]
    assert_pool_free(tiny)


def test_stale_memory_in_the_cache_never_reaches_an_output(tiny_model):
    """Decode reads a kept block whole, masking the slots past the context; a NaN left there by
    reused memory must not leak through the zero weight (it did, now and then, before)."""
    llm = LLM(tiny_model, num_kvcache_blocks=32, enable_prefix_caching=False)
    clean = greedy(llm, [PROMPTS[3], PROMPTS[0]], max_tokens=12)
    llm.engine.runner.cache.keys.fill_(float("nan"))
    llm.engine.runner.cache.values.fill_(float("nan"))
    assert greedy(llm, [PROMPTS[3], PROMPTS[0]], max_tokens=12) == clean
