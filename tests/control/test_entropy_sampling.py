"""Entropy-stabilised sampling on the real model (issue: the paper's micro scale)."""

import math
import statistics
from itertools import pairwise

import pytest
import torch

from etinfer import SamplingParams
from etinfer.calibrate import calibrate
from etinfer.control.calibration import Calibration
from tests.conftest import ON_CUDA, PROMPTS, assert_pool_free

TARGET = 2.0
TOKENS = 96


@pytest.fixture(scope="module")
def llm(make_llm):
    """An engine of this module's own: its statistical bounds then do not move with what other
    modules ran on a shared engine before (a prefix cache they warmed computes the prompts in
    other chunks, which shifts every later sample a little)."""
    return make_llm(max_num_seqs=16)


@pytest.fixture(scope="module")
def chats(llm):
    return [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]


def run(llm, prompts, **params):
    defaults = dict(max_tokens=TOKENS, ignore_eos=True, seed=3, temperature=1.0)
    return llm.generate(prompts, SamplingParams(**(defaults | params)))


def tracking(outs):
    h = [x for o in outs for x in o.tempered_entropies]
    return statistics.fmean(abs(x - TARGET) for x in h), statistics.pstdev(h)


@pytest.fixture(scope="module")
def fixed(llm, chats):
    return tracking(run(llm, chats))


def test_feedback_holds_entropy_near_the_target(llm, chats, fixed):
    outs = run(llm, chats, entropy_target=TARGET)
    mae, sd = tracking(outs)
    assert mae <= 0.6 * fixed[0], (mae, fixed)
    assert sd <= 0.8 * fixed[1], (sd, fixed)
    temperatures = [t for o in outs for t in o.temperatures]
    assert min(temperatures) >= 0.1 and max(temperatures) <= 1.5
    assert len(set(temperatures)) > 10  # it really moves
    assert_pool_free(llm)


@pytest.mark.parametrize("weights", ["float", "default"])
def test_exact_control_is_within_a_tenth_of_a_nat(llm, float_llm, chats, weights):
    # With the default ceiling of 1.5, steps where even T = 1.5 stays under 2 nats pin T there;
    # every other step hits the target.
    llm = float_llm if weights == "float" else llm
    outs = run(llm, chats, entropy_target=TARGET, entropy_control="exact")
    for o in outs:
        for h, t in zip(o.tempered_entropies, o.temperatures, strict=True):
            assert 0.1 - 1e-6 <= t <= 1.5 + 1e-6
            if t < 1.5 - 1e-3:
                assert h == pytest.approx(TARGET, abs=0.01)
    # With room to reach it, the whole trajectory is within a tenth of a nat.
    roomy = run(llm, chats, entropy_target=TARGET, entropy_control="exact", temperature_max=4.0)
    assert tracking(roomy)[0] <= 0.1


def test_lagged_law_corrects_the_mean(llm, chats, fixed):
    outs = run(llm, chats, entropy_target=TARGET, entropy_control="lagged")
    h = [x for o in outs for x in o.tempered_entropies]
    assert abs(statistics.fmean(h) - TARGET) < 0.5
    assert tracking(outs)[0] < fixed[0]


@pytest.mark.parametrize("control", ["feedback", "lagged", "exact"])
def test_a_fixed_seed_reproduces_tokens_and_temperatures(llm, chats, control):
    a = run(llm, chats[:3], entropy_target=TARGET, entropy_control=control, max_tokens=24)
    b = run(llm, chats[:3], entropy_target=TARGET, entropy_control=control, max_tokens=24)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.temperatures for o in a] == [o.temperatures for o in b]


@pytest.mark.parametrize(("estimator", "bound"), [("topk", 0.7 if ON_CUDA else 0.6), ("tail", 0.6)])
def test_top_k_estimators_drive_the_controller_too(llm, chats, fixed, estimator, bound):
    # Two seeds' samples: with one, the top-k estimator's ratio ranged 0.51-0.60 over seeds on
    # the CPU (its truncated entropy tracks less tightly than the tail-corrected one's
    # 0.31-0.39), and the two seeds gave 0.64 on an H200, whose other roundings sample other
    # tokens: each bound sits above its estimator's spread there, below the fixed temperature's 1.
    params = dict(entropy_target=TARGET, entropy_estimator=estimator, entropy_topk=64)
    outs = [o for seed in (3, 4) for o in run(llm, chats, seed=seed, **params)]
    assert tracking(outs)[0] <= bound * fixed[0]


def test_edt_follows_its_formula_within_the_temperature_bounds(llm, chats):
    outs = run(llm, chats[:2], edt_theta=1.0, edt_base=0.8, temperature=0.9, max_tokens=24)
    for o in outs:
        for h, t in zip(o.entropies, o.temperatures, strict=True):
            edt = 0.9 * 0.8 ** (1.0 / max(h, 1e-6))
            assert t == pytest.approx(min(max(edt, 0.1), 1.5), rel=1e-4)


def test_mirostat_keeps_temperature_and_bounds_surprise(llm, chats):
    outs = run(llm, chats, mirostat_tau=3.0, mirostat_eta=0.1, max_tokens=64)
    for o in outs:
        assert o.temperatures == pytest.approx([1.0] * 64)
        assert len(o.token_ids) == 64


def test_profile_accumulates_irreversible_entropy_flow(llm, chats):
    out = run(llm, chats[:1], max_tokens=40)[0]
    expected = sum(max(0.0, a - b) for a, b in pairwise(out.entropies))
    assert out.entropic_time == pytest.approx(expected, rel=1e-6)
    assert out.collapse_rate == pytest.approx(expected / 40)


def test_calibration_fits_a_temperature_and_rescales_the_signal(llm, make_llm, chats, tmp_path):
    result = calibrate(llm.engine, fit_tokens=512, eval_tokens=512, window=128)
    assert 0.5 < result.temperature < 2.0
    assert result.nll_after <= result.nll_before + 1e-3  # held-out text: no worse
    assert 0 <= result.ece_after < 0.2 and 0 <= result.ece_before < 0.2
    path = tmp_path / "calibration.json"
    forced = Calibration(**{**vars(result), "temperature": 0.5})  # a strong one, to see it act
    forced.save(path)
    calibrated = make_llm(calibration=str(path))
    # A fresh plain engine, as the calibrated one is: the module's engine has this prompt's
    # blocks cached, and a chunk after a cached prefix is computed to float rounding of a whole
    # prompt, not bit for bit (BENCHMARKS.md), which float32 activations carry to the entropies.
    plain = run(make_llm(), chats[:1], temperature=0, max_tokens=30)[0]
    scaled = run(calibrated, chats[:1], temperature=0, max_tokens=30)[0]
    assert scaled.token_ids == plain.token_ids  # calibration changes the signal, not the output
    assert scaled.entropies == pytest.approx(plain.entropies, abs=1e-4)
    assert scaled.entropic_time != pytest.approx(plain.entropic_time, rel=0.05)
    with pytest.raises(ValueError, match="not a calibration file"):
        make_llm(calibration=str(tmp_path / "missing.json"))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("entropy_target", 0.0, r"entropy_target must be in \(0, inf\]"),
        ("entropy_control", "pid", "entropy_control must be one of 'feedback', 'lagged', 'exact'"),
        ("entropy_gain", -1.0, "entropy_gain"),
        ("temperature_max", 0.05, r"temperature_max must be in \[0.1, inf\]"),
        ("entropy_estimator", "guess", "entropy_estimator must be one of"),
        ("entropy_topk", 0, "entropy_topk"),
    ],
)
def test_controller_fields_are_validated(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**({"entropy_target": 2.0} | {field: value}))


def test_controllers_exclude_each_other_and_greedy():
    with pytest.raises(
        ValueError, match="entropy_target and mirostat_tau choose different samplers"
    ):
        SamplingParams(entropy_target=2.0, mirostat_tau=5.0)
    with pytest.raises(ValueError, match="edt_theta needs temperature > 0"):
        SamplingParams(edt_theta=1.0, temperature=0)


transformers = pytest.importorskip("transformers")


def test_processor_tracks_the_target_inside_transformers_generate(llm, hf_reference, chats):
    from etinfer.integrations.transformers import EntropyTemperatureProcessor

    processor = EntropyTemperatureProcessor(entropy_target=TARGET)
    ids = torch.tensor([chats[0]])
    torch.manual_seed(0)
    with torch.no_grad():
        hf_reference.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=64,
            min_new_tokens=64,
            logits_processor=[processor],
            pad_token_id=0,
        )
    h = processor.tempered_entropies[0]
    assert len(h) == 64
    assert statistics.fmean(abs(x - TARGET) for x in h) < 0.8
    assert all(0.1 - 1e-6 <= t <= 1.5 + 1e-6 for t in processor.temperatures[0])


@pytest.mark.parametrize("control", ["feedback", "lagged", "exact"])
def test_processor_applies_the_engines_controller(float_llm, hf_reference, chats, control):
    """Teacher-forced on our engine's tokens, transformers' logits through the processor give
    the temperatures our engine used (on float weights, where the logits are transformers')."""
    from etinfer.integrations.transformers import EntropyTemperatureProcessor

    params = dict(entropy_target=TARGET, entropy_control=control, max_tokens=32)
    out = run(float_llm, chats[:1], **params)[0]
    sequence = out.prompt_token_ids + out.token_ids
    with torch.no_grad():
        logits = hf_reference(torch.tensor([sequence])).logits[0]
    processor = EntropyTemperatureProcessor(entropy_target=TARGET, entropy_control=control)
    start = len(out.prompt_token_ids)
    for step in range(len(out.token_ids)):
        position = start + step
        processor(torch.tensor([sequence[:position]]), logits[position - 1 : position])
    assert processor.temperatures[0] == pytest.approx(out.temperatures, rel=2e-3)
    assert math.isclose(
        statistics.fmean(processor.tempered_entropies[0]),
        statistics.fmean(out.tempered_entropies),
        rel_tol=1e-2,
    )
