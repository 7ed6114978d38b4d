"""A study's run writes one result in the engine benchmarks' schema: ``python -m studies
scheduling-sim`` (no model) end to end."""

from __future__ import annotations

from etinfer.bench.common.results import Result
from studies.__main__ import main


def test_the_scheduling_simulation_writes_each_policys_figures(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["scheduling-sim", "--num-requests", "12", "--request-rate", "2", "--seed", "1"]
    assert main(argv) == 0
    (path,) = (tmp_path / "results" / "scheduling-sim").iterdir()
    result = Result.read(path)
    assert result.benchmark == "scheduling-sim" and result.host.device == "cpu"
    assert result.command.startswith("python -m studies ")
    by = {(f.subject, f.unit, tuple(sorted(f.labels.items()))): f for f in result.figures}
    for policy in ("fcfs", "entropy"):
        arm = (("arm", policy),)
        assert by[("throughput", "req/s", arm)].value > 0
        assert by[("latency", "s", arm)].value > 0
        assert by[("ttft p50", "ms", arm)].value > 0
        assert by[("tpot", "ms", arm)].n == 1
    # Only the entropy policy has ratios, each to FCFS's, measured in the same run.
    ratios = [f for f in result.figures if f.unit == "x"]
    assert ratios and all(f.labels == {"arm": "entropy", "vs": "fcfs"} for f in ratios)
    latency = by[("latency", "x", (("arm", "entropy"), ("vs", "fcfs")))].value
    assert latency == by[("latency", "s", (("arm", "entropy"),))].value / (
        by[("latency", "s", (("arm", "fcfs"),))].value
    )
    assert set(result.details["policies"]) == {"fcfs", "entropy"}
