"""A stateful fuzz of the engine: requests added, aborted and stepped at random on a tiny
random-weight model, with each layer that allocates, shares, rolls back or rewrites KV blocks
switched on in turn, and the engine's invariants checked after every rule. It found nothing
the tests before it had not; the prefix-cache eviction it was written alongside is
held by tests/engine/test_block_pool.py.

CI runs a short profile; ``pytest tests/engine/test_engine_fuzz.py --hypothesis-profile=fuzz-long``
runs the long one (about 30,000 rules).
"""

from __future__ import annotations

import random
from collections import Counter
from typing import ClassVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from etinfer import ControlConfig, SamplingParams, SpeculativeConfig
from etinfer.config import EngineConfig
from etinfer.control.block_selection import PruningConfig
from etinfer.control.kv_compression import KVCompressionConfig
from etinfer.control.sparse_prefill import SparsePrefillConfig
from etinfer.control.switching import SwitchingConfig
from etinfer.engine.llm_engine import LLMEngine
from etinfer.engine.sequence import Sequence
from etinfer.model.loader import LoadedModel
from etinfer.outputs import RequestOutput
from etinfer.structured.params import StructuredOutputsParams

MAX_MODEL_LEN = 512
# Grammars a request may follow (structured output): each engine compiles them once, before the
# first request that asks (so a run's steps do not depend on a compiler thread's timing).
CONSTRAINTS = {
    "choice": StructuredOutputsParams(choice=["yes", "no", "maybe not"]),
    "regex": StructuredOutputsParams(regex=r"[a-z]{2,9}( [a-z]{2,9}){0,6}\."),
    "json": StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    ),
}
SHARED_OPENING = [random.Random(1).randrange(100, 40000) for _ in range(40)]
# Each configuration: its engine settings and whether it is lossless (a greedy request's output
# is then the same whatever ran beside it; batch_invariant makes the arithmetic agree too).
LAYERS: dict[str, tuple[dict, bool]] = {
    "plain": ({"batch_invariant": True}, True),
    "no-prefix-cache": ({"batch_invariant": True, "enable_prefix_caching": False}, True),
    "small-pool": ({"batch_invariant": True, "num_kvcache_blocks": 40}, True),
    "prompt-lookup": ({"batch_invariant": True, "speculative": SpeculativeConfig()}, True),
    # The entropy policy reads priorities; it reorders and preempts, and loses nothing.
    "entropy-scheduling": (
        {
            "batch_invariant": True,
            "num_kvcache_blocks": 60,
            "control": ControlConfig(scheduling=True),
        },
        True,
    ),
    "self-draft": (
        {
            "batch_invariant": True,
            "draft_model": "self:1",
            "speculative": SpeculativeConfig(method="draft", exit_adapter=False),
        },
        True,
    ),
    "pruning": (
        {
            "num_kvcache_blocks": 60,
            "control": ControlConfig(
                pruning=PruningConfig(min_context=64, dense_layers=0, min_blocks=3)
            ),
        },
        False,
    ),
    "sparse-prefill": (
        {
            "control": ControlConfig(
                sparse_prefill=SparsePrefillConfig(
                    segment_size=32, min_context=64, base_budget=64, sink=16, window=32
                )
            )
        },
        False,
    ),
    "kv-compression": (
        {
            "control": ControlConfig(
                kv_compression=KVCompressionConfig(
                    budget=48, decode_queries=4, window=8, sink=16, recent=16
                )
            )
        },
        False,
    ),
    "ead": (
        {
            "draft_model": "self:1",
            "control": ControlConfig(
                switching=SwitchingConfig(threshold=8.0, hysteresis=0.5, exit_adapter=False)
            ),
        },
        False,
    ),
}


def engine_for(model: LoadedModel, layer: str) -> LLMEngine:
    """A fresh engine per run: a run's outcome then depends on its rules alone, so hypothesis
    can replay and shrink it."""
    settings_, _ = LAYERS[layer]
    config = EngineConfig(
        model=str(model.path),
        quantization="none",
        dtype="float32",
        kv_cache_dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=128,
        max_num_seqs=8,
        **{"num_kvcache_blocks": 200, **settings_},
    )
    return LLMEngine(config, model)


def live_sequences(engine: LLMEngine) -> list[Sequence]:
    return engine.scheduler.running + engine.scheduler.waiting


def check_pool(engine: LLMEngine) -> None:
    """Every block is free or held, counted once; reference counts equal the holders; the
    prefix cache's index agrees with the blocks' keys."""
    pool = engine.kv.pool
    holders = Counter(block for seq in live_sequences(engine) for block in seq.block_table)
    assert [pool.ref_counts[b] for b in range(pool.num_blocks)] == [
        holders[b] for b in range(pool.num_blocks)
    ]
    free = [b for b in range(pool.num_blocks) if pool.ref_counts[b] == 0]
    assert sorted(pool._free) == free
    for key_hash, block in pool._cached.items():
        assert pool._keys[block][0] == key_hash


class EngineMachine(RuleBasedStateMachine):
    model: LoadedModel  # set by the test
    rules_run: ClassVar[Counter] = Counter()  # per layer configuration, over the whole test

    @initialize(layer=st.sampled_from(sorted(LAYERS)))
    def build(self, layer: str) -> None:
        self.layer = layer
        self.engine = engine_for(self.model, layer)
        self.free_at_start = self.engine.kv.pool.num_free_blocks
        assert self.free_at_start == self.engine.num_blocks
        self.requests: dict[str, tuple[list[int], SamplingParams, bool]] = {}
        self.ended: dict[str, RequestOutput] = {}
        self.streamed: dict[str, RequestOutput] = {}

    @rule(
        shared=st.booleans(),
        # Mostly short; some reach the context's end, some are over it (refused).
        length=st.one_of(st.integers(1, 300), st.integers(440, 560)),
        seed=st.integers(0, 2**16),
        greedy=st.booleans(),
        n=st.integers(1, 3),
        max_tokens=st.integers(1, 40),
        stop=st.booleans(),
        priority=st.integers(-2, 2),
        stream=st.booleans(),
        constraint=st.sampled_from([None, None, *sorted(CONSTRAINTS)]),
    )
    def add(
        self, shared, length, seed, greedy, n, max_tokens, stop, priority, stream, constraint
    ) -> None:
        rng = random.Random(seed)
        tail = [rng.randrange(100, 40000) for _ in range(length)]
        prompt = (SHARED_OPENING + tail) if shared else tail
        params = SamplingParams(
            temperature=0.0 if greedy else 1.0,
            seed=None if greedy else seed,
            max_tokens=max_tokens,
            stop=["e"] if stop else [],
            structured=None if constraint is None else CONSTRAINTS[constraint],
        )
        if params.structured is not None:
            self.engine.grammars.compiler.compile(params.structured)
        for _ in range(n):  # n choices: the same prompt, each its own request
            before = set(self.engine._requests)
            try:
                request_id = self.engine.add_request(
                    prompt, params, stream=stream, delta=stream, priority=priority
                )
            except ValueError:
                # Refused (too long for the context or the pool): nothing was accepted.
                assert len(prompt) + max_tokens > MAX_MODEL_LEN or self.layer == "small-pool"
                assert set(self.engine._requests) == before
                return
            self.requests[request_id] = (prompt, params, stream)

    @rule(pick=st.integers(0, 10**6))
    def abort(self, pick: int) -> None:
        live = sorted(r for r in self.requests if r not in self.ended)
        if not live:
            return  # enabled whatever the engine did: rule choice must not depend on it
        request_id = live[pick % len(live)]
        out = self.engine.abort_request(request_id)
        assert out is not None and out.finish_reason == "abort"
        self._record(out)

    @rule()
    def step(self) -> None:
        for out in self.engine.step():
            self._record(out)

    def _record(self, out: RequestOutput) -> None:
        request_id = out.request_id
        assert request_id in self.requests and request_id not in self.ended, request_id
        if out.delta:
            if request_id in self.streamed:
                self.streamed[request_id].merge(out)
            else:
                self.streamed[request_id] = RequestOutput.accumulating(out)
            out = self.streamed[request_id]
        if out.finished:
            assert len(out.entropies) == len(out.token_ids) == len(out.temperatures)
            self.ended[request_id] = out

    @invariant()
    def pool_is_consistent(self) -> None:
        if hasattr(self, "engine"):
            EngineMachine.rules_run[self.layer] += 1
            check_pool(self.engine)
            for seq in live_sequences(self.engine):
                assert not seq.is_finished
            assert all(r in self.engine._requests for r in self.requests if r not in self.ended)

    def teardown(self) -> None:
        if not hasattr(self, "engine"):
            return
        engine = self.engine
        for _ in range(10_000):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                self._record(out)
        assert not engine.has_unfinished_requests()
        assert set(self.ended) == set(self.requests)  # every request ended, exactly once
        assert engine.kv.pool.num_free_blocks == self.free_at_start
        assert all(count == 0 for count in engine.kv.pool.ref_counts)
        _, lossless = LAYERS[self.layer]
        if not lossless:
            return
        # Greedy requests that ran to their end: the same tokens run alone.
        done = [
            r
            for r, (_, p, _) in self.requests.items()
            if p.greedy and self.ended[r].finish_reason in ("stop", "length")
        ][:3]
        for request_id in done:
            prompt, params, _ = self.requests[request_id]
            alone_id = engine.add_request(prompt, params)
            alone = None
            while engine.has_unfinished_requests():
                for out in engine.step():
                    alone = out if out.request_id == alone_id else alone
            assert alone.token_ids == self.ended[request_id].token_ids, request_id


FAST = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.mark.slow
def test_engine_invariants_hold_under_random_interleavings(tiny_model, request):
    EngineMachine.model = tiny_model
    profile = request.config.getoption("hypothesis_profile", None)
    machine = EngineMachine.TestCase
    machine.settings = settings.get_profile(profile) if profile == "fuzz-long" else FAST
    EngineMachine.rules_run = Counter()
    machine().runTest()
    print(f"rules run, by layer: {dict(EngineMachine.rules_run)}; ", end="")
    print(f"total {sum(EngineMachine.rules_run.values())}")
