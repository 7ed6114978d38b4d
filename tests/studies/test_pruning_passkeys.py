"""The pruning study's passkey figures: a case counts as lost only where dense found it under
both of its kernels."""

from studies.laws.pruning_figures import passkey_figures
from studies.laws.pruning_passkeys import RECHECK, lost_by_both


def rows() -> list[dict]:
    base = {"haystack": "repeated", "length": 6144}
    return [
        base | {"depth": 0.0, "dense": True, "tokens": False, RECHECK: False},  # knife edge
        base | {"depth": 0.25, "dense": True, "tokens": False, RECHECK: True},  # lost
        base | {"depth": 0.5, "dense": True, "tokens": True},
        base | {"depth": 0.75, "dense": False, "tokens": True},  # found beyond dense
        base | {"depth": 1.0, "dense": False, "tokens": False},
    ]


def test_lost_counts_only_cases_both_dense_kernels_find():
    assert lost_by_both(rows(), "tokens") == 1
    without_recheck = [{k: v for k, v in row.items() if k != RECHECK} for row in rows()]
    assert lost_by_both(without_recheck, "tokens") == 2


def test_figures_count_found_and_lost_and_leave_the_recheck_out():
    figures = {(f.subject, f.labels["arm"]): f for f in passkey_figures(rows(), {})}
    assert figures["passkeys found", "dense"].value == 3
    assert figures["passkeys found", "tokens"].value == 2
    assert figures["passkeys lost", "tokens"].value == 1
    assert figures["passkeys lost", "tokens"].n == 3  # of the cases dense found
    assert ("passkeys lost", "dense") not in figures
    assert not any(RECHECK in arm for _, arm in figures)
