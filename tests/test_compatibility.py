"""The compatibility table walked pair by pair: a configuration (and, for a model's features, an
engine over the tiny random model) is refused exactly where the table says, naming both sides,
and the README shows the table as it is."""

import itertools
import pathlib
import weakref
from dataclasses import replace

import pytest

from etinfer import LLM, ControlConfig, EngineConfig, SpeculativeConfig
from etinfer.compatibility import (
    DEVICE,
    FEATURES,
    KV_DTYPE,
    LAYER,
    MODEL,
    NOTES,
    REFUSED,
    Feature,
    refusal,
    render_markdown,
    switched_on,
)
from etinfer.control.shaping import STEP_SHAPERS, PlainShaper

STEP_SHAPERS.register("kept-plain")(PlainShaper)  # a step shaper other than "plain"

# What switches each configurable feature on (cuda_graphs is on by default: off in BASE).
SWITCH_ON = {
    "sampling": {"control": {"sampling": True}},
    "pruning": {"control": {"pruning": True}},
    "scheduling": {"control": {"scheduling": True}},
    "sparse prefill": {"control": {"sparse_prefill": True}},
    "KV compression": {"control": {"kv_compression": True}},
    "switching": {"control": {"switching": True}, "draft_model": "self:1"},
    "ngram": {"speculative": SpeculativeConfig(method="ngram")},
    "draft": {"speculative": SpeculativeConfig(method="draft"), "draft_model": "self:1"},
    "own step shaper": {"step_shaper": "kept-plain"},
    "jump-forward": {"jump_forward": True},
    "batch invariant": {"batch_invariant": True},
    "CUDA graphs": {"cuda_graphs": True},
}
BASE = {"cuda_graphs": False}
# The tiny model with each feature a model may bring.
MODEL_CHANGES = {
    "soft caps": {"attention_softcap": 50.0},
    "window on every layer": {"sliding_window": 256},
    "mixed windows": {"sliding_window": 64, "layer_windows": (64, None)},
}
LAYERS = [f for f in FEATURES if f.group == LAYER]
README = pathlib.Path(__file__).parents[1] / "README.md"


def settings(*features: Feature, **extra) -> dict:
    """EngineConfig's keyword arguments switching ``features`` on, and nothing else."""
    control, kwargs = {}, dict(BASE)
    for feature in features:
        for key, value in SWITCH_ON[feature.name].items():
            if key == "control":
                control |= value
            else:
                kwargs[key] = value
    return kwargs | extra | {"control": ControlConfig(**control)}


def assert_refused_as_the_table_says(build, a: Feature, b: Feature) -> None:
    pair = refusal(a, b)
    if pair is None:
        build()
        return
    with pytest.raises(ValueError) as refused:
        build()
    message = str(refused.value)
    assert a.setting in message and b.setting in message and pair.reason in message


def test_every_configurable_feature_has_its_settings_and_every_model_feature_its_model():
    assert set(SWITCH_ON) == {f.name for f in LAYERS}
    assert set(MODEL_CHANGES) == {f.name for f in FEATURES if f.group == MODEL}
    for feature in LAYERS:
        on = switched_on(EngineConfig(**settings(feature)))
        assert [f for f in on if f.group == LAYER] == [feature]


def test_each_pair_is_listed_once_and_shown_in_the_table():
    pairs = [{p.first, p.second} for p in REFUSED + NOTES]
    assert all(len(pair) == 2 for pair in pairs)
    assert len({frozenset(pair) for pair in pairs}) == len(pairs)
    for pair in REFUSED + NOTES:
        assert pair.first.choice is None or pair.first.choice != pair.second.choice
        assert {pair.first.group, pair.second.group} & {LAYER, DEVICE}  # a column of the table


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (a, b)
        for a, b in itertools.combinations(LAYERS, 2)
        if a.choice is None or a.choice != b.choice
    ],
    ids=lambda f: f.name,
)
def test_every_pair_of_switches_is_refused_exactly_where_the_table_says(a, b):
    assert_refused_as_the_table_says(lambda: EngineConfig(**settings(a, b, device="cpu")), a, b)


@pytest.mark.parametrize("other", [f for f in FEATURES if f.group in (DEVICE, KV_DTYPE)])
@pytest.mark.parametrize("feature", LAYERS, ids=lambda f: f.name)
def test_every_switch_with_each_device_and_kv_dtype_as_the_table_says(feature, other):
    setting = {"device": other.name} if other.group == DEVICE else {"kv_cache_dtype": other.name}
    build = lambda: EngineConfig(**settings(feature, **setting))  # noqa: E731
    assert_refused_as_the_table_says(build, feature, other)
    if refusal(feature, other) is None:
        assert other in switched_on(build())


@pytest.mark.parametrize("model_feature", [f for f in FEATURES if f.group == MODEL])
@pytest.mark.parametrize("feature", LAYERS, ids=lambda f: f.name)
def test_every_switch_with_each_model_feature_builds_an_engine_as_the_table_says(
    tiny_model, feature, model_feature
):
    config = replace(tiny_model.config, **MODEL_CHANGES[model_feature.name])
    assert model_feature.on(config)
    model = replace(tiny_model, config=config, prepared=weakref.WeakValueDictionary())
    kwargs = settings(feature, max_model_len=1024, num_kvcache_blocks=64)
    EngineConfig(**kwargs)  # the config alone does not know the model
    assert_refused_as_the_table_says(lambda: LLM(model, **kwargs), feature, model_feature)


def test_the_readme_shows_the_table_as_it_is():
    assert render_markdown() in README.read_text(), (
        "README.md's compatibility table is stale: paste `python -m etinfer.compatibility`"
    )
