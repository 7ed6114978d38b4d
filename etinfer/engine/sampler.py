"""Turn one step's logits into tokens, batched on the device, and measure the entropy signal.

Every row yields its token, the entropy of the model's distribution at temperature 1 (exact, in
nats), the entropy of the distribution the token was drawn from, and the temperature used. All
of it comes back to the host in one transfer per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from etinfer.outputs import Logprob
from etinfer.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """The sampling settings of the rows of one step, as device tensors."""

    temperature: torch.Tensor  # [rows], 0 for greedy rows
    top_k: torch.Tensor | None  # [rows], vocabulary size where off; None if no row filters
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    generators: list[torch.Generator | None]  # per row; None draws from the engine's generator
    all_greedy: bool
    num_logprobs: int | None  # the largest top-N asked for; None when no row asks

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingBatch:
        def column(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        any_top_k = any(p.top_k for p in params)
        any_top_p = any(p.top_p < 1.0 for p in params)
        any_min_p = any(p.min_p > 0.0 for p in params)
        asked = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=column([p.temperature for p in params], torch.float32),
            top_k=column([p.top_k or vocab_size for p in params], torch.int64)
            if any_top_k
            else None,
            top_p=column([p.top_p for p in params], torch.float32) if any_top_p else None,
            min_p=column([p.min_p for p in params], torch.float32) if any_min_p else None,
            generators=generators,
            all_greedy=all(p.greedy for p in params),
            num_logprobs=max(asked) if asked else None,
        )


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
    logprobs: SampledLogprobs | None


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of each row's distribution, given its log-probabilities.

    Masked entries (-inf) contribute nothing.
    """
    return -torch.where(logp > -torch.inf, logp.exp() * logp, 0.0).sum(-1)


def apply_filters(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask (-inf) what top-k, then top-p, then min-p remove; each row keeps its top token."""
    if batch.top_k is not None or batch.top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        removed = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if batch.top_k is not None:
            ranks = torch.arange(logits.shape[-1], device=logits.device)
            removed |= ranks >= batch.top_k[:, None]
        if batch.top_p is not None:
            probs = sorted_logits.masked_fill(removed, -torch.inf).softmax(-1)
            mass_before = probs.cumsum(-1) - probs
            removed |= mass_before >= batch.top_p[:, None]
        logits = logits.masked_fill(removed.scatter(-1, order, removed), -torch.inf)
    if batch.min_p is not None:
        probs = logits.softmax(-1)
        threshold = batch.min_p[:, None] * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, -torch.inf)
    return logits


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator  # for rows whose request gave no seed

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logp = logits.log_softmax(-1)
        entropy = entropy_from_logprobs(logp)
        greedy_tokens = logits.argmax(-1)
        if batch.all_greedy:
            tokens = greedy_tokens
            tempered = torch.zeros_like(entropy)
            temperature = batch.temperature
        else:
            greedy = batch.temperature == 0
            temperature = torch.where(greedy, 1.0, batch.temperature)
            tempered_logp = apply_filters(logits / temperature[:, None], batch).log_softmax(-1)
            sampled = self._draw(tempered_logp.exp(), batch.generators)
            tokens = torch.where(greedy, greedy_tokens, sampled)
            tempered = torch.where(greedy, 0.0, entropy_from_logprobs(tempered_logp))
            temperature = torch.where(greedy, 0.0, temperature)
        logprobs = None
        if batch.num_logprobs is not None:
            token_logp = logp.gather(1, tokens[:, None])
            top_logp, top_ids = logp.topk(batch.num_logprobs, dim=-1)
            logprobs = SampledLogprobs(
                token_logprob=token_logp[:, 0],
                token_rank=(logp > token_logp).sum(-1) + 1,
                top_ids=top_ids,
                top_logprobs=top_logp,
            )
        # One host transfer for the per-row scalars (token ids are exact in float64).
        host = torch.stack(
            [tokens.double(), entropy.double(), tempered.double(), temperature.double()]
        )
        ids, entropies, tempered_list, temperatures = host.tolist()
        return SamplerOutput(
            [int(t) for t in ids], entropies, tempered_list, temperatures, logprobs
        )

    def _draw(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """Sample each row by the exponential race: argmax p / E with E ~ Exp(1).

        Seeded rows draw their noise from their own generator, so their tokens do not depend on
        what else is in the batch.
        """
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for row, generator in enumerate(generators):
            if generator is not None:
                noise[row].exponential_(generator=generator)
        return (probs / noise).argmax(-1)
