"""Each optional layer keeps a request's state in an object of its own, hung on the sequence
under the layer's name: none where every layer is off, that layer's alone where one is on."""

from __future__ import annotations

import pytest

from etinfer import LLM, ControlConfig, SamplingParams, SpeculativeConfig
from etinfer.config import EngineConfig
from etinfer.control.drafting import SpeculationState
from etinfer.control.kv_compression import KVCompressionState
from etinfer.control.pruning_state import PruningState
from etinfer.control.record import TARGET_MODEL, ControlRecord
from etinfer.control.sparse_prefill import AttentionProfile, SparsePrefillConfig
from etinfer.control.switching import SwitchingState
from etinfer.engine.layers import start_layers
from etinfer.engine.sequence import Sequence
from etinfer.structured.masks import StructuredState
from etinfer.structured.params import StructuredOutputsParams

LAYERS = ("pruning", "speculation", "switching", "sparse_prefill", "kv_compression", "structured")


def entering(config: EngineConfig, params: SamplingParams | None = None) -> Sequence:
    """A request as it enters an engine built with ``config``."""
    seq = Sequence(
        "r", 0, [1, 2, 3], params or SamplingParams(), None, prompt=None, arrival_time=0.0,
        stream=False,
    )  # fmt: skip
    start_layers(config, seq)
    return seq


def layer_states(seq: Sequence) -> dict[str, object]:
    return {name: getattr(seq, name) for name in LAYERS if getattr(seq, name) is not None}


def test_a_request_with_every_layer_off_carries_no_layer_state():
    seq = entering(EngineConfig(control=ControlConfig.baseline()))
    assert layer_states(seq) == {}
    # What the core and the record read of the layers is then what a plain request has.
    assert (seq.kv_offset, seq.kv_compressed, seq.num_full_tokens) == (0, False, 0)
    assert seq.matcher is None and not seq.writes_models
    entry = ControlRecord.build(1, (seq,), ())[seq]
    assert (entry.block_budget, entry.blocks_kept, entry.draft_length) == (None, 1.0, None)


@pytest.mark.parametrize(
    ("settings", "layer", "kind"),
    [
        ({"control": ControlConfig(pruning=True)}, "pruning", PruningState),
        ({"speculative": SpeculativeConfig()}, "speculation", SpeculationState),
        (
            {"control": ControlConfig(switching=True), "draft_model": "self:1"},
            "switching",
            SwitchingState,
        ),
        ({"control": ControlConfig(kv_compression=True)}, "kv_compression", KVCompressionState),
    ],
)
def test_a_layer_switched_on_gives_each_request_its_own_state(settings, layer, kind):
    seq = entering(EngineConfig(**settings))
    assert list(layer_states(seq)) == [layer]
    assert type(getattr(seq, layer)) is kind


def test_switching_starts_each_request_on_the_large_model_with_every_layer_full():
    seq = entering(EngineConfig(control=ControlConfig(switching=True), draft_model="self:1"))
    assert seq.switching.current.model == TARGET_MODEL and seq.switching.exit_start is None
    assert seq.writes_models  # its outputs name the writer of every token


def test_a_grammar_gives_its_request_the_structured_state_and_no_other_request():
    structured = SamplingParams(structured=StructuredOutputsParams(choice=["yes", "no"]))
    seq = entering(EngineConfig(), structured)
    assert list(layer_states(seq)) == ["structured"]
    assert seq.structured == StructuredState() and seq.matcher is None  # not compiled yet
    assert layer_states(entering(EngineConfig())) == {}


def test_the_record_reads_the_layers_state_through_the_sequence():
    config = EngineConfig(control=ControlConfig(pruning=True), speculative=SpeculativeConfig())
    seq = entering(config)
    seq.pruning.block_budget = 12
    seq.pruning.record_attention(kept=3, total=4, dropped_mass=0.01)
    seq.speculation.record(config.speculative, drafted=4, accepted=4)
    entry = ControlRecord.build(1, (seq,), ())[seq]
    assert (entry.block_budget, entry.blocks_kept, entry.draft_length) == (12, 0.75, 6)


def test_the_engine_hangs_each_layers_state_on_its_requests(tiny_model):
    """Through the engine's intake; sparse prefill's profile comes with a long prompt's first
    prefill chunk, and a short prompt, which attends densely, never gets one."""
    sparse = SparsePrefillConfig(segment_size=64, min_context=128, base_budget=96, window=64)
    control = ControlConfig(pruning=True, sparse_prefill=sparse)
    engine = LLM(tiny_model, control=control, max_model_len=1024, num_kvcache_blocks=256).engine
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    long, short = (engine.add_request(list(range(1000, 1000 + n)), params) for n in (400, 50))
    seqs = [engine._requests[request_id] for request_id in (long, short)]
    assert all(list(layer_states(seq)) == ["pruning"] for seq in seqs)
    while engine.has_unfinished_requests():
        engine.step()
    assert isinstance(seqs[0].sparse_prefill, AttentionProfile)
    assert seqs[1].sparse_prefill is None
