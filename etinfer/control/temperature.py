"""Temperature laws (the paper's micro scale, section 3.3 and appendix A), and the reference
samplers they are compared against. All are pure and batched: one row per sequence.

The state of the entropy controllers is the log-temperature ``u = log T``:

- feedback: ``u' = clip(u - gain * (H_hat - H*), log T_min, log T_max)``, the step itself
  clipped to ``max_step``. Since ``dH/du = V`` (varentropy), the error obeys
  ``e' ~ (1 - gain * V) e``: it contracts geometrically when ``0 < gain * V < 2`` and
  oscillates or diverges outside; with estimation noise ``|nu| <= eps`` it settles within
  ``eps / V`` in ``u`` (appendix A, for ``gain * V <= 1``).
- exact: solve ``H(softmax(z / T)) = H*`` on the current logits (no one-step lag), by Newton's
  method in ``u`` with slope ``V``, safeguarded by bisection inside ``[log T_min, log T_max]``.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch


class EntropyCurve(Protocol):
    """Entropy and its slope ``dH/du`` of some rows' distributions, as functions of ``u``."""

    def __call__(self, log_temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def restrict(self, rows: torch.Tensor) -> EntropyCurve: ...


def feedback_step(
    u: torch.Tensor,
    measured: torch.Tensor,
    target: torch.Tensor,
    gain: torch.Tensor,
    u_min: torch.Tensor,
    u_max: torch.Tensor,
    max_step: torch.Tensor,
) -> torch.Tensor:
    """One update of the feedback law in log-temperature."""
    step = (-gain * (measured - target)).clamp(min=-max_step, max=max_step)
    return torch.minimum(torch.maximum(u + step, u_min), u_max)


def solve_log_temperature(
    curve: EntropyCurve,
    target: torch.Tensor,
    u_min: torch.Tensor,
    u_max: torch.Tensor,
    u_start: torch.Tensor,
    iterations: int = 16,
    tolerance: float = 1e-4,
) -> torch.Tensor:
    """Per row, the ``u`` in ``[u_min, u_max]`` where entropy equals ``target``, or the nearer
    bound when the target is out of reach.

    From a warm start (last step's temperature) Newton converges in two or three evaluations.
    Rows leave the loop as they come within ``tolerance`` nats (or pin at a bound), so a slow
    row costs only itself; checking reads one flag back from the device, which costs nothing on
    the CPU. Newton steps that leave the bracket fall back to bisection, except that each bound
    is tried once when Newton points past it (the target may be out of reach there, and
    bisection would only creep towards it).
    """
    lo, hi = u_min.clone(), u_max.clone()
    u = torch.minimum(torch.maximum(u_start, lo), hi)
    tried_floor, tried_ceiling = u <= u_min, u >= u_max
    active = torch.arange(u.numel(), device=u.device)
    for _ in range(iterations):
        at = u[active]
        h, slope = curve(at)
        error = h - target[active]
        pinned = ((at <= u_min[active]) & (error > 0)) | ((at >= u_max[active]) & (error < 0))
        going = ~((error.abs() < tolerance) | pinned)
        if not bool(going.all()):
            if not bool(going.any()):
                break
            active, at, error, slope = active[going], at[going], error[going], slope[going]
            curve = curve.restrict(going)
        too_hot = error > 0  # entropy grows with temperature: the root is below u
        hi[active] = torch.where(too_hot, at, hi[active])
        lo[active] = torch.where(too_hot, lo[active], at)
        low, high, floor, ceiling = lo[active], hi[active], u_min[active], u_max[active]
        newton = at - error / slope.clamp(min=1e-12)
        # Closed bracket: a row exactly at its root must stay where it is.
        inside = (newton >= low) & (newton <= high) & (slope > 1e-12)
        step = torch.where(
            (newton < low) & ~tried_floor[active],
            floor,
            torch.where((newton > high) & ~tried_ceiling[active], ceiling, (low + high) / 2),
        )
        step = torch.where(inside, newton, step)
        tried_floor[active] |= step <= floor
        tried_ceiling[active] |= step >= ceiling
        u[active] = step
    return u


def edt_temperature(
    entropy: torch.Tensor, base_temperature: torch.Tensor, theta: torch.Tensor, n: torch.Tensor
) -> torch.Tensor:
    """EDT (Zhang et al. 2024): ``T = T0 * N^(theta / H)``, open loop on this step's entropy.

    With ``N < 1`` a confident step (small ``H``) gets a lower temperature: it cools confidence,
    the opposite direction of a stabiliser.
    """
    return base_temperature * n.pow(theta / entropy.clamp(min=1e-6))


def mirostat_mask(logp: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """Mirostat v2's truncation: remove tokens whose surprise ``-log2 p`` exceeds ``mu`` bits,
    always keeping the most likely one. True where a token is removed."""
    surprise = -logp / math.log(2)
    removed = surprise > mu[:, None]
    top = logp.argmax(-1, keepdim=True)
    return removed.scatter(-1, top, False)


def mirostat_update(
    mu: torch.Tensor, sampled_logp: torch.Tensor, tau: torch.Tensor, eta: torch.Tensor
) -> torch.Tensor:
    """``mu <- mu - eta * (S - tau)`` with ``S`` the sampled token's surprise (bits) under the
    truncated, renormalised distribution it was drawn from."""
    return mu - eta * (-sampled_logp / math.log(2) - tau)
