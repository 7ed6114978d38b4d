"""Latent KV compression: the ranking law, the compaction that frees blocks, and the real model
answering a passkey question asked after its cache was compressed."""

import weakref
from dataclasses import replace

import pytest
import torch

from etinfer import LLM, ControlConfig, SamplingParams
from etinfer.bench.common.fidelity import FILLER, passkey_accuracy, passkey_cases
from etinfer.config import EngineConfig, SpeculativeConfig
from etinfer.control.kv_compression import (
    KVCompressionConfig,
    kept_positions,
    observed_attention,
)
from tests.conftest import assert_pool_free


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("budget", 40, r"budget must be in \[80, inf\]"),  # under sink 16 + recent 64
        ("decode_queries", -1, r"decode_queries must be in \[0, inf\]"),
        ("pool_kernel", 4, "pool_kernel must be odd"),
    ],
)
def test_invalid_settings_name_the_field_and_the_limit(field, value, message):
    with pytest.raises(ValueError, match=message):
        KVCompressionConfig(**{field: value})


def test_compression_refuses_layers_that_roll_sequences_back():
    with pytest.raises(ValueError, match=r"control\.kv_compression and speculative"):
        EngineConfig(control=ControlConfig(kv_compression=True), speculative=SpeculativeConfig())


def test_kept_positions_hold_sink_recent_and_the_best_scores():
    config = KVCompressionConfig(budget=8, sink=2, recent=2, pool_kernel=1, key_novelty=False)
    scores = torch.zeros(2, 20)
    scores[0, [5, 9, 11, 13]] = 1.0
    scores[1, [3, 4, 6, 7]] = 1.0
    kept = kept_positions(scores, None, config)
    assert kept.tolist() == [[0, 1, 5, 9, 11, 13, 18, 19], [0, 1, 3, 4, 6, 7, 18, 19]]


def test_pooling_keeps_a_run_of_tokens_together():
    config = KVCompressionConfig(budget=5, sink=1, recent=1, pool_kernel=3, key_novelty=False)
    scores = torch.zeros(1, 30)
    scores[0, 10:13] = 1.0  # a run of three
    scores[0, 20] = 1.4  # a lone spike: alone it outscores each token of the run
    assert kept_positions(scores, None, config).tolist() == [[0, 10, 11, 12, 29]]


def test_a_novel_key_is_kept_though_the_voters_ignored_it():
    config = KVCompressionConfig(budget=4, sink=1, recent=1, pool_kernel=1)
    keys = torch.ones(1, 12, 4)
    keys[0, 6] = torch.tensor([1.0, -1.0, 1.0, -1.0])  # unlike every other key
    attention = torch.linspace(0, 1, 12)[None]  # the voters prefer late positions
    assert kept_positions(attention, keys, config).tolist() == [[0, 6, 10, 11]]
    plain = KVCompressionConfig(budget=4, sink=1, recent=1, pool_kernel=1, key_novelty=False)
    assert kept_positions(attention, keys, plain).tolist() == [[0, 9, 10, 11]]


def test_observed_attention_sums_each_queries_causal_softmax():
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, context = 4, 2, 8, 12
    queries = torch.randn(3, heads, dim, generator=gen)
    keys = torch.randn(kv_heads, context, dim, generator=gen)
    query_pos = torch.tensor([5, 9, 11])
    got = observed_attention(queries, query_pos, keys, dim**-0.5)
    expected = torch.zeros(kv_heads, context)
    for v, p in enumerate(query_pos.tolist()):
        for h in range(heads):
            kv = h // (heads // kv_heads)
            weights = (keys[kv, : p + 1] @ queries[v, h] * dim**-0.5).softmax(-1)
            expected[kv, : p + 1] += weights
    torch.testing.assert_close(got, expected)


SMALL = KVCompressionConfig(budget=96, decode_queries=4, window=8, sink=16, recent=16)


def tiny_engine(tiny_model, control, **kwargs) -> LLM:
    return LLM(tiny_model, control=control, max_model_len=1024, num_kvcache_blocks=256, **kwargs)


def test_compression_frees_blocks_and_the_request_keeps_fewer(tiny_model):
    prompt = list(range(1000, 1400))  # 400 tokens: 25 blocks
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    dense = tiny_engine(tiny_model, ControlConfig()).generate([prompt], params)[0]
    llm = tiny_engine(tiny_model, ControlConfig(kv_compression=SMALL))
    engine = llm.engine
    engine.add_request(prompt, params)
    held = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        held.append(engine.num_blocks - engine.kv.pool.num_free_blocks)
    (out,) = outputs
    # Blocks held fall when the cache is compressed, after the voting tokens.
    assert max(held) >= 25 and min(h for h in held if h) <= 8
    # The budget's entries plus the tokens after the voters: 96 + (24 - 4) = 116.
    assert out.metrics.kv_blocks == -(-(SMALL.budget + 24 - SMALL.decode_queries) // 16)
    assert dense.metrics.kv_blocks == -(-(400 + 24) // 16)
    assert len(out.token_ids) == 24
    assert_pool_free(llm)


def test_a_budget_holding_the_whole_context_compresses_to_the_same_outputs(tiny_model):
    prompt = list(range(2000, 2100))
    exact = KVCompressionConfig(budget=104, decode_queries=4, window=8, sink=16, recent=16)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    dense = tiny_engine(tiny_model, ControlConfig()).generate([prompt], params)[0]
    llm = tiny_engine(tiny_model, ControlConfig(kv_compression=exact))
    out = llm.generate([prompt], params)[0]
    assert out.token_ids == dense.token_ids
    assert out.metrics.kv_blocks == dense.metrics.kv_blocks


@pytest.mark.parametrize("chunk", [1024, 96])
def test_preempted_compressed_sequences_recompute_and_finish(tiny_model, chunk):
    # A pool too small for four uncompressed 400-token sequences at once: preemption follows.
    # With small chunks a recompute spans many steps, and compression waits for its end.
    llm = LLM(
        tiny_model,
        control=ControlConfig(kv_compression=SMALL),
        max_model_len=1024,
        num_kvcache_blocks=70,
        max_num_batched_tokens=chunk,
    )
    prompts = [list(range(3000 + 500 * i, 3400 + 500 * i)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [40] * 4
    assert_pool_free(llm)


def mixed_window_model(tiny_model, window: int):
    """The tiny model with its first layer sliding (window ``window``), as Gemma 3's are."""
    config = replace(tiny_model.config, sliding_window=window, layer_windows=(window, None))
    return replace(tiny_model, config=config, prepared=weakref.WeakValueDictionary())


def test_sliding_layers_keep_their_window_and_global_ones_vote(tiny_model):
    """In a model whose layers differ in their window, compaction keeps a sliding layer's most
    recent positions, bit for bit what an uncompressed run holds there, so its window reads what
    it read before; the layer that sees everything keeps the voted positions."""
    model = mixed_window_model(tiny_model, 64)
    prompt = list(range(1000, 1400))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    dense = tiny_engine(model, ControlConfig()).engine
    llm = tiny_engine(model, ControlConfig(kv_compression=SMALL))
    compressed = llm.engine
    for engine in (dense, compressed):
        engine.add_request(prompt, params)
    while not compressed.scheduler.running or not compressed.scheduler.running[0].kv_compressed:
        dense.step()
        compressed.step()
    seq, reference = compressed.scheduler.running[0], dense.scheduler.running[0]
    budget, bs = SMALL.budget, 16
    kept_slots = torch.tensor([seq.block_table[i // bs] * bs + i % bs for i in range(budget)])
    context = seq.num_computed_tokens
    recent = range(context - budget, context)
    recent_slots = torch.tensor([reference.block_table[p // bs] * bs + p % bs for p in recent])
    ours, theirs = compressed.runner.cache, dense.runner.cache
    assert torch.equal(ours.keys[0][:, kept_slots], theirs.keys[0][:, recent_slots])
    assert torch.equal(ours.values[0][:, kept_slots], theirs.values[0][:, recent_slots])
    assert not torch.equal(ours.keys[1][:, kept_slots], theirs.keys[1][:, recent_slots])
    while compressed.has_unfinished_requests():
        compressed.step()
    assert_pool_free(llm)


def test_a_model_whose_every_layer_slides_is_refused(tiny_model):
    config = replace(tiny_model.config, sliding_window=256)
    model = replace(tiny_model, config=config, prepared=weakref.WeakValueDictionary())
    with pytest.raises(ValueError, match="every layer reads no more than its window"):
        tiny_engine(model, ControlConfig(kv_compression=SMALL))


def test_a_budget_smaller_than_the_sliding_window_is_refused(tiny_model):
    model = mixed_window_model(tiny_model, 128)
    with pytest.raises(ValueError, match="budget must hold the sliding layers' window: at least"):
        tiny_engine(model, ControlConfig(kv_compression=SMALL))


def test_the_prefix_cache_stays_true_after_a_compressed_request(tiny_model):
    llm = tiny_engine(tiny_model, ControlConfig(kv_compression=SMALL))
    prompt = list(range(5000, 5400))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    again = llm.generate([prompt], params)[0]
    assert again.num_cached_tokens >= 384
    assert again.token_ids == first.token_ids


def test_voters_served_from_the_prefix_cache_do_not_vote(tiny_model):
    # A window of 32 reaches back past the last cached block: half its voters are not computed
    # the second time, and only those computed vote (uninitialised queries would).
    config = replace(SMALL, window=32)
    llm = tiny_engine(tiny_model, ControlConfig(kv_compression=config))
    prompt = list(range(6000, 6400))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm.generate([prompt], params)
    engine = llm.engine
    engine.add_request(prompt, params)
    seen = []
    while engine.has_unfinished_requests():
        seqs = list(engine._requests.values())
        states = [seq.kv_compression for seq in seqs]
        seen += [state.voted.clone() for state in states if state.voted is not None]
        outputs = engine.step()
    # Seen before each step: the last voter is computed in the step that compresses.
    assert not seen[-1][:16].any() and seen[-1][16:-1].all()
    assert outputs[0].num_cached_tokens == 384
    assert outputs[0].metrics.kv_blocks == -(-(config.budget + 16 - config.decode_queries) // 16)


def test_the_passkey_asked_after_compression_is_still_found(make_llm, loaded_model):
    config = KVCompressionConfig(budget=512)  # a third of the prompt, as 1024 of 3072 tokens
    # Float32 weights: the same behaviour for this test, and prefill at about twice the 4-bit
    # kernels' rate on an AVX2 host (three 1.5K-token prompts for each of three engines).
    compressed = make_llm(
        quantization="none", control=ControlConfig(kv_compression=config), max_num_seqs=4
    )
    dense = make_llm(quantization="none", max_num_seqs=4)
    filler = loaded_model.tokenizer.encode(FILLER * 4)[: config.decode_queries + 1]
    # A needle in filler (the corpus haystack loses what dense finds: BENCHMARKS.md).
    cases = passkey_cases(loaded_model.tokenizer, (1536,), "repeated", seed=2)[1:4]
    for case in cases:  # the question comes after the voting tokens: compression has run
        case.question = filler + case.question
    found_dense = passkey_accuracy(dense, cases)
    found = passkey_accuracy(compressed, cases)
    assert any(found_dense)
    assert [f or not d for f, d in zip(found, found_dense, strict=True)] == [True] * 3
    # Without the novel keys, the voters (the prompt's end, the filler after it) drop it.
    plain = replace(config, key_novelty=False)
    plain_llm = make_llm(quantization="none", control=ControlConfig(kv_compression=plain))
    assert not any(passkey_accuracy(plain_llm, cases))
