"""The control seam: the step's record, the registries of each kind of law, the step shaper, and
what observers of a step see, on the real model where behaviour is at stake."""

from __future__ import annotations

import itertools

import pytest

from etinfer import ControlConfig, PruningConfig, SamplingParams
from etinfer.control.block_selection import BLOCK_SELECTORS, EntropicSelector
from etinfer.control.record import ControlRecord, StepShape
from etinfer.control.scheduling import SCHEDULING_POLICIES
from etinfer.control.shaping import STEP_SHAPERS, StepShaper
from etinfer.control.temperature import TEMPERATURE_LAWS
from etinfer.engine.sequence import Sequence
from etinfer.sampling_params import ENTROPY_CONTROLS
from tests.conftest import PROMPTS, assert_pool_free


@pytest.mark.parametrize(
    ("registry", "kind", "known"),
    [
        (SCHEDULING_POLICIES, "scheduling policy", "fcfs, entropy"),
        (BLOCK_SELECTORS, "block selector", "dense, entropic"),
        (TEMPERATURE_LAWS, "temperature law", "fixed, feedback, lagged, exact, edt, mirostat"),
        (STEP_SHAPERS, "step shaper", "plain"),  # (then the shapers these tests register)
    ],
)
def test_each_kind_of_law_is_picked_by_name_and_an_unknown_name_lists_the_known(
    registry, kind, known
):
    with pytest.raises(ValueError, match=f"unknown {kind} 'lottery'; known: {known}"):
        registry.create("lottery")
    assert registry.create(registry.names[0]) is not None


def test_every_entropy_control_a_request_may_name_is_a_temperature_law():
    for name in ENTROPY_CONTROLS:
        law = TEMPERATURE_LAWS.create(name)
        params = SamplingParams(entropy_target=2.0, entropy_control=name)
        assert params.controller == name
        assert law.initial_state(params) is not None  # it carries a state: it regulates


def decoding_seq(context: int, generated: int) -> Sequence:
    seq = Sequence(
        "r", 0, list(range(context)), SamplingParams(), None, prompt=None, arrival_time=0.0,
        stream=False,
    )  # fmt: skip
    seq.token_ids += [5] * generated
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


def test_block_budgets_follow_the_predictive_entropy_in_the_record():
    config = PruningConfig(scorer="bound", min_context=0, min_blocks=4, max_shrink=1.0)
    selector = EntropicSelector(config)
    calm, unsure, fresh = decoding_seq(1024, 3), decoding_seq(1024, 3), decoding_seq(1024, 0)
    calm.profile.update(0.2)
    unsure.profile.update(0.3, upper=6.0)  # a top-k estimate whose tail bound is wide
    record = ControlRecord.build(1, (calm, unsure, fresh), ())
    calm.profile.update(9.0)  # measured after the record was built: read next step
    budgets = selector.plan_budgets(record, [calm, unsure, fresh], 16)
    # 65 blocks in context: the floor's share, the ceiling's (read from the upper side); the
    # last has no estimate yet and attends densely to its 64.
    assert budgets == [9, 33, 64]
    assert BLOCK_SELECTORS.create("dense").plan_budgets(record, [calm], 16) is None


@STEP_SHAPERS.register("recording")
class Recording(StepShaper):
    """Runs the plain step and remembers what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, int]] = []

    def shape(self, record, seqs) -> StepShape:
        self.asked.append((record.step, len(seqs)))
        return StepShape()


@STEP_SHAPERS.register("elsewhere")
class Elsewhere(StepShaper):
    def shape(self, record, seqs) -> StepShape:
        return StepShape("draft")


def test_the_step_shaper_decides_every_step_from_the_record(make_llm):
    llm = make_llm(step_shaper="recording")
    steps = []
    with llm.engine.observing(steps.append):
        llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert llm.engine.shaper.asked == [(s.step, len(s.request_ids)) for s in steps]
    assert all(s.decisions.shape == StepShape("target") for s in steps)
    elsewhere = make_llm(step_shaper="elsewhere")
    # The step fails in its forward stage: its request ends with the error, the engine goes on.
    (failed,) = elsewhere.generate(PROMPTS[0], SamplingParams(max_tokens=2))
    assert failed.finish_reason == "error"
    assert "failed in forward: ValueError" in failed.error
    assert "model 'draft'; this engine has: target" in failed.error
    assert_pool_free(elsewhere)


def test_an_observer_sees_each_step_and_the_entropy_loop_closes(make_llm):
    """The predictive entropy measured in one step is what the next step's record carries."""
    llm = make_llm(control=ControlConfig(sampling=True))
    steps = []
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=6, ignore_eos=True)
    with llm.engine.observing(steps.append):
        outs = llm.generate(PROMPTS[:2], params)
    assert len(steps) == 6  # both prompts prefill in the first step, then one decode step each
    first = steps[0]
    assert first.num_decode == 0
    assert first.prefill_tokens == sum(len(o.prompt_token_ids) for o in outs)
    assert all(s.num_decode == 2 and s.prefill_tokens == 0 for s in steps[1:])
    assert all(s.wall_time > 0 and s.cpu_time > 0 and s.logits is None for s in steps)
    assert [s.step for s in steps] == list(range(first.step, first.step + 6))
    for before, after in itertools.pairwise(steps):
        for row, i in enumerate(before.sampled):
            request_id = before.request_ids[i]
            entry = next(v for k, v in after.control.seqs.items() if k.request_id == request_id)
            assert entry.predictive_entropy == before.measured.predictive_entropy[row]
            # The feedback law's state carried over is what this step's decision starts from.
            assert entry.temperature_state == pytest.approx(before.measured.states[row])
        assert after.decisions.temperature_states == [
            after.control.seqs[seq].temperature_state
            for seq in after.control.running
            if seq.request_id in after.request_ids
        ]
    # What the observers measured is what the outputs report, token by token.
    measured = {rid: [] for rid in steps[0].request_ids}
    for step in steps:
        for row, i in enumerate(step.sampled):
            measured[step.request_ids[i]].append(step.measured.entropies[row])
    assert sorted(measured.values()) == sorted(o.entropies for o in outs)


def test_logits_reach_only_observers_that_ask(make_llm):
    llm = make_llm()
    plain, with_logits = [], []
    llm.engine.add_observer(plain.append)
    with llm.engine.observing(with_logits.append, logits=True):
        llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3))
    llm.engine.remove_observer(plain.append)
    assert [s.logits.shape[0] for s in with_logits] == [1, 1, 1]
    assert with_logits[-1].logits.argmax().item() == with_logits[-1].measured.token_ids[0]
    llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3))
    assert len(plain) == 3  # removed: the last generation went unobserved


def test_an_observer_of_a_pruned_step_sees_the_blocks_read_and_the_budgets(make_llm):
    config = PruningConfig(
        scorer="bound", min_context=0, min_blocks=4, recent_blocks=1, dense_layers=1
    )
    llm = make_llm(control=ControlConfig(pruning=config))
    steps = []
    prompt = " ".join(PROMPTS) * 6
    with llm.engine.observing(steps.append):
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    decode = steps[-1]
    assert decode.num_decode == 1 and len(decode.decisions.block_budgets) == 1
    kept, total = sum(map(sum, decode.attention.kept)), sum(map(sum, decode.attention.total))
    assert kept < total


def test_an_observer_that_fails_is_logged_and_the_step_keeps_its_outputs(make_llm, caplog):
    llm = make_llm()

    def broken(step) -> None:
        raise RuntimeError("a broken benchmark")

    params = SamplingParams(temperature=0, max_tokens=3)
    expected = llm.generate(PROMPTS[0], params)[0].token_ids
    with llm.engine.observing(broken):
        assert llm.generate(PROMPTS[0], params)[0].token_ids == expected
    assert "step observer" in caplog.text and "a broken benchmark" in caplog.text
    assert_pool_free(llm)
