"""Post-hoc temperature calibration (paper section 5; Guo et al., ICML 2017).

One scalar ``T_cal`` rescales the model's logits so that its next-token probabilities match how
often it is right on held-out text: ``T_cal`` minimises the mean negative log-likelihood of
``softmax(z / T_cal)``. The NLL is convex in ``b = 1 / T`` (its second derivative is the variance
of the logits under ``p_b``), so Newton's method on ``b`` finds it in a few passes.
Expected calibration error (ECE) uses 15 equal-width bins of the top probability.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from etinfer.control.stress import StressConfig


def nll(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> float:
    """Mean negative log-likelihood (nats per token) of ``targets`` under ``softmax(z / T)``."""
    scaled = logits / temperature
    picked = scaled.gather(1, targets[:, None])[:, 0]
    return (scaled.logsumexp(-1) - picked).mean().item()


# Logits a Newton step takes at once on the CPU: a step's passes (scale, softmax, two weighted
# sums) and their few temporaries then stay in the caches, where over the whole matrix each pass
# went to memory: 1,024 x 49K logits took 3.8 s to fit on two cores, 0.5 s in blocks of 1 MiB.
# A row a thread at least, so that the row-wise softmax and sums keep every thread busy.
_CPU_BLOCK_BYTES = 1 << 20


def fit_temperature(logits: torch.Tensor, targets: torch.Tensor, iterations: int = 25) -> float:
    """The temperature minimising :func:`nll`, by safeguarded Newton steps on ``b = 1 / T``."""
    picked = logits.gather(1, targets[:, None])[:, 0]
    if logits.device.type == "cpu":
        row_bytes = logits.shape[1] * logits.element_size()
        rows = max(torch.get_num_threads(), _CPU_BLOCK_BYTES // row_bytes)
    else:
        rows = max(1, len(logits))
    means, spreads = torch.empty_like(picked), torch.empty_like(picked)
    beta = 1.0
    for _ in range(iterations):
        for start in range(0, len(logits), rows):
            block = logits[start : start + rows]
            p = (block * beta).softmax(-1)
            mean = (p * block).sum(-1)
            means[start : start + rows] = mean
            spreads[start : start + rows] = (p * (block - mean[:, None]).square()).sum(-1)
        gradient = (means - picked).mean()
        curvature = spreads.mean()  # the variance of the logits under p_b
        step = (gradient / curvature.clamp(min=1e-12)).item()
        beta = max(beta - step, beta / 2)  # keep b positive: never more than halve it
        if abs(step) < 1e-7 * beta:
            break
    return 1.0 / beta


def expected_calibration_error(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, bins: int = 15
) -> float:
    """``sum_b (n_b / N) |accuracy_b - confidence_b|`` over equal-width bins of confidence."""
    probs = (logits / temperature).softmax(-1)
    confidence, predicted = probs.max(-1)
    correct = (predicted == targets).float()
    which = (confidence * bins).long().clamp(max=bins - 1)
    counts = torch.bincount(which, minlength=bins).float()
    gap = torch.bincount(which, weights=correct - confidence, minlength=bins).abs()
    return (gap.sum() / counts.sum()).item()


@dataclass
class Calibration:
    """What ``etinfer calibrate`` writes and an engine's ``calibration=`` option reads."""

    temperature: float
    model: str
    vocab_size: int
    corpus: str
    fit_tokens: int
    eval_tokens: int
    nll_before: float
    nll_after: float
    ece_before: float
    ece_after: float
    # The stress the logits were fitted under (`etinfer calibrate --stress`): an engine must
    # read them with the same scale. 1 for the model itself (and for files without the field).
    logit_scale: float = 1.0

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        if str(path) == "auto":
            raise ValueError(
                "calibration='auto' is resolved where engines are built (LLM, etinfer serve, "
                "etinfer.calibrate.build_engine), not by LLMEngine itself"
            )
        try:
            data = json.loads(Path(path).read_text())
            calibration = cls(**data)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(
                f"{path}: not a calibration file written by `etinfer calibrate` ({e})"
            ) from e
        if not calibration.temperature > 0:
            raise ValueError(
                f"{path}: calibration temperature must be > 0, got {calibration.temperature}"
            )
        return calibration

    @classmethod
    def for_model(
        cls, path: str | Path, vocab_size: int, stress: StressConfig | None = None
    ) -> Calibration:
        """``load``, checked against the vocabulary of the model it is to rescale and the logit
        scale of the engine's stress."""
        calibration = cls.load(path)
        logit_scale = 1.0 if stress is None else stress.logit_scale
        if calibration.vocab_size != vocab_size:
            raise ValueError(
                f"{path}: calibrated for a vocabulary of {calibration.vocab_size} tokens, but "
                f"this model has {vocab_size}"
            )
        if calibration.logit_scale != logit_scale:
            raise ValueError(
                f"{path}: fitted on logits scaled by {calibration.logit_scale:g} "
                f"(etinfer calibrate --stress), but this engine's stress.logit_scale is "
                f"{logit_scale:g}"
            )
        return calibration
