"""The stress option (robustness studies): validated, off by default, and when on it moves the
entropy the control layers read but never what a request samples."""

from __future__ import annotations

import pytest

from etinfer import ControlConfig, EngineConfig, SamplingParams, StressConfig
from etinfer.calibrate import calibrate
from etinfer.cli import build_parser
from etinfer.options import engine_flags, engine_kwargs

PROMPT = "The three primary colors are"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"logit_scale": 0.0}, "logit_scale"),
        ({"logit_scale": 25.0}, "logit_scale"),
        ({"entropy_bias": 11.0}, "entropy_bias"),
    ],
)
def test_settings_out_of_range_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StressConfig(**kwargs)


def test_it_is_off_by_default_and_has_a_command_line_form():
    assert EngineConfig().stress is None
    with pytest.raises(ValueError, match="stress"):
        EngineConfig(stress=1.5)
    args = build_parser().parse_args(["generate", "x", "--stress", "1.5:-0.25"])
    assert engine_kwargs(args)["stress"] == StressConfig(1.5, -0.25)
    assert "1.5:-0.25" in engine_flags(args)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "x", "--stress", "big"])


def measured(llm, **sampling) -> tuple[list[int], list[float], list[float]]:
    """Tokens, the model's entropies and the predictive entropies the laws read, per token."""
    steps = []
    params = SamplingParams(max_tokens=12, **sampling)
    with llm.engine.observing(steps.append):
        out = llm.generate([PROMPT], params)[0]
    predictive = [h for s in steps if s.measured for h in s.measured.predictive_entropy]
    return out.token_ids, out.entropies, predictive


def test_a_neutral_stress_changes_nothing(make_llm):
    plain = measured(make_llm(), temperature=0)
    neutral = measured(make_llm(stress=StressConfig()), temperature=0)
    assert neutral == plain


def test_a_stress_moves_the_signal_not_the_tokens(make_llm):
    tokens, entropies, predictive = measured(make_llm(), temperature=0)
    sharp = measured(make_llm(stress=StressConfig(logit_scale=2.0)), temperature=0)
    biased = measured(make_llm(stress=StressConfig(entropy_bias=0.5)), temperature=0)
    # Greedy tokens and the model's own entropies are untouched...
    assert sharp[0] == biased[0] == tokens and sharp[1] == biased[1] == entropies
    # ...while the control signal reads over-confident, or shifted by the bias.
    assert all(s < p for s, p in zip(sharp[2], predictive, strict=True) if p > 0.05)
    assert biased[2] == pytest.approx([p + 0.5 for p in predictive], abs=1e-4)


def test_calibrate_fits_the_stressed_logits(llm, make_llm, tmp_path):
    """`etinfer calibrate --stress 2` fits on twice the logits: the refitted temperature doubles,
    which undoes the scale exactly."""
    plain = calibrate(llm.engine, fit_tokens=256, eval_tokens=256, window=128)
    sharp = calibrate(make_llm(stress=StressConfig(logit_scale=2.0)).engine, 256, 256, window=128)
    assert sharp.temperature == pytest.approx(2 * plain.temperature, rel=1e-3)
    assert sharp.ece_before > plain.ece_before  # the stressed model is miscalibrated...
    assert sharp.nll_after == pytest.approx(plain.nll_after, abs=1e-4)  # ...until refitted
    # The file says which stress it was fitted under, and an engine must read it under the same.
    path = tmp_path / "stressed.json"
    sharp.save(path)
    with pytest.raises(ValueError, match="logit_scale is 1"):
        make_llm(calibration=str(path))
    make_llm(calibration=str(path), stress=StressConfig(logit_scale=2.0), num_kvcache_blocks=8)


def test_switching_reads_the_stressed_signal(make_llm):
    params = SamplingParams(temperature=0, max_tokens=16)

    def large_share(bias: float) -> float:
        llm = make_llm(
            draft_model="self:22",
            control=ControlConfig(switching=True),
            stress=StressConfig(entropy_bias=bias),
        )
        return llm.generate([PROMPT], params)[0].large_model_share

    # Read as certain, the small model takes over after its first stretch; read as uncertain,
    # the large model keeps every token.
    assert large_share(-5.0) < 0.5
    assert large_share(5.0) == 1.0
