"""Streaming in deltas: a streamed request's work per step does not grow with its length."""

from __future__ import annotations

import asyncio
import statistics

import pytest

from etinfer import LLM, SamplingParams
from etinfer.outputs import RequestOutput
from etinfer.server.engine_loop import RequestGroup
from tests.conftest import PROMPTS, assert_pool_free

LONG = 2000


def carried(out: RequestOutput) -> int:
    """Entries an output carries: per-token values and characters of text."""
    lists = (out.token_ids, out.entropies, out.tempered_entropies, out.temperatures)
    return sum(map(len, lists)) + len(out.text)


def around(values: list[int], index: int) -> float:
    return statistics.fmean(values[index - 10 : index + 10])


@pytest.mark.slow
def test_a_delta_stream_carries_the_same_per_step_at_2000_tokens_as_at_20(tiny_model):
    llm = LLM(tiny_model, max_model_len=LONG + 64)
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=LONG, ignore_eos=True)
    prompt = PROMPTS[0]
    deltas = list(llm.stream(prompt, params, delta=True))
    sizes = [carried(d) for d in deltas]
    assert len(deltas) == LONG and all(len(d.token_ids) == 1 for d in deltas)
    assert around(sizes, LONG - 20) < 3 * around(sizes, 20)
    # Added up, the deltas are the whole output, each token shipped once.
    whole = RequestOutput.accumulating(deltas[0])
    for delta in deltas[1:]:
        whole.merge(delta)
    assert len(deltas[0].token_ids) == 1  # the deltas handed out stay as they were
    reference = llm.generate(prompt, params)[0]
    assert whole.token_ids == reference.token_ids and whole.text == reference.text
    assert whole.entropies == reference.entropies and whole.finish_reason == "length"
    # The whole-output stream is what grows: the measurement tells the two apart.
    snapshots = [carried(o) for o in llm.stream(prompt, SamplingParams(max_tokens=200))]
    assert around(snapshots, 180) > 5 * around(snapshots, 20)
    assert_pool_free(llm)


def test_the_server_adds_deltas_up_in_place(tiny_model):
    """The event loop's view of a request grows by what each delta carries: the lists it holds
    are extended, never copied."""
    llm = LLM(tiny_model)
    deltas = list(
        llm.stream(PROMPTS[1], SamplingParams(max_tokens=50, ignore_eos=True), delta=True)
    )

    async def deliver() -> RequestOutput:
        group = RequestGroup(["a"])
        group._update(0, deltas[0])
        tokens = group.outputs[0].token_ids
        for delta in deltas[1:]:
            group._update(0, delta)
            assert group.outputs[0].token_ids is tokens
        return group.outputs[0]

    whole = asyncio.run(deliver())
    assert len(whole.token_ids) == 50 and whole.finished
    assert whole.text == "".join(d.text for d in deltas)
