"""The pruning study's passkeys: every case under every arm on one engine, and each case an arm
loses that dense found asked again of dense attention computed by another exact kernel.

Which cases dense finds is itself decided by a margin: on SmolLM2's repeated haystack at 6,144
tokens with the needle first, the first answer token is the key's leading space at -1.62 nats
against " the" at -1.78 under the native kernel, and the torch kernel (the same arithmetic
summed in another order, through 30 layers of 4-bit weights with 8-bit activations) turns the
two over; the model then loops on "the pass key is". A case only one dense kernel finds is on a
knife edge, not a fact the pruned arm failed to retrieve: the figures count the cases lost that
both kernels find (``passkeys lost``) beside the plain count found.
"""

from __future__ import annotations

from collections.abc import Callable

from etinfer.bench.common.fidelity import passkey_accuracy, passkey_cases
from etinfer.llm import LLM
from studies.laws.pruning_arms import Arm

DENSE = "dense"
# The row key of dense attention by the torch kernel, asked only of the cases an arm lost.
RECHECK = "dense (torch kernel)"


def passkey_rows(
    llm: LLM,
    runs: list[Arm],
    lengths: tuple[int, ...],
    recheck: Callable[[], LLM] | None = None,
) -> list[dict]:
    """Every case under every arm (a configuration None: dense), a row per case. One length at
    a time, so that the pool keeps its prompts: after the first arm they come from the prefix
    cache, and each further one costs only its decode steps. ``recheck`` builds the engine of
    the other dense kernel, once, if some arm lost a case dense found."""
    rows, lost = [], []
    for haystack in ("repeated", "varied"):
        found: dict[str, list[bool]] = {name: [] for name, _, _ in runs}
        for length in lengths:
            cases = passkey_cases(llm.tokenizer, (length,), haystack)
            hits = {}
            for name, config, selector in runs:
                llm.engine.set_pruning(config, selector)
                hits[name] = passkey_accuracy(llm, cases)
                found[name] += hits[name]
            for i, case in enumerate(cases):
                row = {"haystack": haystack, "length": case.length, "depth": case.depth}
                rows.append(row | {name: h[i] for name, h in hits.items()})
                if hits[DENSE][i] and not all(h[i] for h in hits.values()):
                    lost.append((rows[-1], case))
        print(
            f"  passkey {haystack}: "
            + ", ".join(f"{name} {sum(h)}/{len(h)}" for name, h in found.items()),
            flush=True,
        )
    llm.engine.set_pruning(None)
    if lost and recheck is not None:
        other = recheck()
        hits = passkey_accuracy(other, [case for _, case in lost])
        for (row, _), hit in zip(lost, hits, strict=True):
            row[RECHECK] = hit
        print(
            f"  {len(lost)} cases dense found and an arm lost; the torch kernel's dense finds "
            f"{sum(row[RECHECK] for row, _ in lost)}",
            flush=True,
        )
    return rows


def lost_by_both(rows: list[dict], arm: str) -> int:
    """Cases ``arm`` lost that dense found under both kernels (where one was asked again)."""
    return sum(1 for row in rows if row[DENSE] and not row[arm] and row.get(RECHECK, True))
