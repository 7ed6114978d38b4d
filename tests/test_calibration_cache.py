"""calibration="auto": a model file's temperature is fitted once, cached by the file's
identity, and read by every later engine over that file (tiny random-weight model)."""

from __future__ import annotations

import pytest

from etinfer import LLM
from etinfer import calibrate as calibrate_module
from etinfer.control.calibration import Calibration


def test_auto_calibration_is_fitted_once_and_cached_per_model_file(
    tiny_model, tmp_path, monkeypatch
):
    monkeypatch.setenv(calibrate_module.CACHE_ENV, str(tmp_path))
    fits = []
    fit = calibrate_module.calibrate
    monkeypatch.setattr(
        calibrate_module,
        "calibrate",
        lambda engine, *a, **k: fits.append(engine) or fit(engine, 512, 512, 128),
    )
    first = LLM(tiny_model, quantization="none", calibration="auto")
    (cached,) = (tmp_path / "calibration").glob("*.json")
    assert first.engine.config.calibration == str(cached)
    assert first.engine.calibration.temperature == Calibration.load(cached).temperature
    assert first.engine.calibration.vocab_size == tiny_model.config.vocab_size
    # The fit ran on a plain engine: no control layer, no calibration of its own.
    assert fits[0].config.calibration is None and fits[0].pruning is None
    again = LLM(tiny_model, quantization="none", calibration="auto")
    assert len(fits) == 1 and again.engine.config.calibration == str(cached)
    # Read otherwise (another weight format), the logits differ: a calibration of its own.
    LLM(tiny_model, quantization="none", dtype="bfloat16", calibration="auto")
    assert len(fits) == 2 and len(list((tmp_path / "calibration").glob("*.json"))) == 2


def test_an_engine_built_directly_says_where_auto_is_resolved(tiny_model):
    from etinfer.config import EngineConfig
    from etinfer.engine.llm_engine import LLMEngine

    config = EngineConfig(model=str(tiny_model.path), calibration="auto")
    with pytest.raises(ValueError, match="resolved where engines are built"):
        LLMEngine(config, tiny_model)
