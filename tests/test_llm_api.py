"""The offline API on the real model: outputs, stopping, streaming, chat, bad input."""

import dataclasses
import gc
import weakref
from itertools import pairwise

import pytest

from etinfer import LLM, SamplingParams
from etinfer.model.catalog import default_model_path
from tests.conftest import PROMPTS, assert_pool_free


def test_output_carries_one_entropy_temperature_and_logprob_per_token(llm):
    params = SamplingParams(
        temperature=0.8, top_p=0.95, seed=7, max_tokens=20, logprobs=2, ignore_eos=True
    )
    out = llm.generate(PROMPTS[1], params)[0]
    n = len(out.token_ids)
    assert n == 20 and out.finish_reason == "length"
    assert len(out.entropies) == len(out.tempered_entropies) == len(out.temperatures) == n
    assert len(out.logprobs) == n
    assert all(h >= 0 for h in out.entropies)
    assert all(t == pytest.approx(0.8) for t in out.temperatures)
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry and len(entry) in (2, 3)
    assert out.prompt == PROMPTS[1]
    assert out.text == llm.tokenizer.decode(out.token_ids)
    assert 0 < out.metrics.time_to_first_token <= out.metrics.total_time
    assert out.metrics.queue_time >= 0


def test_fixed_seed_reproduces_tokens_and_other_seeds_differ(llm):
    def run(seed):
        return llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=seed, max_tokens=16))[
            0
        ].token_ids

    assert run(11) == run(11)
    assert len({tuple(run(s)) for s in (1, 2, 3)}) > 1


def test_greedy_outputs_have_zero_tempered_entropy(llm):
    out = llm.generate(PROMPTS[5], SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.tempered_entropies == [0.0] * len(out.token_ids)
    assert out.temperatures == [0.0] * len(out.token_ids)


def test_stop_string_truncates_text(llm):
    base = llm.generate(PROMPTS[4], SamplingParams(temperature=0, max_tokens=20))[0].text
    assert " 7," in base
    out = llm.generate(PROMPTS[4], SamplingParams(temperature=0, max_tokens=20, stop=[" 7,"]))[0]
    assert out.finish_reason == "stop"
    assert out.text == base[: base.index(" 7,")]
    kept = llm.generate(
        PROMPTS[4],
        SamplingParams(temperature=0, max_tokens=20, stop=" 7,", include_stop_str_in_output=True),
    )[0]
    assert kept.text == base[: base.index(" 7,") + 3]


def test_stop_token_ids_and_eos(llm):
    base = llm.generate(PROMPTS[4], SamplingParams(temperature=0, max_tokens=10))[0]
    stop_at = base.token_ids[3]
    out = llm.generate(
        PROMPTS[4], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_at])
    )[0]
    assert out.token_ids == base.token_ids[: base.token_ids.index(stop_at) + 1]
    assert out.finish_reason == "stop"
    chat = llm.chat(
        [{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0, max_tokens=200)
    )[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] in llm.tokenizer.eos_token_ids
    assert "<|im_end|>" not in chat.text


def test_max_model_len_ends_a_sequence(make_llm):
    short = make_llm(max_model_len=40)
    out = short.generate(
        PROMPTS[3], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    )[0]
    assert out.finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.token_ids) == 40


def test_stream_grows_to_the_generated_text(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    parts = list(llm.stream(PROMPTS[0], params))
    assert [len(p.token_ids) for p in parts] == list(range(1, 13))
    assert parts[-1].finished and not any(p.finished for p in parts[:-1])
    assert all(b.text.startswith(a.text) for a, b in pairwise(parts))
    assert parts[-1].text == llm.generate(PROMPTS[0], params)[0].text
    assert_pool_free(llm)


def test_abandoned_stream_frees_its_blocks(llm):
    stream = llm.stream(PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
    next(stream)
    assert llm.engine.kv.pool.num_free_blocks < llm.engine.num_blocks
    stream.close()
    assert_pool_free(llm)


def test_abort_mid_generation_frees_blocks(llm):
    engine = llm.engine
    keep = engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6))
    drop = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=100, ignore_eos=True))
    outs = engine.step() + engine.step()
    aborted = engine.abort_request(drop)
    assert aborted.finish_reason == "abort" and len(aborted.token_ids) == 2
    assert engine.abort_request(drop) is None
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs] == [keep]
    assert_pool_free(llm)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", "prompt must not be empty"),
        ([], "prompt_token_ids must not be empty"),
        ([[5, 49152]], r"prompt_token_ids must be integers in \[0, 49151\]"),
        ("word " * 9000, "maximum context length is 8192 tokens"),
    ],
)
def test_bad_prompts_raise_and_the_engine_keeps_serving(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt if prompt != [] else [[]], SamplingParams(max_tokens=4))
    assert_pool_free(llm)
    assert len(llm.generate(PROMPTS[0], SamplingParams(max_tokens=3))[0].token_ids) == 3


def test_a_bad_prompt_in_a_list_queues_none_of_them(llm):
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.generate([PROMPTS[0], ""], SamplingParams(max_tokens=4))
    assert_pool_free(llm)


def test_request_larger_than_the_kv_pool_is_refused(make_llm):
    one_block = make_llm(num_kvcache_blocks=1)
    prompt = list(range(100, 115))  # 15 tokens: with 2 generated, 16 computed at most
    assert (
        len(
            one_block.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids
        )
        == 2
    )
    with pytest.raises(ValueError, match="needs 2 KV blocks"):
        one_block.generate([prompt], SamplingParams(max_tokens=3))
    tiny = make_llm(num_kvcache_blocks=4)
    with pytest.raises(ValueError, match="num_kvcache_blocks is 4"):
        tiny.generate("hello " * 70, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="lower max_tokens"):
        tiny.generate("hello", SamplingParams(max_tokens=100))
    assert tiny.generate("hello", SamplingParams(max_tokens=8))[0].finish_reason in (
        "stop",
        "length",
    )


def test_missing_and_unsupported_models_name_the_path(tmp_path):
    with pytest.raises(ValueError, match=r"nope\.gguf: no such file or folder"):
        LLM(str(tmp_path / "nope.gguf"))
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"weights\.bin: expected a \.gguf file or a Hugging Face"):
        LLM(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match=r"expected config\.json"):
        LLM(str(tmp_path))


def test_tokenizer_matches_transformers(llm):
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    texts = [
        *PROMPTS,
        "  leading spaces, tabs\tand\nnewlines  ",
        "Ünïcödé — “quotes” 東京 😀 café",
        "<|im_start|>user\nhi<|im_end|>",
        "x = [i**2 for i in range(10)]  # 12345678",
    ]
    for text in texts:
        ids = llm.tokenizer.encode(text)
        assert ids == reference(text)["input_ids"], text
        assert llm.tokenizer.decode(ids, skip_special_tokens=False) == text
    messages = [
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Bye"},
    ]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert llm.tokenizer.apply_chat_template(messages) == expected


def test_interleaved_streams_and_generate_each_get_their_own_outputs(llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [o.text for o in llm.generate(PROMPTS[:3], params)]
    first, second = llm.stream(PROMPTS[0], params), llm.stream(PROMPTS[1], params)
    next(first)
    middle = llm.generate(PROMPTS[2], params)[0]  # steps the engine while both streams wait
    rest_first, rest_second = list(first), list(second)
    assert rest_first[-1].text == expected[0] and rest_first[-1].finished
    assert rest_second[-1].text == expected[1] and rest_second[-1].finished
    assert middle.text == expected[2]
    assert_pool_free(llm)


def test_automatic_request_ids_skip_ids_callers_chose(llm):
    engine = llm.engine
    taken = [
        engine.add_request(PROMPTS[0], SamplingParams(max_tokens=2), request_id=str(i))
        for i in range(3)
    ]
    auto = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=2))
    assert auto not in taken
    with pytest.raises(ValueError, match="request_id '1' is already in use"):
        engine.add_request(PROMPTS[0], request_id="1")
    for request_id in [*taken, auto]:
        engine.abort_request(request_id)
    assert_pool_free(llm)


def test_every_output_says_how_many_kv_blocks_it_held_at_the_end(llm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate(["Hi", "The capital of France is " * 8], params)
    block = llm.engine.block_size
    for out in outs:
        # Every token but the last (sampled, never computed) holds a slot.
        computed = len(out.prompt_token_ids) + len(out.token_ids) - 1
        assert out.metrics.kv_blocks == -(-computed // block)
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.num_blocks


def test_engines_share_a_prepared_form_and_keeping_prepared_holds_it_past_them(tiny_model):
    """Engines over one model share its weights as prepared for their kernels while one holds
    them; ``keeping_prepared`` keeps them for later engines (a benchmark's arms, a test session)
    and lets them go when it ends."""
    model = dataclasses.replace(tiny_model, prepared=weakref.WeakValueDictionary())

    def form() -> weakref.ref:
        first = LLM(model, quantization="none", num_kvcache_blocks=8)
        weights = first.engine.runner.model.weights
        second = LLM(model, quantization="none", num_kvcache_blocks=8)
        assert second.engine.runner.model.weights is weights
        return weakref.ref(weights)

    alone = form()
    gc.collect()
    assert alone() is None  # gone with its engines
    with model.keeping_prepared():
        kept = form()
        gc.collect()
        assert kept() is not None
        assert form()() is kept()  # the next engines take it
    gc.collect()
    assert kept() is None
