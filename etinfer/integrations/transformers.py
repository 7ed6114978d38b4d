"""Entropy-stabilised sampling inside Hugging Face transformers' ``generate``.

    from etinfer.integrations.transformers import EntropyTemperatureProcessor

    processor = EntropyTemperatureProcessor(entropy_target=2.0)
    model.generate(ids, do_sample=True, temperature=1.0, top_k=0,
                   logits_processor=[processor])

The processor divides each row's logits by the temperature etinfer's controller picks, with the
engine's own code (``Sampler.temperatures`` and ``Sampler.advance_states``), so a request behaves
the same in both. Custom processors run before transformers' sampling warpers: pass
``temperature=1.0, top_k=0`` so only this temperature acts. ``temperatures`` and
``tempered_entropies`` keep one list per row of what was applied, for inspection.
"""

from __future__ import annotations

import torch

from etinfer.control.entropy import softmax_entropy
from etinfer.control.temperature import temperature_law
from etinfer.engine.sampling.sampler import Sampler
from etinfer.engine.sampling.sampling_batch import SamplingBatch
from etinfer.sampling_params import SamplingParams

try:
    from transformers import LogitsProcessor
except ImportError as e:  # pragma: no cover - the integration needs transformers by definition
    raise ImportError("etinfer.integrations.transformers needs `pip install transformers`") from e


class EntropyTemperatureProcessor(LogitsProcessor):
    def __init__(self, entropy_target: float, temperature: float = 1.0, **controller) -> None:
        """``controller`` takes the entropy fields of ``SamplingParams``: ``entropy_control``
        ("feedback", "lagged" or "exact"), ``entropy_gain``, ``temperature_min``,
        ``temperature_max``, ``temperature_rate_limit``, ``entropy_estimator``,
        ``entropy_topk``. They are validated the same way."""
        self.params = SamplingParams(
            temperature=temperature, entropy_target=entropy_target, **controller
        )
        self._states: list[float] | None = None
        self._length = 0
        self.temperatures: list[list[float]] = []
        self.tempered_entropies: list[list[float]] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows = scores.shape[0]
        if self._states is None or input_ids.shape[1] <= self._length or len(self._states) != rows:
            self._reset(rows)  # a new generate() call
        self._length = input_ids.shape[1]
        logits = scores.float()
        batch = SamplingBatch.build(
            [self.params] * rows, self._states, [None] * rows, logits.shape[-1], logits.device
        )
        state = torch.full((rows,), torch.nan, device=logits.device)
        # Processors that ran before this one may have put -inf into the scores.
        model_entropy = softmax_entropy(logits, masked=True).entropy
        temperature = Sampler.temperatures(logits, model_entropy, batch, state)
        scaled = logits / temperature[:, None]
        sampled_from = softmax_entropy(scaled, masked=True)
        Sampler.advance_states(scaled, sampled_from, None, temperature, batch, state)
        self._states = state.tolist()
        applied = zip(temperature.tolist(), sampled_from.entropy.tolist(), strict=True)
        for row, (t, h) in enumerate(applied):
            self.temperatures[row].append(t)
            self.tempered_entropies[row].append(h)
        return scaled.to(scores.dtype)

    def _reset(self, rows: int) -> None:
        self._states = [temperature_law(self.params).initial_state(self.params)] * rows
        self.temperatures = [[] for _ in range(rows)]
        self.tempered_entropies = [[] for _ in range(rows)]
