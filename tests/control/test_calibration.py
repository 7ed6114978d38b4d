"""The post-hoc temperature fit (control/calibration.py) on logits whose answer is known."""

import pytest
import torch

from etinfer.control import calibration
from etinfer.control.calibration import fit_temperature, nll


def test_the_fit_recovers_the_temperature_the_targets_were_drawn_at(monkeypatch):
    """Targets drawn from softmax(z / 1.7): the fit finds 1.7, and its NLL is the lowest around
    it. 603 rows of a 49K vocabulary take many of the fit's cache-sized blocks and a partial
    last one, and give what one pass over the whole matrix (as on a GPU) gives."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(603, 49152, generator=generator) * 4
    targets = torch.multinomial((logits / 1.7).softmax(-1), 1, generator=generator)[:, 0]
    temperature = fit_temperature(logits, targets)
    assert abs(temperature - 1.7) < 0.1
    best = nll(logits, targets, temperature)
    assert best < nll(logits, targets, temperature * 0.98)
    assert best < nll(logits, targets, temperature * 1.02)
    monkeypatch.setattr(calibration, "_CPU_BLOCK_BYTES", logits.numel() * 4)
    assert fit_temperature(logits, targets) == pytest.approx(temperature, rel=1e-6)
