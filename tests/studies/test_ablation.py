"""The ablation study: ROUGE-L, the spread and super-additivity arithmetic, and one ``--quick``
run end to end on the real model, checking that each switch changes what it should."""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from studies.ablation import ablation
from studies.ablation.additivity import additivity_figures, super_additivity
from studies.ablation.metrics import EXPLAINING, summarize_runs
from studies.ablation.report import LABELS
from studies.common import mixed_workload
from studies.common.quality import quality_interval, quality_score, rouge_l, words


def brute_force_lcs(a: list, b: list) -> int:
    """The longest subsequence of ``a`` that is also one of ``b``, by trying them all."""
    for k in range(min(len(a), len(b)), 0, -1):
        for picked in itertools.combinations(a, k):
            it = iter(b)
            if all(x in it for x in picked):  # `in` on an iterator consumes it: in order
                return k
    return 0


def test_rouge_l_on_known_cases():
    assert rouge_l(words("The cat sat on the mat."), words("the cat on the mat")) == pytest.approx(
        10 / 11  # LCS 5: precision 5/6, recall 1
    )
    assert rouge_l(list("abcd"), list("dcba")) == pytest.approx(0.25)
    assert rouge_l([], []) == 1.0
    assert rouge_l(["a"], []) == 0.0
    assert rouge_l(["a"], ["b"]) == 0.0
    assert words("Don't PANIC: 42!") == ["don", "t", "panic", "42"]


@given(
    st.lists(st.integers(0, 3), max_size=7),
    st.lists(st.integers(0, 3), min_size=1, max_size=7),
)
def test_rouge_l_is_the_f_measure_of_the_longest_common_subsequence(a, b):
    lcs = brute_force_lcs(a, b)
    expected = 0.0 if lcs == 0 else 2 * lcs / (len(a) + len(b))  # F1 of lcs/|a| and lcs/|b|
    assert rouge_l(a, b) == pytest.approx(expected)


def records(figures: dict[str, list[dict]]) -> list[dict]:
    """Run records as ``ablation_metrics`` builds them, from per-repeat figures."""
    return [
        {"config": config, "repeat": k, "figures": f}
        for config, per_repeat in figures.items()
        for k, f in enumerate(per_repeat)
    ]


def figures(latency: float, throughput: float, eta: float) -> dict:
    return {"latency_per_token": latency, "throughput": throughput, "eta_cpu": eta, "quality": 1.0}


def test_super_additivity_compares_the_full_system_with_its_layers_compounded():
    base = [figures(1.0, 100.0, 1.0), figures(1.1, 90.0, 1.0)]
    runs = records(
        {
            "baseline": base,
            # each single layer: latency 0.8x (a speed-up of 1.25x), throughput 1.1x, eta 1.02x
            **{
                c: [
                    figures(0.8 * b["latency_per_token"], 1.1 * b["throughput"], 1.02) for b in base
                ]
                for c in ("sampling", "scheduling", "attention")
            },
            # full: latency 0.5x (speed-up 2.0, more than 1.25^3 = 1.95), throughput 1.2x (less
            # than 1.1^3 = 1.331), eta 1.08x and 1.04x (1.02^3 = 1.061 between them)
            "full": [figures(0.5, 120.0, 1.08), figures(0.55, 108.0, 1.04)],
        }
    )
    result = super_additivity(runs)
    assert result["latency"]["full"]["mean"] == pytest.approx(2.0)
    assert result["latency"]["compounded"]["mean"] == pytest.approx(1.25**3)
    assert result["latency"]["excess"]["mean"] == pytest.approx(2.0 / 1.25**3)
    assert result["latency"]["singles"]["attention"]["mean"] == pytest.approx(1.25)
    assert result["latency"]["verdict"] == "super-additive"
    assert result["throughput"]["verdict"] == "sub-additive"
    assert result["eta"]["verdict"] == "not distinguishable from additive"
    assert result["quality"]["full"]["mean"] == pytest.approx(1.0)  # quality is a column too
    # Every layer loses; the full system loses less than their product, which is still no gain.
    for run in runs:
        if run["config"] != "baseline":
            run["figures"]["throughput"] = 0.9 * 100.0 if run["repeat"] == 0 else 0.95 * 90.0
    assert super_additivity(runs)["throughput"]["verdict"].startswith("no gain")
    # As a result's figures: three per column, above 1 better.
    found = additivity_figures(result, {"workload": "mixed"})
    excess = next(f for f in found if f.subject == "super-additivity excess")
    assert excess.labels == {"workload": "mixed", "column": "latency"} and excess.n == 2
    assert len(found) == 3 * len(result)
    # A run without a single layer has nothing to compare.
    assert super_additivity([r for r in runs if r["config"] != "scheduling"]) is None


def test_summary_pairs_ratios_by_repeat_and_calls_out_only_clear_differences():
    base = [{"kv": 10.0, "lat": 1.0}, {"kv": 30.0, "lat": 2.0}]
    runs = records(
        {
            "baseline": base,
            "attention": [{"kv": 5.0, "lat": 1.01}, {"kv": 15.0, "lat": 1.9}],
        }
    )
    summary = summarize_runs(runs)
    kv = summary["attention"]["kv"]
    # Paired by repeat, the ratio is exactly 0.5 though the absolute values spread widely.
    assert kv["relative"]["mean"] == pytest.approx(0.5)
    assert kv["relative"]["max"] - kv["relative"]["min"] == pytest.approx(0.0)
    assert kv["absolute"]["mean"] == pytest.approx(10.0)
    # Below 1 in both repeats, but by less than the baseline's own run-to-run variation.
    assert not kv["relative"]["significant"]
    assert not summary["attention"]["lat"]["relative"]["significant"]  # 1.01 and 0.95
    steady = records(
        {
            "baseline": [{"kv": 10.0}, {"kv": 10.2}],
            "attention": [{"kv": 5.0}, {"kv": 5.2}],
        }
    )
    assert summarize_runs(steady)["attention"]["kv"]["relative"]["significant"]


@pytest.fixture
def restore_threads():
    """The benchmark sets torch's thread count; later tests get theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_quick_run_end_to_end(loaded_model, tmp_path, restore_threads):
    parser = argparse.ArgumentParser()
    ablation.add_command(parser.add_subparsers())
    args = parser.parse_args(
        [
            "ablation",
            "--quick",
            "--threads",
            "2",
            "--quantization",
            "none",
            "--output",
            str(tmp_path),
        ]
    )
    figures, report = ablation.run(args, loaded_model)

    for name in ("ablation.json", "ablation.md", "ablation_bars.png", "ablation_trace.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert json.loads((tmp_path / "ablation.json").read_text())["settings"] == report["settings"]
    markdown = (tmp_path / "ablation.md").read_text()
    for label in LABELS.values():
        assert f"| {label} |" in markdown
    assert "| Baseline | 1.00 | 1.00 | 1.00 | 1.00 |" in markdown
    assert f"'min_context': {ablation.QUICK_MIN_CONTEXT}" in markdown  # says it lowered it
    assert set(report["super_additivity"]) == {"latency", "throughput", "eta", "quality"}

    # The result's figures: super-additivity per column (three factors each), then Table 1,
    # each column per arm, and its ratio to the baseline.
    compounding = [f for f in figures if "column" in f.labels]
    assert {f.labels["column"] for f in compounding} == set(report["super_additivity"])
    assert len(compounding) == 3 * 4
    figures = [f for f in figures if f not in compounding]
    arms = {f.labels["arm"] for f in figures}
    assert arms == {"baseline", "sampling", "scheduling", "attention", "full", "etinfer full"}
    # and beside them the figures that explain them (the likelihood needs ``long-scored``).
    columns = {"latency", "throughput", "eta", "quality"}
    explaining = set(EXPLAINING) - {"perplexity of the forced human text"}
    assert {f.subject for f in figures} == columns | explaining
    ratios = [f for f in figures if f.unit == "x"]
    assert all(f.labels["vs"] == "baseline" and f.labels["quick"] for f in ratios)
    assert len([f for f in ratios if f.subject in columns]) == 4 * 5  # none for the baseline

    runs = {r["config"]: r for r in report["runs"]}
    assert list(runs) == list(ablation.CONFIGS)
    fig = {config: run["figures"] for config, run in runs.items()}
    base = fig["baseline"]
    workload = report["workload"]
    assert base["output_tokens"] == sum(r["output_tokens"] for r in workload)
    assert {r["task"] for r in workload} == {
        "retrieval",
        "continuation",
        "free",
        "instruction",
        "chat",
    }

    # Attention: only the pruning configurations read less of the cache.
    for config in ("attention", "full"):
        assert fig[config]["kv_bytes_per_token"] < 0.8 * base["kv_bytes_per_token"]
        assert fig[config]["attn_flops_per_token"] < base["attn_flops_per_token"]
    # The meter's count of a dense context agrees with the pruning telemetry's (same schedule).
    assert fig["attention"]["decode_pairs_in_context"] == base["decode_pairs_in_context"]
    for config in ("baseline", "sampling", "scheduling"):
        assert fig[config]["kv_read_share"] == 1.0
        assert fig[config]["kv_bytes_per_token"] == base["kv_bytes_per_token"]

    # Sampling: only the entropy-controlled configurations move the temperature of sampled
    # requests, and greedy answers do not change (the same schedule, so the same batches).
    for config in ("sampling", "full"):
        assert fig[config]["sampled_temperature_sd"] > 0.01
    for config in ("baseline", "scheduling", "attention"):
        assert fig[config]["sampled_temperature_mean"] == 1.0
        assert fig[config]["sampled_temperature_sd"] == 0.0
    assert runs["sampling"]["greedy_answers"] == runs["baseline"]["greedy_answers"]
    assert fig["sampling"]["rouge_l_baseline"] == 1.0

    # Scheduling: only the entropy policy changes the order in which requests are admitted.
    for config in ("scheduling", "full"):
        assert runs[config]["admission_order"] != runs["baseline"]["admission_order"]
    for config in ("sampling", "attention"):
        assert runs[config]["admission_order"] == runs["baseline"]["admission_order"]

    trace = report["trace"]
    request = workload[trace["request"]]
    assert trace["task"] == request["task"] == "free"
    assert len(trace["temperatures"]) == len(trace["entropies"]) == request["output_tokens"]
    assert len(trace["blocks_kept"]) == request["output_tokens"] - 1  # the first: from prefill


@pytest.mark.slow
def test_a_run_of_some_arms_compares_them_to_the_baseline(loaded_model, tmp_path, restore_threads):
    """Two arms on the scored long workload (a passkey, a continuation and a likelihood
    request in quick mode), in a closed loop of 4 clients (their throughput is their
    capacity)."""
    parser = argparse.ArgumentParser()
    ablation.add_command(parser.add_subparsers())
    argv = ["ablation", "--quick", "--threads", "2", "--quantization", "none", "--concurrency"]
    argv += ["4", "--workload", "long-scored", "--output", str(tmp_path)]
    argv += ["--arms", "baseline", "attention"]
    figures, report = ablation.run(parser.parse_args(argv), loaded_model)
    base, pruned = report["runs"]
    assert [len(base["cases"][m]) for m in ("passkey", "rouge_l_human", "likelihood")] == [1, 1, 1]
    assert 1.0 < base["figures"]["likelihood_perplexity"] < 1000  # 12 forced human tokens
    assert base["figures"]["quality"] == base["figures"]["quality_low"] == 1.0
    low, high = pruned["figures"]["quality_low"], pruned["figures"]["quality_high"]
    assert low <= pruned["figures"]["quality"] <= high
    assert {f.labels["arm"] for f in figures} == {"baseline", "attention"}
    assert all(f.labels["arms"] == "baseline attention" for f in figures)  # not a Table 1
    assert all(f.labels["concurrency"] == 4 for f in figures)
    assert "--concurrency 4" in report["settings"]["command"]
    assert report["super_additivity"] is None and report["trace"] is None
    assert "--arms baseline attention" in report["settings"]["command"]
    assert "Not measured: the run left out" in (tmp_path / "ablation.md").read_text()
    with pytest.raises(ValueError, match="--arms must include baseline"):
        ablation.run(parser.parse_args([*argv[:-3], "--arms", "attention"]), loaded_model)


def test_the_scored_long_workload_has_sixty_cases_at_every_depth(loaded_model):
    requests = mixed_workload.build(
        loaded_model.tokenizer, "long-scored", mixed_workload.LONG, seed=0
    )
    tasks = Counter(r.task for r in requests)
    assert tasks == {"retrieval": 30, "continuation": 18, "likelihood": 18}
    assert {len(r.prompt) for r in requests} <= set(range(4096, 7681))
    retrievals = [r for r in requests if r.task == "retrieval"]
    assert len({tuple(r.prompt) for r in retrievals}) == 30  # six needles at each depth
    for r in requests:
        if r.task == "likelihood":  # the human text that follows, forced, its log-probs kept
            twin = next(c for c in requests if c.task == "continuation" and c.prompt == r.prompt)
            assert r.forced == twin.reference[:64] and r.params.max_tokens == 64
            assert r.params.logprobs == 0 and r.params.greedy


def test_the_quality_interval_is_a_paired_bootstrap_over_the_cases():
    base = {
        "passkey": [1.0, 1.0, 0.0, 1.0],
        "rouge_l_human": [0.2, 0.3],
        "likelihood": [-2.0, -3.0],
    }
    assert quality_score(base, base) == 1.0 and quality_interval(base, base) == (1.0, 1.0)
    worse = {
        "passkey": [1.0, 0.0, 0.0, 1.0],
        "rouge_l_human": [0.1, 0.3],
        "likelihood": [-2.1, -3.1],
    }
    expected = (2 / 3 + 0.4 / 0.5 + math.exp(-0.1)) / 3
    assert quality_score(worse, base) == pytest.approx(expected)
    low, high = quality_interval(worse, base)
    assert low < expected < high <= 1.0  # never better than the baseline on any draw


def test_goodput_counts_the_requests_that_meet_the_objective():
    from etinfer.bench.common.driver import RequestRecord
    from studies.ablation import goodput

    objective = goodput.Objective(ttft_s=1.0, tpot_s=0.1, target=0.5)
    met = RequestRecord(output_tokens=11, ttft=0.5, e2e=1.4)  # TPOT 0.09
    slow = RequestRecord(output_tokens=11, ttft=0.5, e2e=2.5)  # TPOT 0.2
    late = RequestRecord(output_tokens=1, ttft=1.5, e2e=1.5)
    failed = RequestRecord(error="refused")
    records = [met, slow, late, failed, RequestRecord(output_tokens=1, ttft=0.2, e2e=0.2)]
    assert goodput.attainment(records, objective) == pytest.approx(2 / 5)
    assert goodput.goodput(records, 4.0, objective) == pytest.approx(0.5)
    assert goodput.sustained_rate({0.1: 1.0, 0.2: 0.6, 0.4: 0.3}, 0.5) == 0.2
    assert goodput.sustained_rate({0.1: 0.4}, 0.5) is None
    with pytest.raises(ValueError, match="slo-target"):
        goodput.Objective(1.0, 1.0, 1.5)
    with pytest.raises(ValueError, match="ttft_s"):
        goodput.Objective(0.0, 1.0, 0.9)


@pytest.mark.slow
def test_a_rate_sweep_reports_each_arms_sustained_rate(loaded_model, tmp_path, restore_threads):
    parser = argparse.ArgumentParser()
    ablation.add_command(parser.add_subparsers())
    argv = ["ablation", "--quick", "--threads", "2", "--arms", "baseline", "sampling"]
    argv += ["--output", str(tmp_path), "--sweep-rates", "0.05", "50"]
    lax = ["--slo-ttft", "1000", "--slo-tpot", "1000"]
    figures, report = ablation.run(parser.parse_args([*argv, *lax]), loaded_model)
    assert report["sustained"] == {"baseline": 50, "sampling": 50} and not report["notes"]
    rated = {(f.labels["arm"], f.labels["rate"]) for f in figures if f.subject == "goodput"}
    assert rated == {(a, r) for a in ("baseline", "sampling") for r in (0.05, 50)}
    strict = ["--sweep-rates", "50", "--slo-ttft", "0.001"]
    _, report = ablation.run(parser.parse_args([*argv[:-3], *strict]), loaded_model)
    assert report["sustained"] == {"baseline": None, "sampling": None}
    assert "the lowest rate swept (50.0 req/s) already misses the SLO: 0 %" in report["notes"][0]
    with pytest.raises(ValueError, match="without --rate or --concurrency"):
        ablation.run(parser.parse_args([*argv, "--concurrency", "2"]), loaded_model)


def test_a_closed_loop_says_how_many_of_its_requests_wait_in_the_queue():
    assert ablation.closed_loop_note(8, 28, 16) is None  # every one in flight runs
    assert ablation.closed_loop_note(24, 28, 16).endswith("up to 8 of them wait in the queue")
    # More clients than requests: only the requests there are can wait.
    note = ablation.closed_loop_note(64, 28, 16)
    assert "all 28 requests are sent at once" in note
    assert note.endswith("up to 12 of them wait in the queue")
    assert ablation.closed_loop_note(64, 12, 16) is None
