"""Temperature laws (the paper's micro scale, section 3.3 and appendix A), and the reference
samplers they are compared against. All are pure and batched: one row per sequence. Each law is
registered by the name ``SamplingParams.controller`` gives (fixed, feedback, lagged, exact, edt,
mirostat); the sampler keeps the mechanics and asks a request's law for its temperature.

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

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from etinfer.control.entropy import Distribution, TemperedEntropy, estimate_entropy
from etinfer.control.registry import Registry

if TYPE_CHECKING:
    from etinfer.sampling_params import SamplingParams


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
    is tried once when Newton points past it while no evaluation has narrowed that side yet (the
    target may be out of reach there, and bisection would only creep towards it).
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
        # A bound is tried only while the bracket still reaches it: once an evaluation has
        # narrowed that side, Newton past it is rounding noise near the root (entropy is
        # evaluated to about 1e-4 nats), and jumping to the bound would leave bisection too
        # few iterations to come back.
        to_floor = (newton < low) & ~tried_floor[active] & (low <= floor)
        to_ceiling = (newton > high) & ~tried_ceiling[active] & (high >= ceiling)
        step = torch.where(to_floor, floor, torch.where(to_ceiling, ceiling, (low + high) / 2))
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


# -- the laws, by name ---------------------------------------------------------------------------


@dataclass
class RowGroup:
    """The rows of one step that follow one law, with their settings as device columns."""

    law: TemperatureLaw
    rows: torch.Tensor  # indices into the batch
    columns: dict[str, torch.Tensor]
    # (estimator, k) -> positions within ``rows`` whose entropy that estimator measures
    estimators: dict[tuple[str, int], torch.Tensor]

    def measure(self, logits: torch.Tensor) -> torch.Tensor:
        """Entropy of ``softmax(logits)`` for the group's rows (``logits`` holds just them),
        each by its request's estimator."""
        measured = torch.empty(logits.shape[0], device=logits.device)
        for (estimator, k), positions in self.estimators.items():
            measured[positions] = estimate_entropy(logits[positions], estimator, k)
        return measured


Update = tuple[torch.Tensor | None, torch.Tensor | None]  # (temperatures, next states) of rows


class TemperatureLaw:
    """How a request's temperature is set each step (``SamplingParams.controller`` names it).

    A law carries one float of state per sequence from step to step (log T, or Mirostat's mu).
    It acts at up to three points of a step, each on its group's rows only: before sampling
    (the temperature), after the temperature (a truncation, Mirostat) and after sampling (a
    state update that needs the sampled distribution or token).
    """

    truncates = False  # it removes tokens from the distribution sampled

    def settings(
        self, params: list[SamplingParams], states: list[float | None]
    ) -> dict[str, list[float]]:
        """The columns this law reads: the requests' settings, and their states if needed."""
        return {}

    def initial_state(self, params: SamplingParams) -> float | None:
        return None

    def starting_temperature(self, params: SamplingParams, state: float | None) -> float:
        """The temperature the step starts from, before ``before_sampling``."""
        return params.temperature

    def before_sampling(
        self,
        group: RowGroup,
        logits: torch.Tensor,
        model_entropy: torch.Tensor,
        temperature: torch.Tensor,
    ) -> Update:
        """The group's temperatures for this step and their next states (None: unchanged)."""
        return None, None

    def truncation(self, group: RowGroup, scaled: torch.Tensor) -> torch.Tensor | None:
        """A mask of the tokens to remove from the group's rows of ``scaled``, if any."""
        return None

    def after_sampling(
        self,
        group: RowGroup,
        scaled: torch.Tensor,
        sampled_from: Distribution,
        tokens: torch.Tensor | None,
        temperature: torch.Tensor,
    ) -> torch.Tensor | None:
        """The group's next states, where they follow from what was sampled."""
        return None


TEMPERATURE_LAWS: Registry[TemperatureLaw] = Registry("temperature law")


def temperature_law(params: SamplingParams) -> TemperatureLaw:
    """The law ``params`` picks; laws hold no state, so each is made once."""
    return _law(params.controller)


@functools.cache
def _law(name: str) -> TemperatureLaw:
    return TEMPERATURE_LAWS.create(name)


@TEMPERATURE_LAWS.register("fixed")
class FixedTemperature(TemperatureLaw):
    """The request's temperature, every step."""


class EntropyControl(TemperatureLaw):
    """The state is ``u = log T``, kept inside the request's temperature bounds."""

    def settings(self, params, states) -> dict[str, list[float]]:
        return {
            "target": [p.entropy_target for p in params],
            "gain": [p.entropy_gain for p in params],
            "u_min": [math.log(p.temperature_min) for p in params],
            "u_max": [math.log(p.temperature_max) for p in params],
            "max_step": [p.temperature_rate_limit for p in params],
        }

    def initial_state(self, params: SamplingParams) -> float:
        return math.log(
            min(max(params.temperature, params.temperature_min), params.temperature_max)
        )

    def starting_temperature(self, params: SamplingParams, state: float | None) -> float:
        return math.exp(state)

    @staticmethod
    def step(group: RowGroup, u: torch.Tensor, measured: torch.Tensor) -> torch.Tensor:
        c = group.columns
        return feedback_step(
            u, measured, c["target"], c["gain"], c["u_min"], c["u_max"], c["max_step"]
        )


@TEMPERATURE_LAWS.register("feedback")
class FeedbackLaw(EntropyControl):
    """``exp(u)``, ``u`` first corrected by the law from the entropy measured on this step's
    logits at the carried-over temperature: the engine has the logits before it samples, so
    the law's measurement and its action fall in the same step."""

    def before_sampling(self, group, logits, model_entropy, temperature) -> Update:
        rows = group.rows
        u = temperature[rows].log()
        u = self.step(group, u, group.measure(logits[rows] / temperature[rows, None]))
        return u.exp(), u


@TEMPERATURE_LAWS.register("lagged")
class LaggedLaw(EntropyControl):
    """The paper's literal ordering: ``exp(u)`` as carried over, ``u`` updated after sampling
    from the entropy of the distribution sampled, acting from the next step."""

    def after_sampling(self, group, scaled, sampled_from, tokens, temperature) -> torch.Tensor:
        rows = group.rows
        return self.step(group, temperature[rows].log(), group.measure(scaled[rows]))


@TEMPERATURE_LAWS.register("exact")
class ExactLaw(EntropyControl):
    """Solved on this step's logits; the solution is the warm start of the next step's solve."""

    def before_sampling(self, group, logits, model_entropy, temperature) -> Update:
        rows, c = group.rows, group.columns
        u = solve_log_temperature(
            TemperedEntropy(logits[rows]),
            c["target"],
            c["u_min"],
            c["u_max"],
            temperature[rows].log(),
        )
        return u.exp(), u


@TEMPERATURE_LAWS.register("edt")
class EDTLaw(TemperatureLaw):
    """EDT from this step's entropy, kept within the request's temperature bounds: the
    published rule is unbounded, and on a near-certain step N^(theta / H) underflows to 0."""

    def settings(self, params, states) -> dict[str, list[float]]:
        return {
            "theta": [p.edt_theta for p in params],
            "base": [p.edt_base for p in params],
            "t_min": [p.temperature_min for p in params],
            "t_max": [p.temperature_max for p in params],
        }

    def before_sampling(self, group, logits, model_entropy, temperature) -> Update:
        rows, c = group.rows, group.columns
        edt = edt_temperature(model_entropy[rows], temperature[rows], c["theta"], c["base"])
        return torch.minimum(torch.maximum(edt, c["t_min"]), c["t_max"]), None


@TEMPERATURE_LAWS.register("mirostat")
class MirostatLaw(TemperatureLaw):
    """The request's temperature, then Mirostat v2's surprise truncation with state ``mu``."""

    truncates = True

    def settings(self, params, states) -> dict[str, list[float]]:
        return {
            "state": states,  # mu, bits
            "tau": [p.mirostat_tau for p in params],
            "eta": [p.mirostat_eta for p in params],
        }

    def initial_state(self, params: SamplingParams) -> float:
        return 2 * params.mirostat_tau

    def truncation(self, group: RowGroup, scaled: torch.Tensor) -> torch.Tensor:
        return mirostat_mask(scaled[group.rows].log_softmax(-1), group.columns["state"])

    def after_sampling(self, group, scaled, sampled_from, tokens, temperature) -> torch.Tensor:
        rows, c = group.rows, group.columns
        # clamp: a forced token may lie outside the truncated set
        sampled = (
            sampled_from.probs[rows].gather(1, tokens[rows, None])[:, 0].clamp(min=1e-30).log()
        )
        return mirostat_update(c["state"], sampled, c["tau"], c["eta"])
