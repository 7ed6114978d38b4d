"""The Appendix A check's mechanics on small random logits (the real run is `bench iss`)."""

from __future__ import annotations

import torch

from etinfer.sampling_params import SamplingParams
from studies.stress.iss_check import readings, settle, verdict


def rows() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(64, 200, generator=generator) * 2.5).log_softmax(-1)


def test_without_error_the_law_settles_on_the_exact_temperature():
    result = settle(rows(), readings("bias", 0.0, 64), SamplingParams(entropy_target=2.0), 400)
    reachable = result["reachable"]
    assert reachable.sum() > 32
    assert result["settled"][reachable].max() < 1e-3


def test_a_small_constant_bias_settles_at_eps_over_the_varentropy():
    # First order: H(u* + e) = H* - eps gives e = -eps / V(u*).
    result = settle(rows(), readings("bias", 0.01, 64), SamplingParams(entropy_target=2.0), 400)
    report = verdict(result)["in the appendix's regime"]
    assert report["rows"] > 16
    assert 0.97 < report["ratio_median"] < 1.03
