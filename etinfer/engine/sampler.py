"""Turn one step's logits into tokens, batched on the device, and measure the entropy signal.

Every row yields its token and four numbers:

- the entropy of the model's distribution at temperature 1 (exact, nats);
- the entropy of the distribution the token was drawn from;
- the temperature used;
- the control signal: the model's entropy as the row's estimator measures it on calibrated
  logits, which its entropy profile reads.

A controlled row also yields its controller's next state. All of it comes back to the host in
one transfer per step.

A row's temperature comes from its request's controller (``SamplingParams.controller``):

- fixed: the request's temperature;
- feedback: ``exp(u)``, ``u`` first corrected by the law from the entropy measured on this step's
  logits at the carried-over temperature (the engine has the logits before it samples, so the
  law's measurement and its action fall in the same step);
- lagged: the paper's literal ordering: ``exp(u)`` as carried over, ``u`` updated after sampling
  from the entropy of the distribution sampled, acting from the next step;
- exact: solved on this step's logits;
- EDT: from this step's entropy;
- Mirostat v2: the request's temperature, then a surprise truncation with state ``mu``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from etinfer.control.entropy import (
    Distribution,
    TemperedEntropy,
    estimate_entropy,
    softmax_entropy,
    topk_bounds,
)
from etinfer.control.temperature import (
    edt_temperature,
    feedback_step,
    mirostat_mask,
    mirostat_update,
    solve_log_temperature,
)
from etinfer.outputs import Logprob
from etinfer.sampling_params import ENTROPY_CONTROLS, SamplingParams

# Top-k / top-p decide on this many of the largest logits (more when a top_k asks for more).
TOP_CANDIDATES = 256


@dataclass
class RowGroup:
    """Rows sharing a controller, with their settings as device columns."""

    rows: torch.Tensor  # indices into the batch
    columns: dict[str, torch.Tensor]
    # (estimator, k) -> positions within ``rows`` whose entropy that estimator measures
    estimators: dict[tuple[str, int], torch.Tensor]


@dataclass
class SamplingBatch:
    """The sampling settings of the rows of one step, as device tensors."""

    temperature: torch.Tensor  # [rows], 0 for greedy rows; for controlled rows their current T
    top_k: torch.Tensor | None  # [rows], vocabulary size where off; None if no row filters
    candidates: int  # how many of the largest logits top-k / top-p decide on
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    generators: list[torch.Generator | None]  # per row; None draws from the engine's generator
    groups: dict[str, RowGroup]  # by controller, for those present (not "fixed")
    estimators: dict[tuple[str, int], torch.Tensor]  # (estimator, k) -> rows measured that way
    forced: torch.Tensor | None  # [rows] a token to emit instead of sampling, -1 where none
    all_greedy: bool
    untempered: bool  # every row samples softmax(logits) as is: temperature 1, no filters
    masks: bool  # some row's sampled distribution has tokens removed (filters, Mirostat)
    num_logprobs: int | None  # the largest top-N asked for; None when no row asks

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        states: list[float | None],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
        forced: list[int | None] | None = None,
    ) -> SamplingBatch:
        def column(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        temperature = [
            math.exp(state) if p.controller in ENTROPY_CONTROLS else p.temperature
            for p, state in zip(params, states, strict=True)
        ]
        groups = {}
        for kind in (*ENTROPY_CONTROLS, "mirostat", "edt"):
            rows = [i for i, p in enumerate(params) if p.controller == kind]
            if rows:
                picked = [params[i] for i in rows]
                values = _columns(kind, picked, [states[i] for i in rows])
                groups[kind] = RowGroup(
                    column(rows, torch.int64),
                    {name: column(v) for name, v in values.items()},
                    {key: column(r, torch.int64) for key, r in _by_estimator(picked).items()},
                )
        asked = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=column(temperature),
            top_k=column([p.top_k or vocab_size for p in params], torch.int64)
            if any(p.top_k for p in params)
            else None,
            candidates=min(vocab_size, max(TOP_CANDIDATES, *(p.top_k for p in params))),
            top_p=column([p.top_p for p in params]) if any(p.top_p < 1 for p in params) else None,
            min_p=column([p.min_p for p in params]) if any(p.min_p > 0 for p in params) else None,
            generators=generators,
            groups=groups,
            estimators={key: column(r, torch.int64) for key, r in _by_estimator(params).items()},
            forced=column([-1 if f is None else f for f in forced], torch.int64)
            if forced and any(f is not None for f in forced)
            else None,
            all_greedy=all(p.greedy for p in params),
            untempered=all(
                p.controller == "fixed" and p.temperature in (0.0, 1.0) and not filters(p)
                for p in params
            ),
            masks=any(filters(p) or p.controller == "mirostat" for p in params),
            num_logprobs=max(asked) if asked else None,
        )


def filters(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0


def _by_estimator(params: list[SamplingParams]) -> dict[tuple[str, int], list[int]]:
    groups: dict[tuple[str, int], list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.entropy_estimator, p.entropy_topk), []).append(i)
    return groups


def _columns(
    kind: str, params: list[SamplingParams], states: list[float | None]
) -> dict[str, list]:
    if kind in ENTROPY_CONTROLS:
        return {
            "target": [p.entropy_target for p in params],
            "gain": [p.entropy_gain for p in params],
            "u_min": [math.log(p.temperature_min) for p in params],
            "u_max": [math.log(p.temperature_max) for p in params],
            "max_step": [p.temperature_rate_limit for p in params],
        }
    if kind == "mirostat":
        return {
            "mu": states,
            "tau": [p.mirostat_tau for p in params],
            "eta": [p.mirostat_eta for p in params],
        }
    return {
        "theta": [p.edt_theta for p in params],
        "base": [p.edt_base for p in params],
        "t_min": [p.temperature_min for p in params],
        "t_max": [p.temperature_max for p in params],
    }


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
    signals: list[float]  # the control signal: estimated entropy of the calibrated distribution
    signal_uppers: list[float]  # its upper side, which pruning decisions read
    states: list[float]  # each row's next controller state (NaN for rows without one)
    logprobs: SampledLogprobs | None


def apply_filters(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask (-inf) what top-k, then top-p, then min-p remove; each row keeps its top token."""
    if batch.top_k is not None or batch.top_p is not None:
        logits = logits.masked_fill(_top_removed(logits, batch), -torch.inf)
    if batch.min_p is not None:
        probs = logits.softmax(-1)
        threshold = batch.min_p[:, None] * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, -torch.inf)
    return logits


def _top_removed(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Tokens top-k and top-p remove, deciding on the ``batch.candidates`` largest logits.

    A full sort of the vocabulary took 56 ms at batch 32 on the CPU, the top 256 about 2.5 ms;
    the cut almost always falls among them. A row whose cut does not (top-p over a flat
    distribution) is decided on a full sort instead.
    """
    rows, vocab = logits.shape
    top_k = (
        batch.top_k if batch.top_k is not None else torch.full((rows,), vocab, device=logits.device)
    )
    top_p = batch.top_p if batch.top_p is not None else torch.ones(rows, device=logits.device)
    values, order = logits.topk(batch.candidates, dim=-1)
    removed, decided = _cut(values, top_k, top_p, logits.logsumexp(-1))
    full = torch.ones_like(logits, dtype=torch.bool).scatter_(1, order, removed)
    full[(top_k >= vocab) & (top_p >= 1)] = False  # rows that do not filter
    undecided = ~decided & ((top_k < vocab) | (top_p < 1))
    if batch.candidates < vocab and bool(undecided.any()):
        values, order = logits[undecided].sort(dim=-1, descending=True)
        removed, _ = _cut(values, top_k[undecided], top_p[undecided], None)
        full[undecided] = removed.scatter(1, order, removed)
    return full


def _cut(
    values: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    log_normalizer: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On each row's largest logits in descending order: which top-k then top-p remove, and
    whether that decides the row (nothing beyond these logits can be kept).

    Top-p measures mass after top-k, as transformers does: when top-k confines the row to these
    logits they are renormalised among themselves; otherwise ``log_normalizer`` (the whole row's)
    applies. ``None`` means the values are the whole row.
    """
    count = values.shape[-1]
    ranks = torch.arange(count, device=values.device)
    removed = ranks >= top_k[:, None]
    confined = top_k <= count
    kept_norm = values.masked_fill(removed, -torch.inf).logsumexp(-1)
    norm = kept_norm if log_normalizer is None else torch.where(confined, kept_norm, log_normalizer)
    probs = (values - norm[:, None]).exp().masked_fill(removed, 0.0)
    # top_p = 1 keeps everything: do not let a cumulative sum that rounds past 1 cut the tail.
    removed |= ((probs.cumsum(-1) - probs) >= top_p[:, None]) & (top_p < 1)[:, None]
    return removed, confined | (probs.sum(-1) >= top_p)


def _measure(logits: torch.Tensor, group: RowGroup) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` for a group's rows, each by its request's estimator."""
    measured = torch.empty(logits.shape[0], device=logits.device)
    for (estimator, k), positions in group.estimators.items():
        measured[positions] = estimate_entropy(logits[positions], estimator, k)
    return measured


class Sampler:
    def __init__(self, generator: torch.Generator, calibration_temperature: float = 1.0) -> None:
        self.generator = generator  # for rows whose request gave no seed
        # Post-hoc calibration (paper section 5): the control signal is the entropy of
        # softmax(z / T_cal). It does not change what any request samples.
        self.calibration_temperature = calibration_temperature

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        model = softmax_entropy(logits)
        signal = self._signal(logits, model.entropy, batch)
        state = torch.full_like(model.entropy, torch.nan)
        if batch.all_greedy:
            tokens, temperature = self._force(model.top, batch), batch.temperature
            tempered = torch.zeros_like(model.entropy)
        else:
            greedy = batch.temperature == 0
            temperature = self.temperatures(logits, model.entropy, batch, state)
            if batch.untempered:  # every row samples the model's own distribution
                scaled, sampled_from = logits, model
            else:
                scaled = apply_filters(logits / temperature[:, None], batch)
                scaled = self._truncate(scaled, batch)
                sampled_from = softmax_entropy(scaled, masked=batch.masks)
            drawn = self._draw(sampled_from.probs, batch.generators)
            tokens = self._force(torch.where(greedy, model.top, drawn), batch)
            self.advance_states(scaled, sampled_from, tokens, temperature, batch, state)
            tempered = torch.where(greedy, 0.0, sampled_from.entropy)
            temperature = torch.where(greedy, 0.0, temperature)
        logprobs = None
        if batch.num_logprobs is not None:
            logprobs = self._logprobs(model.logprobs(logits), tokens, batch.num_logprobs)
        # One host transfer for the per-row scalars (token ids are exact in float64).
        columns = (tokens, model.entropy, tempered, temperature, *signal, state)
        ids, entropies, tempered_list, temperatures, signals, uppers, states = torch.stack(
            [c.double() for c in columns]
        ).tolist()
        return SamplerOutput(
            [int(t) for t in ids],
            entropies,
            tempered_list,
            temperatures,
            signals,
            uppers,
            states,
            logprobs,
        )

    def _signal(
        self, logits, raw_entropy, batch: SamplingBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's entropy by its estimator on calibrated logits, and the estimate's upper
        side (the tail bound ``H_U`` for the top-k estimators, the value itself when exact)."""
        if self.calibration_temperature == 1.0 and all(e == "exact" for e, _ in batch.estimators):
            return raw_entropy, raw_entropy
        calibrated = logits / self.calibration_temperature
        signal, upper = torch.empty_like(raw_entropy), torch.empty_like(raw_entropy)
        for (estimator, k), rows in batch.estimators.items():
            if estimator == "exact":
                signal[rows] = upper[rows] = estimate_entropy(calibrated[rows], estimator, k)
            else:
                bounds = topk_bounds(calibrated[rows], k)
                signal[rows] = bounds.topk if estimator == "topk" else bounds.midpoint
                upper[rows] = bounds.upper
        return signal, upper

    @staticmethod
    def temperatures(
        logits: torch.Tensor,
        raw_entropy: torch.Tensor,
        batch: SamplingBatch,
        state: torch.Tensor,
    ) -> torch.Tensor:
        """Each row's temperature for this step; controllers set before sampling write their
        next state into ``state`` (feedback and exact: log T)."""
        temperature = batch.temperature.clone()
        if "feedback" in batch.groups:
            group = batch.groups["feedback"]
            rows, c = group.rows, group.columns
            u = temperature[rows].log()
            measured = _measure(logits[rows] / temperature[rows, None], group)
            u = feedback_step(
                u, measured, c["target"], c["gain"], c["u_min"], c["u_max"], c["max_step"]
            )
            temperature[rows] = u.exp()
            state[rows] = u
        if "exact" in batch.groups:
            group = batch.groups["exact"]
            rows, c = group.rows, group.columns
            u = solve_log_temperature(
                TemperedEntropy(logits[rows]),
                c["target"],
                c["u_min"],
                c["u_max"],
                temperature[rows].log(),
            )
            temperature[rows] = u.exp()
            state[rows] = u  # the warm start of the next step's solve
        if "edt" in batch.groups:
            group = batch.groups["edt"]
            rows, c = group.rows, group.columns
            # EDT's rule is unbounded: on a near-certain step N^(theta / H) underflows to 0.
            edt = edt_temperature(raw_entropy[rows], temperature[rows], c["theta"], c["base"])
            temperature[rows] = torch.minimum(torch.maximum(edt, c["t_min"]), c["t_max"])
        return temperature

    @staticmethod
    def _force(tokens: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        return (
            tokens if batch.forced is None else torch.where(batch.forced >= 0, batch.forced, tokens)
        )

    @staticmethod
    def _truncate(scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if "mirostat" not in batch.groups:
            return scaled
        group = batch.groups["mirostat"]
        removed = mirostat_mask(scaled[group.rows].log_softmax(-1), group.columns["mu"])
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
        """Controllers whose state moves after sampling write it into ``state``: the lagged law
        (from the distribution just sampled) and Mirostat (from the sampled token)."""
        if "lagged" in batch.groups:
            group = batch.groups["lagged"]
            rows, c = group.rows, group.columns
            measured = _measure(scaled[rows], group)
            u = temperature[rows].log()
            state[rows] = feedback_step(
                u, measured, c["target"], c["gain"], c["u_min"], c["u_max"], c["max_step"]
            )
        if "mirostat" in batch.groups:
            group = batch.groups["mirostat"]
            rows, c = group.rows, group.columns
            # clamp: a forced token may lie outside the truncated set
            sampled = (
                sampled_from.probs[rows].gather(1, tokens[rows, None])[:, 0].clamp(min=1e-30).log()
            )
            state[rows] = mirostat_update(c["mu"], sampled, c["tau"], c["eta"])

    @staticmethod
    def _logprobs(logp: torch.Tensor, tokens: torch.Tensor, count: int) -> SampledLogprobs:
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
