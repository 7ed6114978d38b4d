"""Faults injected at each stage of a step: the engine ends only the requests whose state the
fault left unknown, with an error naming the stage, gives their blocks back, keeps the other
requests' progress and serves new requests afterwards (tiny random-weight model: mechanics)."""

from __future__ import annotations

import random

import pytest

from etinfer import ControlConfig, SamplingParams, SpeculativeConfig
from etinfer.config import EngineConfig
from etinfer.control.kv_compression import KVCompressionConfig
from etinfer.engine import observer as observer_module
from etinfer.engine.llm_engine import LLMEngine
from etinfer.engine.sequence import Sequence
from tests.engine.test_engine_fuzz import check_pool

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[random.Random(i).randrange(100, 40000) for _ in range(40 + 30 * i)] for i in range(4)]


class Fault(RuntimeError):
    pass


def make_engine(model, **kwargs) -> LLMEngine:
    settings = {
        "quantization": "none",
        "dtype": "float32",
        "kv_cache_dtype": "float32",
        "max_model_len": 512,
        "num_kvcache_blocks": 200,
        "max_num_seqs": 2,  # two run, the others wait: a fault's batch is not everyone
        "batch_invariant": True,
    }
    config = EngineConfig(model=str(model.path), **(settings | kwargs))
    return LLMEngine(config, model)


def drain(engine: LLMEngine) -> dict[str, object]:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in finished  # each request ends exactly once
            if out.finished:
                finished[out.request_id] = out
    return finished


def alone(model, prompt, **kwargs) -> list[int]:
    engine = make_engine(model, **kwargs)
    engine.add_request(prompt, GREEDY)
    return next(iter(drain(engine).values())).token_ids


def fail_once(monkeypatch, target, name: str, after: int = 0) -> None:
    """Make ``target.name`` raise on its call number ``after`` (0: the first), once."""
    original = getattr(target, name)
    calls = [0]

    def faulty(*args, **kwargs):
        calls[0] += 1
        if calls[0] == after + 1:
            raise Fault(f"injected into {name}")
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, faulty)


# stage -> (engine settings, how to inject the fault into a built engine)
STAGES = {
    "scheduling": ({}, lambda e, mp: fail_once(mp, e.scheduler, "schedule", after=3)),
    "deciding": ({}, lambda e, mp: fail_once(mp, e, "_decide", after=3)),
    "drafting": (
        {"speculative": SpeculativeConfig()},
        lambda e, mp: fail_once(mp, e.speculator, "draft", after=3),
    ),
    "forward": ({}, lambda e, mp: fail_once(mp, e.runner, "execute", after=3)),
    "sampling": ({}, lambda e, mp: fail_once(mp, e.runner, "sample", after=3)),
    "measuring": ({}, lambda e, mp: fail_once(mp, Sequence, "append_sampled", after=5)),
    "committing": ({}, lambda e, mp: fail_once(mp, e.kv, "commit", after=5)),
    "compaction": (
        {
            "batch_invariant": False,
            "control": ControlConfig(
                kv_compression=KVCompressionConfig(
                    budget=48, decode_queries=4, window=8, sink=16, recent=16
                )
            ),
        },
        lambda e, mp: fail_once(mp, e.compressor, "compress_due", after=3),
    ),
    "recording": (
        {"speculative": SpeculativeConfig()},
        lambda e, mp: fail_once(mp, e.speculator, "record", after=3),
    ),
    "finishing": ({}, lambda e, mp: fail_once(mp, e.scheduler, "finish", after=0)),
}


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_a_fault_ends_only_the_requests_it_left_unknown(tiny_model, monkeypatch, stage):
    settings, inject = STAGES[stage]
    engine = make_engine(tiny_model, **settings)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    inject(engine, monkeypatch)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in finished
            if out.finished:
                finished[out.request_id] = out
        check_pool(engine)
    assert set(finished) == set(ids)  # every request ended, with an output or an error
    failed = [out for out in finished.values() if out.finish_reason == "error"]
    if stage == "finishing":  # outputs delivered late, no request failed
        assert not failed
    else:
        assert failed and len(failed) <= 2  # at most the step's batch
    assert all(f"failed in {stage}: Fault" in out.error for out in failed)
    assert engine.kv.pool.num_free_blocks == engine.num_blocks
    lossless = settings.get("batch_invariant", True)
    for prompt, request_id in zip(PROMPTS, ids, strict=True):
        out = finished[request_id]
        if out.finish_reason != "error" and lossless:
            assert out.token_ids == alone(tiny_model, prompt, **settings), request_id
    # And the engine serves new requests afterwards.
    later = engine.add_request(PROMPTS[0], GREEDY)
    assert drain(engine)[later].finish_reason == "length"


def test_a_fault_while_observing_ends_no_request(tiny_model, monkeypatch):
    engine = make_engine(tiny_model)
    seen = []
    engine.add_observer(lambda record: (_ for _ in ()).throw(Fault("observer")))
    engine.add_observer(seen.append)
    fail_once(monkeypatch, observer_module.StepRecord, "of", after=2)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS[:2]]
    finished = drain(engine)
    assert [finished[i].finish_reason for i in ids] == ["length", "length"]
    assert seen  # the other observer kept watching
