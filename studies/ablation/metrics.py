"""The ablation's figures: per run, against the baseline, and across repeats.

Per run (``run_figures``), with "output tokens" every token a request decoded (a retrieval
question's forced tokens included: they are decode steps like any other):

- latency: end-to-end time per output token, averaged over requests (the paper's "latency");
  end-to-end, TTFT, TPOT and queue time as ``bench serving`` computes them;
- throughput: output tokens per second of the run (first arrival to last completion);
- entropy (DESIGN.md section 1): entropic time ``tau`` is the sum over requests of
  ``sum_t max(0, H_{t-1} - H_t)``, with ``H`` the model's entropy at temperature 1 (nats). The
  collapse rate is ``tau`` per output token. ``eta`` is ``tau`` per unit of compute, with two
  cost measures: ``eta_cpu``, per CPU-second this process spent stepping the engine (what the
  machine spent, whatever else ran on it: the run uses one torch thread), and ``eta_flops``, per
  TFLOP of model compute (``ablation_runner.StepMeter``);
- work: decode attention FLOPs and KV bytes read per decode step, the share of the context's
  KV blocks decode attention read, model FLOPs per output token, KV pool use (mean and peak
  share of blocks held); the batches' make-up (the share of stepping CPU time in steps with a
  prompt chunk, decode rows per step, running sequences a step left out);
- quality: passkey accuracy; ROUGE-L of greedy continuations against the human-written text
  that follows them; for sampled text, loop rate and distinct-n (``bench/common/quality.py``), and
  the spread of the entropy it was drawn at.

Against the baseline of the same repeat (``study``): ROUGE-L of each configuration's greedy
answers against the baseline's, and the ratio of every figure. The quality score of Table 1 is
the mean of the ratios of the ground-truth metrics (passkey accuracy, ROUGE-L against human
text, and on ``long-scored`` the perplexity of forced human text), skipping one the baseline
scores 0 on; a workload with neither (``chat``) uses ROUGE-L against the baseline. Its 95 %
interval (``quality_low``, ``quality_high``) is a paired bootstrap over the repeat's cases.

Across repeats: mean, standard deviation, minimum and maximum. A ratio is called out as a real
difference when every repeat's ratio lies on the same side of 1 and the mean moves further from
1 than the baseline's own run-to-run variation (its coefficient of variation) on that figure.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from etinfer.bench.common.results import Figure
from etinfer.bench.common.serving_metrics import summarize
from etinfer.bench.common.stats import mean
from etinfer.model.tokenizer import Tokenizer
from studies.common import quality
from studies.common.mixed_workload import AblationRequest, answers
from studies.common.quality import (
    case_figures,
    case_scores,
    quality_interval,
    quality_score,
    rouge_l,
    words,
)

if TYPE_CHECKING:
    from studies.ablation.runner import Run

# Table 1's columns: the figure each reads, and whether a gain is a lower value.
TABLE1 = {
    "latency": ("latency_per_token", True),
    "throughput": ("throughput", False),
    "eta": ("eta_cpu", False),
    "quality": ("quality", False),
}
SINGLE_LAYERS = ("sampling", "scheduling", "attention")
# Table 1's columns as a result carries them: unit, and multiplier from the stored value.
UNITS = {
    "latency": ("ms", 1e3),
    "throughput": ("tok/s", 1),
    "eta": ("nats/s", 1),
    "quality": ("", 1),
}
# Beside Table 1's columns, what explains them: (figure, unit, multiplier) by subject.
EXPLAINING = {
    "time per output token": ("tpot_mean", "ms", 1e3),
    "time to first token": ("ttft_mean", "s", 1),
    "cpu time stepping": ("cpu_s", "s", 1),
    "kv read per decode step": ("kv_bytes_per_token", "MB", 1e-6),
    "cpu share of steps with a prompt chunk": ("prompt_step_cpu_share", "%", 100),
    "running sequences left out per step": ("left_out_per_step", "", 1),
    "passkey accuracy": ("passkey_accuracy", "%", 100),
    "rouge-l against the human text": ("rouge_l_human", "", 1),
    "perplexity of the forced human text": ("likelihood_perplexity", "", 1),
}
# What the step meter says of the batches' make-up.
BATCH_MAKE_UP = ("prompt_step_cpu_share", "decode_rows_per_step", "left_out_per_step")
# The arms' names in a result: Table 1's rows, and ours.
ARMS = {"etinfer": "etinfer full"}


def run_figures(requests: list[AblationRequest], run: Run, tokenizer: Tokenizer) -> dict:
    """Every per-run figure of the module docstring, plus the answers and admission order."""
    outs = run.outputs
    latency = summarize(run.records, run.makespan)
    tokens = sum(len(o.token_ids) for o in outs)
    tau = sum(o.entropic_time for o in outs)
    answered = answers(requests, outs, tokenizer.eos_token_ids)
    cases = case_scores(requests, answered, tokenizer, outs)
    sampled = [i for i, r in enumerate(requests) if not r.greedy]
    figures = {
        "latency_per_token": statistics.fmean(r.e2e / r.output_tokens for r in run.records),
        **{k: latency[k] for k in ("e2e_mean", "e2e_p99", "ttft_mean", "tpot_mean", "queue_mean")},
        "throughput": tokens / run.makespan,
        "makespan_s": run.makespan,
        "cpu_s": run.cpu,
        # Wall-clock figures, as measured on a machine other jobs may share.
        "e2e_mean_wall": statistics.fmean(o.metrics.total_time for o in outs),
        "throughput_wall": tokens / run.wall,
        "wall_s": run.wall,
        "output_tokens": tokens,
        "entropic_time": tau,
        "collapse_rate": tau / tokens,
        "eta_cpu": tau / run.cpu,
        "eta_flops": tau / (run.work["model_flops"] / 1e12),
        "model_flops_per_token": run.work["model_flops"] / tokens,
        **{k: run.work[k] for k in ("attn_flops_per_token", "kv_bytes_per_token")},
        **{k: run.work[k] for k in ("kv_read_share", "kv_pool_mean", "kv_pool_peak")},
        **{k: run.work[k] for k in BATCH_MAKE_UP},
        "decode_pairs_in_context": run.work["decode_pairs_in_context"],
        "preemptions": run.preemptions,
        "recomputed_tokens": run.recomputed_tokens,
        **case_figures(cases),
        **_sampled_figures([outs[i] for i in sampled], [answered[i] for i in sampled]),
    }
    order = sorted(range(len(outs)), key=lambda i: outs[i].metrics.first_scheduled_time)
    return {
        "config": run.config,
        "repeat": run.repeat,
        "load": list(run.load),
        "figures": figures,
        "cases": cases,
        "admission_order": order,
        "greedy_answers": {
            str(i): tokenizer.decode(a) for i, a in enumerate(answered) if requests[i].greedy
        },
    }


def _sampled_figures(outs: list, answers: list[list[int]]) -> dict:
    if not outs:
        return {}
    entropies = [h for o in outs for h in o.tempered_entropies]
    temperatures = [t for o in outs for t in o.temperatures]
    return {
        "loop_rate": quality.loop_rate(answers),
        "distinct_2": quality.distinct_n(answers, 2),
        "distinct_3": quality.distinct_n(answers, 3),
        "sampled_entropy_mean": statistics.fmean(entropies),
        "sampled_entropy_sd": statistics.pstdev(entropies),
        "sampled_temperature_mean": statistics.fmean(temperatures),
        "sampled_temperature_sd": statistics.pstdev(temperatures),
    }


def add_baseline_comparisons(records: list[dict]) -> None:
    """ROUGE-L against the baseline's greedy answers of the same repeat, and the quality score,
    into each record's figures."""
    baselines = {r["repeat"]: r for r in records if r["config"] == "baseline"}
    for record in records:
        base = baselines[record["repeat"]]
        ours = record["figures"]
        ours["rouge_l_baseline"] = answers_rouge(record, base)
        score = quality_score(record["cases"], base["cases"])
        ours["quality"] = ours["rouge_l_baseline"] if score is None else score
        interval = quality_interval(record["cases"], base["cases"])
        if interval is not None:  # this repeat's cases drawn again: the score's own noise
            ours["quality_low"], ours["quality_high"] = interval


def answers_rouge(record: dict, base: dict) -> float | None:
    pairs = [(a, base["greedy_answers"][i]) for i, a in record["greedy_answers"].items()]
    return mean([rouge_l(words(a), words(b)) for a, b in pairs])


def spread(values: list[float]) -> dict:
    return {
        "mean": statistics.fmean(values),
        "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def summarize_runs(records: list[dict]) -> dict:
    """Per configuration and figure: the spread of the absolute values, and of the ratios to
    the baseline of the same repeat, with whether the difference stands out of the noise."""
    baselines = {r["repeat"]: r["figures"] for r in records if r["config"] == "baseline"}
    configs = list(dict.fromkeys(r["config"] for r in records))
    noise = _baseline_cv(records)
    summary: dict = {}
    for config in configs:
        runs = [r for r in records if r["config"] == config]
        summary[config] = {}
        for name in runs[0]["figures"]:
            values = [r["figures"][name] for r in runs if r["figures"][name] is not None]
            if not values:
                continue
            entry = {"absolute": spread(values)}
            ratios = [
                r["figures"][name] / baselines[r["repeat"]][name]
                for r in runs
                if r["figures"][name] is not None and baselines[r["repeat"]].get(name)
            ]
            if ratios:
                entry["relative"] = spread(ratios)
                entry["relative"]["significant"] = _stands_out(ratios, noise.get(name, 0.0))
            summary[config][name] = entry
    return summary


def _baseline_cv(records: list[dict]) -> dict[str, float]:
    """Coefficient of variation of each baseline figure across repeats."""
    runs = [r["figures"] for r in records if r["config"] == "baseline"]
    cv = {}
    for name in runs[0]:
        values = [f[name] for f in runs if f[name] is not None]
        if len(values) > 1 and statistics.fmean(values):
            cv[name] = statistics.stdev(values) / abs(statistics.fmean(values))
    return cv


def _stands_out(ratios: list[float], cv: float) -> bool:
    same_side = all(r > 1 for r in ratios) or all(r < 1 for r in ratios)
    return len(ratios) > 1 and same_side and abs(statistics.fmean(ratios) - 1) > cv


def baseline_self_rouge(records: list[dict]) -> float | None:
    """ROUGE-L of the baseline's greedy answers in later repeats against the first: the noise
    floor of ``rouge_l_baseline`` (batches differ from run to run, and so can near-ties)."""
    base = sorted((r for r in records if r["config"] == "baseline"), key=lambda r: r["repeat"])
    return mean([answers_rouge(r, base[0]) for r in base[1:]])


def trace(requests: list[AblationRequest], runs: list[Run], config: str = "full") -> dict | None:
    """One sampled request's entropy, temperature and blocks kept under ``config`` (the first
    repeat), with the baseline's for the same request; a long-context one if there is one."""
    sampled = [i for i, r in enumerate(requests) if not r.greedy]
    if not sampled:
        return None
    index = next((i for i in sampled if requests[i].task == "free"), sampled[0])
    first = {r.config: r for r in runs if r.repeat == 0}
    ours, base = first[config].outputs[index], first["baseline"].outputs[index]
    return {
        "request": index,
        "task": requests[index].task,
        "prompt_tokens": len(requests[index].prompt),
        "config": config,
        "entropies": ours.entropies,
        "tempered_entropies": ours.tempered_entropies,
        "temperatures": ours.temperatures,
        "blocks_kept": ours.blocks_kept,
        "baseline_entropies": base.entropies,
        "baseline_temperatures": base.temperatures,
    }


def study(
    requests: list[AblationRequest], runs: list[Run], tokenizer: Tokenizer, settings: dict
) -> dict:
    """The whole report: settings, workload, every run, the summary and the verdicts."""
    records = [run_figures(requests, run, tokenizer) for run in runs]
    add_baseline_comparisons(records)
    ran = {run.config for run in runs}
    return {
        "settings": settings,
        "workload": [
            {
                "task": r.task,
                "arrival_s": r.arrival_s,
                "prompt_tokens": len(r.prompt),
                "output_tokens": r.params.max_tokens,
            }
            for r in requests
        ],
        "runs": records,
        "summary": summarize_runs(records),
        "baseline_self_rouge": baseline_self_rouge(records),
        "trace": trace(requests, runs) if "full" in ran else None,
    }


def table1_figures(summary: dict, labels: dict) -> list[Figure]:
    """Table 1 as figures, and the figures that explain it (``EXPLAINING``): per arm and
    column, the mean over the repeats with its sd, and the mean of the ratios to the baseline
    of the same repeat with theirs."""
    found = []
    columns = {column: (name, *UNITS[column]) for column, (name, _) in TABLE1.items()}
    for config, entries in summary.items():
        arm = {"arm": ARMS.get(config, config)} | labels
        for column, (name, unit, scale) in (columns | EXPLAINING).items():
            entry = entries.get(name)
            if entry is None:
                continue
            absolute = entry["absolute"]
            sd = {"sd": scale * absolute["sd"]}
            found.append(Figure(column, scale * absolute["mean"], unit, arm, sd, absolute["n"]))
            relative = entry.get("relative")
            if relative is not None and config != "baseline":
                versus = arm | {"vs": "baseline"}
                sd = {"sd": relative["sd"]}
                if column == "quality" and "quality_low" in entries:  # over the cases
                    sd["ci95"] = [
                        entries[f"quality_{e}"]["absolute"]["mean"] for e in ("low", "high")
                    ]
                found.append(Figure(column, relative["mean"], "x", versus, sd, relative["n"]))
    return found
