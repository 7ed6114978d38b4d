"""Turn one step's logits into tokens, batched on the device, and measure the entropy signal.

Every row yields its token and five numbers:

- the entropy of the model's distribution at temperature 1 (exact, nats);
- the entropy of the distribution the token was drawn from;
- the temperature used;
- the predictive entropy the control laws read: the model's entropy as the row's estimator
  measures it on calibrated logits, and the estimate's upper side.

A row whose temperature law carries state also yields its next state. A row under a grammar
(``etinfer/structured/``) is sampled from the masked distribution, but every number above is
measured before the mask, so the control laws read the model, not the grammar; such a step
also yields the masked distribution's entropy, the mass the mask removed (``-log Z``) and how
many tokens it allowed. All of it comes back to the host in one transfer per step. The
temperature laws themselves live in ``etinfer.control.temperature``; the sampler calls each
present law on its rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from etinfer.control.entropy import (
    Distribution,
    estimate_entropy,
    restricted,
    softmax_entropy,
    topk_bounds,
)
from etinfer.control.stress import StressConfig
from etinfer.engine.sampling.sampling_batch import SamplingBatch, apply_filters
from etinfer.outputs import Logprob


@dataclass
class SampledLogprobs:
    token_logprob: torch.Tensor  # [rows]
    token_rank: torch.Tensor  # [rows]
    top_ids: torch.Tensor  # [rows, N]
    top_logprobs: torch.Tensor  # [rows, N]

    def to_host(self, token_ids: list[int], counts: list[int | None], token_text) -> list:
        """Per row: {token id: Logprob} with the sampled token and the row's own top-N."""
        columns = [
            self.token_logprob[:, None],
            self.token_rank[:, None],
            self.top_ids,
            self.top_logprobs,
        ]
        width = self.top_ids.shape[1]
        rows = []
        # One transfer; ids and ranks are exact in float64.
        for i, (n, row) in enumerate(
            zip(counts, torch.cat(columns, 1).double().tolist(), strict=True)
        ):
            if n is None:
                rows.append(None)
                continue
            top_ids, top_lp = row[2 : 2 + n], row[2 + width : 2 + width + n]
            entry = {
                int(tid): Logprob(value, r + 1, token_text(int(tid)))
                for r, (tid, value) in enumerate(zip(top_ids, top_lp, strict=True))
            }
            entry.setdefault(token_ids[i], Logprob(row[0], int(row[1]), token_text(token_ids[i])))
            rows.append(entry)
        return rows


@dataclass
class SamplerOutput:
    token_ids: list[int]
    entropies: list[float]
    tempered_entropies: list[float]
    temperatures: list[float]
    # What the control laws read next step: the row's estimator on calibrated logits, and the
    # estimate's upper side (what pruning decisions read).
    predictive_entropy: list[float]
    predictive_entropy_upper: list[float]
    states: list[float]  # each row's next controller state (NaN for rows without one)
    logprobs: SampledLogprobs | None
    # Steps with a grammar mask, per row (NaN for rows without one): the masked distribution's
    # entropy, -log Z of the mass it kept, and how many tokens it allowed.
    masked_entropies: list[float] | None = None
    removed_mass: list[float] | None = None
    allowed_counts: list[float] | None = None


class Sampler:
    def __init__(
        self,
        generator: torch.Generator,
        calibration_temperature: float = 1.0,
        stress: StressConfig | None = None,
    ) -> None:
        self.generator = generator  # for rows whose request gave no seed
        # Post-hoc calibration (paper section 5): the control signal is the entropy of
        # softmax(z / T_cal). It does not change what any request samples; nor does a stress.
        self.calibration_temperature = calibration_temperature
        self.stress = stress

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        model = softmax_entropy(logits)
        predictive = self._predictive_entropy(logits, model.entropy, batch)
        state = torch.full_like(model.entropy, torch.nan)
        # Under a grammar the token is drawn from the masked logits; the entropies above and
        # the temperature laws stay on the model's own.
        allowed_logits, base = logits, model
        if batch.allowed is not None:
            allowed_logits = logits.masked_fill(~batch.allowed, -torch.inf)
            base = restricted(model, logits, batch.allowed)
        if batch.all_greedy:
            tokens, temperature = self._force(base.top, batch), batch.temperature
            tempered = torch.zeros_like(model.entropy)
        else:
            greedy = batch.temperature == 0
            temperature = self.temperatures(logits, model.entropy, batch, state)
            masked = batch.masks or batch.allowed is not None
            if batch.untempered:  # every row samples the (allowed) distribution as is
                scaled, sampled_from = allowed_logits, base
            else:
                scaled = self._filtered(allowed_logits, temperature, batch)
                sampled_from = softmax_entropy(scaled, masked=masked)
            drawn = self._draw(sampled_from.probs, batch.generators)
            tokens = self._force(torch.where(greedy, base.top, drawn), batch)
            if batch.allowed is not None and batch.groups:
                # Laws that move after sampling follow what the model would have sampled from.
                scaled = self._filtered(logits, temperature, batch)
                sampled_from = softmax_entropy(scaled, masked=batch.masks)
            self.advance_states(scaled, sampled_from, tokens, temperature, batch, state)
            tempered = torch.where(greedy, 0.0, sampled_from.entropy)
            temperature = torch.where(greedy, 0.0, temperature)
        logprobs = None
        if batch.num_logprobs is not None:
            logprobs = self.logprobs_of(model.logprobs(logits), tokens, batch.num_logprobs)
        columns = [tokens, model.entropy, tempered, temperature, *predictive, state]
        if batch.allowed is not None:
            constrained = batch.constrained
            nan = torch.full_like(model.entropy, torch.nan)
            removed = model.log_normalizer - base.log_normalizer
            columns += [
                torch.where(constrained, base.entropy, nan),
                torch.where(constrained, removed.clamp(min=0.0), nan),
                torch.where(constrained, batch.allowed.sum(-1).float(), nan),
            ]
        # One host transfer for the per-row scalars (token ids are exact in float64).
        ids, *host = torch.stack([c.double() for c in columns]).tolist()
        return SamplerOutput([int(t) for t in ids], *host[:6], logprobs, *host[6:])

    def _filtered(
        self, logits: torch.Tensor, temperature: torch.Tensor, batch: SamplingBatch
    ) -> torch.Tensor:
        """The logits each row samples from at its temperature, after its filters."""
        return self._truncate(apply_filters(logits / temperature[:, None], batch), batch)

    def _predictive_entropy(
        self, logits, raw_entropy, batch: SamplingBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's entropy by its estimator on calibrated logits, and the estimate's upper
        side (the tail bound ``H_U`` for the top-k estimators, the value itself when exact)."""
        stress = self.stress
        plain = self.calibration_temperature == 1.0 and stress is None
        if plain and all(e == "exact" for e, _ in batch.estimators):
            return raw_entropy, raw_entropy
        scale = 1.0 if stress is None else stress.logit_scale
        calibrated = logits * (scale / self.calibration_temperature)
        estimate, upper = torch.empty_like(raw_entropy), torch.empty_like(raw_entropy)
        for (estimator, k), rows in batch.estimators.items():
            if estimator == "exact":
                estimate[rows] = upper[rows] = estimate_entropy(calibrated[rows], estimator, k)
            else:
                bounds = topk_bounds(calibrated[rows], k)
                estimate[rows] = bounds.topk if estimator == "topk" else bounds.midpoint
                upper[rows] = bounds.upper
        if stress is not None and stress.entropy_bias:
            estimate = (estimate + stress.entropy_bias).clamp(min=0.0)
            upper = (upper + stress.entropy_bias).clamp(min=0.0)
        return estimate, upper

    @staticmethod
    def temperatures(
        logits: torch.Tensor,
        model_entropy: torch.Tensor,
        batch: SamplingBatch,
        state: torch.Tensor,
    ) -> torch.Tensor:
        """Each row's temperature for this step, by its law; laws that act before sampling
        write their next state into ``state``."""
        temperature = batch.temperature.clone()
        for group in batch.groups:
            update, next_state = group.law.before_sampling(
                group, logits, model_entropy, temperature
            )
            if update is not None:
                temperature[group.rows] = update
            if next_state is not None:
                state[group.rows] = next_state
        return temperature

    @staticmethod
    def _force(tokens: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        return (
            tokens if batch.forced is None else torch.where(batch.forced >= 0, batch.forced, tokens)
        )

    @staticmethod
    def _truncate(scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Remove what the laws that truncate (Mirostat) remove from their rows."""
        for group in batch.groups:
            removed = group.law.truncation(group, scaled)
            if removed is not None:
                scaled = scaled.clone()
                scaled[group.rows] = scaled[group.rows].masked_fill(removed, -torch.inf)
        return scaled

    @staticmethod
    def advance_states(
        scaled: torch.Tensor,
        sampled_from: Distribution,
        tokens: torch.Tensor | None,
        temperature: torch.Tensor,
        batch: SamplingBatch,
        state: torch.Tensor,
    ) -> None:
        """Laws whose state moves after sampling (lagged, Mirostat) write it into ``state``."""
        for group in batch.groups:
            next_state = group.law.after_sampling(group, scaled, sampled_from, tokens, temperature)
            if next_state is not None:
                state[group.rows] = next_state

    @staticmethod
    def logprobs_of(logp: torch.Tensor, tokens: torch.Tensor, count: int) -> SampledLogprobs:
        """Each row's log-probability of its token in ``tokens``, its rank, its top ``count``."""
        token_logp = logp.gather(1, tokens[:, None])
        top_logp, top_ids = logp.topk(count, dim=-1)
        return SampledLogprobs(
            token_logprob=token_logp[:, 0],
            token_rank=(logp > token_logp).sum(-1) + 1,
            top_ids=top_ids,
            top_logprobs=top_logp,
        )

    def _draw(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """Sample each row by inverting its cumulative distribution at one uniform draw.

        One random number per row: drawing one per vocabulary entry (the exponential race GPU
        engines use) took 30 ms at batch 32 on the CPU, this takes under 1 ms. Seeded rows draw
        from their own generator, so their tokens do not depend on what else is in the batch.
        """
        uniform = torch.rand(probs.shape[0], 1, generator=self.generator, device=probs.device)
        for row, generator in enumerate(generators):
            if generator is not None:
                uniform[row] = torch.rand(1, generator=generator, device=probs.device)
        cdf = probs.cumsum(-1)
        # 1 - u lies in (0, 1], so the first index reaching it has a nonzero probability.
        chosen = torch.searchsorted(cdf, (1 - uniform) * cdf[:, -1:])
        return chosen[:, 0].clamp(max=probs.shape[-1] - 1)
