"""One step's grammar masks for a batch of rows, what a masked step measured, and a constrained
request's state: its matcher and that record."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from etinfer.structured.backend import Matcher, allocate_bitmask, unpack_bitmask


def fill_allowed(matchers: list[Matcher | None], vocab_size: int) -> torch.Tensor | None:
    """[rows, vocab] True where a row may emit a token; None when no row is constrained.

    Rows without a matcher allow everything; so does a row at a dead end (nothing allowed), so
    that sampling stays defined: its matcher then refuses the token and the request ends."""
    if all(m is None for m in matchers):
        return None
    bitmask = allocate_bitmask(len(matchers), vocab_size)
    by_backend: dict[type[Matcher], list[int]] = {}
    for row, matcher in enumerate(matchers):
        if matcher is not None:
            by_backend.setdefault(type(matcher), []).append(row)
    for kind, rows in by_backend.items():
        kind.fill_masks([matchers[r] for r in rows], bitmask, rows)
    allowed = unpack_bitmask(bitmask, vocab_size)
    dead = ~allowed.any(-1)
    if bool(dead.any()):
        allowed[dead] = True
    return allowed


@dataclass
class ConstraintTrace:
    """Per generated token of a constrained request: the entropy of the masked distribution,
    the mass the mask removed as ``-log Z`` (0 when it removed nothing the model wanted), and
    whether the mask left one token (a forced step: the model's entropy says nothing about it)."""

    masked_entropies: list[float] = field(default_factory=list)
    removed_mass: list[float] = field(default_factory=list)
    forced: list[bool] = field(default_factory=list)

    def append(self, masked_entropy: float, removed: float, allowed: float) -> None:
        self.masked_entropies.append(masked_entropy)
        self.removed_mass.append(removed)
        self.forced.append(allowed == 1)

    def extended(self, later: ConstraintTrace) -> ConstraintTrace:
        self.masked_entropies += later.masked_entropies
        self.removed_mass += later.removed_mass
        self.forced += later.forced
        return self

    def since(self, start: int) -> ConstraintTrace:
        return ConstraintTrace(
            self.masked_entropies[start:], self.removed_mass[start:], self.forced[start:]
        )


@dataclass
class StructuredState:
    """A constrained request's grammar: its matcher (None until the grammar has compiled; every
    sampled token goes through it) and what the masks did, per generated token."""

    matcher: Matcher | None = None
    trace: ConstraintTrace = field(default_factory=ConstraintTrace)
