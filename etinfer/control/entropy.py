"""Entropy estimators on batched logits, in nats (paper sections 2.1 and 5).

Every function takes a batch of rows ``[rows, vocab]`` and returns one value per row. The exact
entropy needs the whole distribution; the top-k estimators need only the k largest logits and the
log-normaliser (which sampling computes anyway), and bound what the tail can add:

- top-k renormalised: ``H_k = -sum_K q log q`` with ``q = p / (1 - m)``, ``m`` the tail mass;
- lower bound: ``H_L = (1 - m) H_k + h(m) + m * max(0, log(m / p_k))``: the tail as one atom
  (``h`` is the binary entropy), tightened because every tail probability is at most ``p_k``, the
  smallest kept one, so the tail spreads over at least ``m / p_k`` tokens;
- upper bound: ``H_U = (1 - m) H_k + h(m) + m log(V - k)``: the tail uniform over the rest;
- tail-corrected: the midpoint of ``[H_L, H_U]``, the point whose worst-case error (half the
  width) is smallest; decisions that prune or deprioritise read ``H_U`` instead, so an
  underestimate can never make them more aggressive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ESTIMATORS = ("exact", "topk", "tail")


def entropy(logp: torch.Tensor) -> torch.Tensor:
    """Shannon entropy of each row given its log-probabilities; -inf entries contribute 0."""
    return -torch.where(logp > -torch.inf, logp.exp() * logp, 0.0).sum(-1)


def varentropy(logp: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
    """``sum p (log p + H)^2``: the variance of the surprisal, and ``dH / d log T``."""
    h = entropy(logp) if h is None else h
    centred = torch.where(logp > -torch.inf, logp + h[:, None], 0.0)
    return (logp.exp() * centred.square()).sum(-1)


@dataclass
class Distribution:
    probs: torch.Tensor  # [rows, vocab]
    entropy: torch.Tensor  # [rows], exact, nats
    top: torch.Tensor  # [rows], the most likely token
    log_normalizer: torch.Tensor  # [rows], logsumexp of the logits

    def logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        return logits - self.log_normalizer[:, None]


def softmax_entropy(logits: torch.Tensor, masked: bool = False) -> Distribution:
    """Probabilities, exact entropy, argmax and log-normaliser of each row, in three passes over
    the vocabulary (max, softmax, dot): the sampler's hot path.

    ``H = (m - E[z]) - log p_max`` with ``m`` the largest logit: both terms are non-negative, so
    nothing cancels even for a near-certain row. ``masked`` says the logits may hold -inf
    (filtered tokens), which must not meet a zero probability in the dot product.
    """
    top_logit, top = logits.max(-1)
    probs = logits.softmax(-1)
    finite = torch.where(logits > -torch.inf, logits, 0.0) if masked else logits
    log_top_p = probs.gather(1, top[:, None])[:, 0].log()
    h = (top_logit - torch.linalg.vecdot(probs, finite)) - log_top_p
    return Distribution(probs, h.clamp(min=0.0), top, top_logit - log_top_p)


def restricted(model: Distribution, logits: torch.Tensor, allowed: torch.Tensor) -> Distribution:
    """``softmax_entropy`` of the logits with the tokens outside ``allowed`` removed, from the
    whole distribution already computed: with ``Z`` the mass kept and ``S`` the kept
    probabilities' dot with the logits, ``H = (m - S / Z) - log q_max`` in the same
    cancellation-free form as there (``m`` the top kept logit, ``q_max`` its kept share). It
    saves the softmax pass; a row that kept less mass than float32 resolves is computed
    exactly instead."""
    kept = model.probs * allowed
    mass = kept.sum(-1)
    top = kept.argmax(-1)
    log_top_q = (kept.gather(1, top[:, None])[:, 0] / mass).log()
    mean_logit = torch.linalg.vecdot(kept, logits) / mass
    entropy = (logits.gather(1, top[:, None])[:, 0] - mean_logit) - log_top_q
    dist = Distribution(
        kept / mass[:, None], entropy.clamp(min=0.0), top, model.log_normalizer + mass.log()
    )
    tiny = mass < 1e-30
    if bool(tiny.any()):
        exact = softmax_entropy(logits[tiny].masked_fill(~allowed[tiny], -torch.inf), masked=True)
        for name in ("probs", "entropy", "top", "log_normalizer"):
            getattr(dist, name)[tiny] = getattr(exact, name)
    return dist


class TemperedEntropy:
    """Entropy and varentropy of ``softmax(z / T)`` for one set of logits, at any ``u = log T``.

    With ``b = 1/T`` and the logits shifted to a row maximum of 0, the weights ``w = exp(b z)``
    sum to ``Z >= 1`` and ``H = log Z - b E[z]``, ``V = b^2 (E[z^2] - E[z]^2)`` under
    ``p_T = w / Z``. An evaluation is then one exp and one batched matrix-vector product of the
    stacked ``(z, z^2)`` with ``w``: no max pass, no separate normalisation, no temporaries per
    moment. Masked (-inf) logits become ``MASKED``, whose weight is exactly zero at any
    temperature below 1e10 while its products stay finite (its square fits in float32).
    """

    MASKED = -1e15

    def __init__(self, logits: torch.Tensor) -> None:
        shifted = (logits - logits.amax(-1, keepdim=True)).clamp(min=self.MASKED)
        self.moments = torch.stack((shifted, shifted.square()), dim=1)  # [rows, 2, vocab]

    def restrict(self, rows: torch.Tensor) -> TemperedEntropy:
        """The same curves for a subset of the rows (a solver drops the converged ones)."""
        subset = object.__new__(TemperedEntropy)
        subset.moments = self.moments[rows]
        return subset

    def __call__(self, log_temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        beta = torch.exp(-log_temperature)
        weights = torch.exp(self.moments[:, 0] * beta[:, None])
        total = weights.sum(-1)
        mean, mean_square = (
            torch.bmm(self.moments, weights[:, :, None])[..., 0] / total[:, None]
        ).unbind(1)
        h = total.log() - beta * mean
        v = beta.square() * (mean_square - mean.square()).clamp(min=0.0)
        return h.clamp(min=0.0), v


def tempered_entropy(
    logits: torch.Tensor, log_temperature: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Entropy and varentropy of ``softmax(logits / T)`` per row (see :class:`TemperedEntropy`)."""
    return TemperedEntropy(logits)(log_temperature)


@dataclass
class TopKBounds:
    topk: torch.Tensor  # H_k, the renormalised top-k entropy
    lower: torch.Tensor  # H_L
    upper: torch.Tensor  # H_U
    tail_mass: torch.Tensor

    @property
    def midpoint(self) -> torch.Tensor:
        return (self.lower + self.upper) / 2


def topk_bounds(logits: torch.Tensor, k: int, lse: torch.Tensor | None = None) -> TopKBounds:
    """Top-k estimates and bounds of each row's entropy.

    ``lse`` is the row's log-normaliser when the caller already has it (sampling does).
    """
    vocab = logits.shape[-1]
    k = min(k, vocab)
    lse = logits.logsumexp(-1) if lse is None else lse
    top_logp = logits.topk(k, dim=-1).values - lse[:, None]
    top_p = top_logp.exp()
    kept = top_p.sum(-1).clamp(max=1.0)
    tail = 1.0 - kept
    # H_k = -sum q log q with q = p / kept, written with the log-probabilities already in hand.
    h_k = -(top_p * top_logp).sum(-1) / kept + kept.log()
    binary = -(torch.xlogy(tail, tail) + torch.xlogy(kept, kept))
    base = kept * h_k + binary
    # The tail spreads over at least m / p_k tokens and at most V - k (m <= (V - k) p_k, so the
    # clamp only absorbs rounding when m is at the level of float error).
    # A Python number: a tensor here was read back (``item``) every step.
    log_rest = math.log(max(vocab - k, 1))
    smallest = top_p[:, -1]
    spread = torch.where(tail > 0, torch.log(tail / smallest).clamp(0.0, log_rest), 0.0)
    lower = base + tail * spread
    upper = base + tail * log_rest
    return TopKBounds(topk=h_k, lower=lower, upper=upper, tail_mass=tail)


def estimate_entropy(
    logits: torch.Tensor, estimator: str, k: int, lse: torch.Tensor | None = None
) -> torch.Tensor:
    """Each row's entropy by the named estimator: ``exact``, ``topk`` or ``tail`` (midpoint)."""
    if estimator == "exact":
        return softmax_entropy(logits, masked=True).entropy
    bounds = topk_bounds(logits, k, lse)
    return bounds.topk if estimator == "topk" else bounds.midpoint
