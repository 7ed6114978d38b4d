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


def tempered_entropy(
    logits: torch.Tensor, log_temperature: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Entropy and varentropy of ``softmax(logits / T)`` per row, from moments of the logits.

    With ``b = 1/T``: ``H = logsumexp(b z) - b E[z]`` and ``V = b^2 Var[z]`` under ``p_T``, which
    takes fewer passes over the vocabulary than going through log-probabilities. The logits are
    shifted to a row maximum of 0 first: both terms then stay small and do not cancel.
    """
    logits = logits - logits.amax(-1, keepdim=True)
    beta = torch.exp(-log_temperature)[:, None]
    scaled = logits * beta
    lse = scaled.logsumexp(-1, keepdim=True)
    p = (scaled - lse).exp()
    finite = torch.where(logits > -torch.inf, logits, 0.0)
    mean = (p * finite).sum(-1, keepdim=True)
    h = lse[:, 0] - beta[:, 0] * mean[:, 0]
    v = beta[:, 0].square() * (p * (finite - mean).square()).sum(-1)
    return h, v


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
    log_rest = torch.log(torch.tensor(float(max(vocab - k, 1)), dtype=logits.dtype))
    smallest = top_p[:, -1]
    spread = torch.where(tail > 0, torch.log(tail / smallest).clamp(0.0, log_rest.item()), 0.0)
    lower = base + tail * spread
    upper = base + tail * log_rest
    return TopKBounds(topk=h_k, lower=lower, upper=upper, tail_mass=tail)


def estimate_entropy(
    logits: torch.Tensor, estimator: str, k: int, lse: torch.Tensor | None = None
) -> torch.Tensor:
    """Each row's entropy by the named estimator: ``exact``, ``topk`` or ``tail`` (midpoint)."""
    if estimator == "exact":
        lse = logits.logsumexp(-1) if lse is None else lse
        return entropy(logits - lse[:, None])
    bounds = topk_bounds(logits, k, lse)
    return bounds.topk if estimator == "topk" else bounds.midpoint
