"""Goodput, as DistServe defines it: the highest request rate an arm sustains while a target
share of its requests meets a latency objective (a time to first token and a time per output
token after the first).

    python -m studies ablation --workload mixed --sweep-rates 0.1 0.2 0.3 0.4 \
        --slo-ttft 20 --slo-tpot 0.5 --output results/ablation-goodput

Each rate runs every arm on the workload's requests arriving at that rate (Poisson, the same
seed), so the sweep is Table 1's runs once per rate. Per arm and rate: the SLO attainment (the
share of requests that met both objectives) and goodput (those requests per second of the
run); per arm, the highest rate of the sweep whose attainment reaches ``--slo-target``. A sweep
whose lowest rate already misses the target says so, with the attainment it reached.
"""

from __future__ import annotations

from dataclasses import dataclass

from etinfer.bench.common.driver import RequestRecord
from etinfer.bench.common.results import Figure


@dataclass(frozen=True)
class Objective:
    ttft_s: float
    tpot_s: float
    target: float  # the share of requests that must meet it, in (0, 1]

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"the SLO's {name} must be above 0, got {getattr(self, name)}")
        if not 0 < self.target <= 1:
            raise ValueError(f"--slo-target must be in (0, 1], got {self.target}")

    def met(self, record: RequestRecord) -> bool:
        """A request that ended, its first token within the TTFT objective, and each later one
        within the TPOT objective on average (a one-token reply has no TPOT to miss)."""
        if not record.ok or record.ttft is None or record.ttft > self.ttft_s:
            return False
        return record.tpot is None or record.tpot <= self.tpot_s


def attainment(records: list[RequestRecord], objective: Objective) -> float:
    return sum(objective.met(r) for r in records) / max(1, len(records))


def goodput(records: list[RequestRecord], makespan: float, objective: Objective) -> float:
    """Requests that met the objective, per second of the run."""
    return sum(objective.met(r) for r in records) / makespan if makespan > 0 else 0.0


def sustained_rate(attained: dict[float, float], target: float) -> float | None:
    """The highest rate whose attainment reaches ``target``; None where none does."""
    met = [rate for rate, share in attained.items() if share >= target]
    return max(met) if met else None


def sweep_figures(
    by_rate: dict[float, dict[str, list]], objective: Objective, labels: dict
) -> tuple[list[Figure], dict, list[str]]:
    """``by_rate``: per rate, per arm, its runs (one a repeat). Figures per arm and rate
    (attainment, goodput, the means over repeats), per arm its sustained rate and its ratio to
    the baseline's; the report; and what the sweep says where a target is not reached."""
    figures, report, notes = [], {}, []
    attained: dict[str, dict[float, float]] = {}
    for rate, arms in sorted(by_rate.items()):
        for arm, runs in arms.items():
            share = sum(attainment(r.records, objective) for r in runs) / len(runs)
            good = sum(goodput(r.records, r.makespan, objective) for r in runs) / len(runs)
            attained.setdefault(arm, {})[rate] = share
            report.setdefault(arm, {})[rate] = {"attainment": share, "goodput": good}
            at = labels | {"arm": arm, "rate": rate}
            figures.append(Figure("slo attainment", 100 * share, "%", at, n=len(runs)))
            figures.append(Figure("goodput", good, "req/s", at, n=len(runs)))
    lowest = min(by_rate)
    sustained = {arm: sustained_rate(shares, objective.target) for arm, shares in attained.items()}
    for arm, rate in sustained.items():
        if rate is None:
            notes.append(
                f"{arm}: the lowest rate swept ({lowest} req/s) already misses the SLO: "
                f"{100 * attained[arm][lowest]:.0f} % of requests met it "
                f"(target {100 * objective.target:.0f} %)"
            )
            continue
        figures.append(Figure("sustained rate", rate, "req/s", labels | {"arm": arm}))
        base = sustained.get("baseline")
        if base:
            at = labels | {"arm": arm, "vs": "baseline"}
            figures.append(Figure("sustained rate", rate / base, "x", at))
    return figures, {"per_rate": report, "sustained": sustained}, notes
