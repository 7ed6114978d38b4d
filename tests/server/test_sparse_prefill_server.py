"""The server with sparse prefill on: a long prompt's reply says how much prefill attention it
skipped, and /metrics counts it."""

import openai

from etinfer import ControlConfig
from etinfer.bench.common.fidelity import corpus_tokens
from etinfer.control.sparse_prefill import SparsePrefillConfig
from etinfer.server import create_app
from tests.server.conftest import API_KEY, ServerThread, make_engine

# Small sizes, so that a prompt of 1,500 tokens is long enough to be sparse.
SMALL = SparsePrefillConfig(segment_size=128, min_context=512, base_budget=384, window=128)


def test_a_long_prompt_reports_the_attention_it_skipped(loaded_model):
    engine = make_engine(
        loaded_model, max_model_len=2048, control=ControlConfig(sparse_prefill=SMALL)
    )
    corpus = corpus_tokens(loaded_model.tokenizer)
    long_prompt = loaded_model.tokenizer.decode(corpus[:1500])
    other_prompt = loaded_model.tokenizer.decode(corpus[3000:4500])  # no prefix-cache hit
    with ServerThread(create_app(engine, api_key=API_KEY)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        model = client.models.list().data[0].id
        reply = client.completions.create(
            model=model, prompt=long_prompt, max_tokens=4, temperature=0
        )
        asked = client.completions.create(
            model=model,
            prompt=other_prompt,
            max_tokens=4,
            temperature=0,
            extra_body={"return_attention_entropy": True},
        )
        short = client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=4, temperature=0
        )
        metrics = server.wait_idle()
    skipped = reply.choices[0].model_extra["etinfer"]["prefill_attention_skipped"]
    assert 0.1 < skipped < 1.0
    assert "prefill_attention_skipped" not in short.choices[0].model_extra["etinfer"]
    assert "attention_profile" not in reply.choices[0].model_extra["etinfer"]
    profile = asked.choices[0].model_extra["etinfer"]["attention_profile"]
    entropy = profile["entropy"]  # [segments][layers][KV heads]
    prompt_tokens = asked.usage.prompt_tokens
    assert profile["segment_size"] == 128 and len(entropy) == -(-prompt_tokens // 128)
    assert len(entropy[1]) == 30 and len(entropy[1][0]) == 3
    assert entropy[0][0][0] is None and all(h >= 0 for h in entropy[5][10])
    other = asked.choices[0].model_extra["etinfer"]["prefill_attention_skipped"]
    assert metrics["etinfer:prefill_attention_skipped_ratio_count"] == 2
    assert metrics["etinfer:prefill_attention_skipped_ratio_sum"] == skipped + other
