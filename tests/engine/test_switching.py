"""Entropy Adaptive Decoding on the real model: the small model (the first N layers and a fitted
exit) writes tokens while the rolling entropy is low, the large model takes over (catching up on
the small model's tokens) when it rises."""

import pytest

from etinfer import ControlConfig, SamplingParams, SpeculativeConfig
from etinfer.control.record import TARGET_MODEL
from etinfer.control.switching import (
    EXIT_MODEL,
    SwitchingConfig,
    SwitchState,
    next_switch_state,
)
from tests.conftest import PROMPTS, assert_pool_free

GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
EXIT = "self:22"


def switching(threshold: float, hysteresis: float = 0.25, **kwargs) -> ControlConfig:
    config = SwitchingConfig(threshold=threshold, hysteresis=hysteresis, **kwargs)
    return ControlConfig(switching=config)


def large_model_agreement(engine, outs) -> float:
    """Share of the large model's tokens that are its greedy choice given every token before
    them (the small model's included), by scoring each whole text in one prefill."""
    agree = total = 0
    for out in outs:
        ids = list(out.prompt_token_ids) + out.token_ids
        predicted = engine.score(ids).argmax(-1).tolist()
        start = len(out.prompt_token_ids)
        for i, model in enumerate(out.token_models):
            if model == TARGET_MODEL:
                total += 1
                agree += predicted[start + i - 1] == out.token_ids[i]
    return agree / total


def test_the_law_hands_over_on_rolling_entropy_with_hysteresis_and_minimum_stretch():
    config = SwitchingConfig(window=2, threshold=1.0, hysteresis=0.5, min_stretch=2)
    small = SwitchState(EXIT_MODEL, 5)
    assert next_switch_state(config, small, [0.2, 3.0]) == SwitchState(TARGET_MODEL, 0)
    assert next_switch_state(config, small, [3.0, 0.2, 0.9]).model == EXIT_MODEL  # mean 0.55
    large = SwitchState(TARGET_MODEL, 5)
    assert next_switch_state(config, large, [0.7]).model == TARGET_MODEL  # above 1.0 - 0.5
    assert next_switch_state(config, large, [0.4]) == SwitchState(EXIT_MODEL, 0)
    assert next_switch_state(config, SwitchState(TARGET_MODEL, 0), [0.0]).stretch == 1  # too soon


def test_a_threshold_nothing_falls_below_keeps_the_large_model_exactly(make_llm):
    plain = make_llm()
    # No entropy falls below 0, so the small model never writes: its adapter is not fitted.
    control = switching(threshold=0.0, hysteresis=0.0, exit_adapter=False)
    never = make_llm(draft_model=EXIT, control=control)
    outs = never.generate(PROMPTS[:3], GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(PROMPTS[:3], GREEDY)]
    assert all(o.large_model_share == 1.0 for o in outs)


def test_the_small_model_writes_and_the_large_one_catches_up_correctly(make_llm):
    """Every token the large model wrote is its greedy choice given all tokens before it, the
    small model's included: its catch-up computed their keys and values right (checked against
    scoring the whole text in one prefill, float weights)."""
    llm = make_llm(quantization="none", draft_model=EXIT, control=switching(threshold=1.0))
    engine = llm.engine
    outs = llm.generate(PROMPTS[:4], GREEDY)
    models = [m for o in outs for m in o.token_models]
    assert 0.2 < models.count(TARGET_MODEL) / len(models) < 0.95  # both models wrote
    assert large_model_agreement(engine, outs) > 0.97
    assert_pool_free(llm)


def test_small_model_stretches_never_reach_the_prefix_cache(make_llm):
    llm = make_llm(draft_model=EXIT, control=switching(threshold=1.5))
    engine = llm.engine
    published = []

    def watch(step):
        for seq in engine.scheduler.running:
            published.append(seq.num_registered_blocks * engine.block_size - seq.num_full_tokens)

    with engine.observing(watch):
        outs = llm.generate(PROMPTS[3:7], GREEDY)
    assert any(o.large_model_share < 1 for o in outs)
    assert max(published) <= 0
    assert_pool_free(llm)


def test_streamed_deltas_carry_which_model_wrote_each_token(make_llm):
    llm = make_llm(draft_model=EXIT, control=switching(threshold=1.5))
    whole = llm.generate([PROMPTS[1]], GREEDY)[0]
    deltas = list(llm.stream(PROMPTS[1], GREEDY, delta=True))
    assert [m for d in deltas for m in d.token_models] == whole.token_models
    assert len(whole.token_models) == len(whole.token_ids)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"control": ControlConfig(switching=True)}, "switching needs draft_model='self:N'"),
        (
            {"control": ControlConfig(switching=True), "draft_model": "small.gguf"},
            "switching needs draft_model='self:N'",
        ),
        (
            {
                "control": ControlConfig(switching=True),
                "draft_model": EXIT,
                "speculative": SpeculativeConfig(),
            },
            "cannot be combined",
        ),
        ({"control": ControlConfig(switching=True), "draft_model": "self:40"}, r"\[1, 29\]"),
    ],
)
def test_bad_switching_settings_name_the_field(make_llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_llm(**kwargs)


@pytest.mark.parametrize(
    ("field", "value"),
    [("window", 0), ("threshold", -1.0), ("hysteresis", 2.0), ("min_stretch", 0)],
)
def test_switching_fields_are_validated(field, value):
    with pytest.raises(ValueError, match=f"switching.{field}"):
        SwitchingConfig(**{field: value})


def test_preempted_small_model_stretches_recompute_every_layer(make_llm):
    """A recompute after preemption, chunked to a token at a time, must fill every layer: stale
    memory (NaN here) in the layers above the exit must never be read (it was, once)."""
    # The bare exit: its tight pool is a fit of its own (a 2K-token prefill), and what the small
    # model writes does not decide whether the catch-up fills every layer.
    llm = make_llm(
        quantization="none",
        draft_model=EXIT,
        control=switching(threshold=1.5, exit_adapter=False),
        max_num_seqs=8,
        num_kvcache_blocks=12,
        max_num_batched_tokens=6,
    )
    engine = llm.engine
    engine.runner.cache.keys.fill_(float("nan"))
    engine.runner.cache.values.fill_(float("nan"))
    prompts = [PROMPTS[4], PROMPTS[0], PROMPTS[2], PROMPTS[5], PROMPTS[7]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    assert sum(o.num_preemptions for o in outs) > 0
    assert any(o.large_model_share < 1 for o in outs)  # the small model wrote
    assert large_model_agreement(engine, outs) > 0.97
    assert_pool_free(llm)
