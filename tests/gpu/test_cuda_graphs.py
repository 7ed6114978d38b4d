"""Decode steps replayed as CUDA graphs compute what the eager steps compute (CUDA only:
``ETINFER_DEVICE=cuda``; the CPU has no graphs and its suite skips these)."""

from __future__ import annotations

import pytest

from etinfer import LLM, SamplingParams
from etinfer.control.block_selection import PruningConfig
from etinfer.control.config import ControlConfig
from tests.conftest import ENGINE_DEFAULTS, ON_CUDA, PROMPTS, assert_pool_free

pytestmark = pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs (ETINFER_DEVICE=cuda)")


def generate_both(loaded_model, prompts, params, **kwargs):
    """The same requests through an engine with graphs and one without."""
    results = []
    for graphs in (True, False):
        llm = LLM(loaded_model, cuda_graphs=graphs, **ENGINE_DEFAULTS | kwargs)
        results.append(llm.generate(prompts, params))
        if graphs:
            assert llm.engine.runner.graphs.replays > 0
            assert_pool_free(llm)
    return results


@pytest.mark.parametrize("count", [1, 3, 8])
def test_graph_steps_give_the_eager_tokens_and_logprobs(loaded_model, count) -> None:
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=1)
    graphed, eager = generate_both(loaded_model, PROMPTS[:count], params, max_num_seqs=16)
    for a, b in zip(graphed, eager, strict=True):
        assert a.token_ids == b.token_ids
        for step, (x, y) in enumerate(zip(a.logprobs, b.logprobs, strict=True)):
            token = a.token_ids[step]
            assert abs(x[token].logprob - y[token].logprob) < 1e-4


def test_seeded_sampling_and_preemption_under_graphs(loaded_model) -> None:
    """A pool that holds one sequence's context at a time preempts; seeded sampling draws the
    same tokens as eager."""
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=40, ignore_eos=True) for i in range(6)
    ]
    graphed, eager = generate_both(
        loaded_model, PROMPTS[:6], params, max_num_seqs=8, num_kvcache_blocks=12
    )
    assert sum(r.num_preemptions for r in graphed) > 0
    assert [r.token_ids for r in graphed] == [r.token_ids for r in eager]


def test_requests_joining_a_running_batch(loaded_model) -> None:
    """Steps that prefill newcomers run eagerly, the decode steps between them replay; the
    padding rows of a bucket touch no sequence's cache."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = []
    for graphs in (True, False):
        engine = LLM(loaded_model, cuda_graphs=graphs, max_num_seqs=16, **ENGINE_DEFAULTS).engine
        done = {}
        for i, prompt in enumerate(PROMPTS[:5]):
            engine.add_request(prompt, params, request_id=str(i))
            for _ in range(3 + i):
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out.token_ids
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
        outputs.append(done)
    assert outputs[0] == outputs[1]


def test_layers_that_shape_decode_steps_run_eagerly(loaded_model) -> None:
    pruned = LLM(
        loaded_model,
        control=ControlConfig(pruning=PruningConfig(scorer="bound")),
        num_kvcache_blocks=64,
        **ENGINE_DEFAULTS,
    )
    assert pruned.engine.runner.graphs is None
    eager = LLM(loaded_model, num_kvcache_blocks=64, cuda_graphs=False, **ENGINE_DEFAULTS)
    assert eager.engine.runner.graphs is None
