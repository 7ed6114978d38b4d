"""The ablation's outputs: ablation.json, ablation.md (Table 1, absolute figures, the
super-additivity check) and two plots (bars with spread; one request's traces)."""

from __future__ import annotations

import json
from pathlib import Path

from studies.ablation.metrics import SINGLE_LAYERS, TABLE1
from studies.common.plots import pyplot

LABELS = {
    "baseline": "Baseline",
    "sampling": "Sampling only",
    "scheduling": "Scheduling only",
    "attention": "Attention only",
    "full": "Full system",
    "etinfer": "etinfer full",
}
# The paper's Table 1 (section 6.9): latency, throughput, eta, quality.
PAPER = {
    "baseline": (1.00, 1.00, 1.00, 1.00),
    "sampling": (0.98, 1.02, 1.08, 1.00),
    "scheduling": (0.88, 1.15, 1.12, 1.00),
    "attention": (0.85, 1.20, 1.25, 0.98),
    "full": (0.70, 1.40, 1.55, 1.00),
    "etinfer": (None, None, None, None),  # not in the paper: every layer we have that keeps quality
}
# Figure: (label, unit, multiplier from the stored SI value).
FIGURES = {
    "latency_per_token": ("latency per output token", "ms", 1e3),
    "e2e_mean": ("end-to-end latency, mean", "s", 1),
    "e2e_p99": ("end-to-end latency, p99", "s", 1),
    "ttft_mean": ("time to first token, mean", "s", 1),
    "tpot_mean": ("time per output token after the first, mean", "ms", 1e3),
    "queue_mean": ("queue time, mean", "s", 1),
    "throughput": ("throughput (output tokens / run time)", "tok/s", 1),
    "makespan_s": ("run time (first arrival to last completion)", "s", 1),
    "cpu_s": ("CPU time stepping the engine", "s", 1),
    "e2e_mean_wall": ("end-to-end latency, mean, wall clock", "s", 1),
    "throughput_wall": ("throughput, wall clock", "tok/s", 1),
    "wall_s": ("run time, wall clock", "s", 1),
    "collapse_rate": ("entropy collapse rate (tau per output token)", "nats", 1),
    "entropic_time": ("entropic time tau, summed over requests", "nats", 1),
    "eta_cpu": ("eta: tau per CPU-second of stepping", "nats/s", 1),
    "eta_flops": ("eta: tau per TFLOP of model compute", "nats/TFLOP", 1),
    "model_flops_per_token": ("model FLOPs per output token", "GFLOP", 1e-9),
    "attn_flops_per_token": ("decode attention FLOPs per decode step", "MFLOP", 1e-6),
    "kv_bytes_per_token": ("KV bytes read per decode step", "MB", 1e-6),
    "kv_read_share": ("share of context KV blocks read by decode", "%", 100),
    "kv_pool_mean": ("KV pool held, mean over steps", "%", 100),
    "kv_pool_peak": ("KV pool held, peak", "%", 100),
    "prompt_step_cpu_share": ("stepping CPU time in steps with a prompt chunk", "%", 100),
    "decode_rows_per_step": ("decode rows per step, mean", "", 1),
    "left_out_per_step": ("running sequences a step left out, mean", "", 1),
    "preemptions": ("preemptions", "", 1),
    "passkey_accuracy": ("passkey retrieval accuracy", "%", 100),
    "rouge_l_human": ("ROUGE-L of greedy continuations vs the human text", "", 1),
    "rouge_l_baseline": ("ROUGE-L of greedy answers vs the baseline's", "", 1),
    "quality": ("quality score (Table 1)", "", 1),
    "quality_low": ("quality score, low end of its 95 % interval (cases drawn again)", "", 1),
    "quality_high": ("quality score, high end of its 95 % interval", "", 1),
    "likelihood_perplexity": ("perplexity of the forced human text", "", 1),
    "loop_rate": ("loop rate of sampled text", "", 1),
    "distinct_2": ("distinct-2 of sampled text", "", 1),
    "distinct_3": ("distinct-3 of sampled text", "", 1),
    "sampled_entropy_mean": ("entropy sampled at, mean", "nats", 1),
    "sampled_entropy_sd": ("entropy sampled at, standard deviation", "nats", 1),
    "sampled_temperature_mean": ("temperature of sampled tokens, mean", "", 1),
}
BARS = (
    "latency_per_token",
    "throughput",
    "eta_cpu",
    "quality",
    "e2e_mean",
    "kv_bytes_per_token",
    "collapse_rate",
    "eta_flops",
)


def write(report: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "ablation.json").write_text(json.dumps(report, indent=1))
    (out_dir / "ablation.md").write_text(markdown(report))
    plot_bars(report, out_dir / "ablation_bars.png")
    if report["trace"] is not None:
        plot_trace(report["trace"], out_dir / "ablation_trace.png")


def _ratio_cell(entry: dict | None) -> str:
    if entry is None or "relative" not in entry:
        return "-"
    r = entry["relative"]
    cell = f"{r['mean']:.2f}"
    if r["n"] > 1:
        cell += f" [{r['min']:.2f}-{r['max']:.2f}]"
    return f"**{cell}**" if r["significant"] else cell


def table1(summary: dict) -> str:
    """Laid out like the paper's Table 1: ratios to the baseline, mean of the repeats, their
    range in brackets, in bold where the difference stands out of the noise."""
    lines = [
        "| Configuration | Latency | Throughput | η | Quality |",
        "|---|---:|---:|---:|---:|",
    ]
    for config, figures in summary.items():
        cells = [_ratio_cell(figures.get(name)) for name, _ in TABLE1.values()]
        lines.append(f"| {LABELS[config]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paper_table(summary: dict) -> str:
    """Ours against the paper's, column by column (mean ratios)."""
    lines = [
        "| Configuration | Latency ours / paper | Throughput | η | Quality |",
        "|---|---:|---:|---:|---:|",
    ]
    for config, figures in summary.items():
        cells = []
        for (name, _), paper in zip(TABLE1.values(), PAPER[config], strict=True):
            entry = figures.get(name, {}).get("relative")
            ours = "-" if entry is None else f"{entry['mean']:.2f}"
            cells.append(f"{ours} / {'-' if paper is None else f'{paper:.2f}'}")
        lines.append(f"| {LABELS[config]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _number(value: float) -> str:
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}" if magnitude >= 0.01 or value == 0 else f"{value:.2e}"


def absolute_table(summary: dict) -> str:
    """Figures down, configurations across: mean ± sd over repeats, and the ratio to the
    baseline in parentheses."""
    configs = list(summary)
    lines = [
        "| figure | unit | " + " | ".join(LABELS[c] for c in configs) + " |",
        "|---|---|" + "---:|" * len(configs),
    ]
    for name, (label, unit, scale) in FIGURES.items():
        cells = []
        for config in configs:
            entry = summary[config].get(name)
            if entry is None:
                cells.append("-")
                continue
            a = entry["absolute"]
            cell = _number(a["mean"] * scale)
            if a["n"] > 1:
                cell += f" ± {_number(a['sd'] * scale)}"
            if config != "baseline" and "relative" in entry:
                cell += f" ({entry['relative']['mean']:.2f}×)"
            cells.append(cell)
        if any(c != "-" for c in cells):
            lines.append(f"| {label} | {unit} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def additivity_table(result: dict) -> str:
    lines = [
        "| column | full system | single layers compounded | "
        + " | ".join(LABELS[c] for c in SINGLE_LAYERS)
        + " | excess | verdict |",
        "|---|---:|---:|" + "---:|" * len(SINGLE_LAYERS) + "---:|---|",
    ]
    for column, r in result.items():
        singles = [_factor(r["singles"][c]) for c in SINGLE_LAYERS]
        lines.append(
            f"| {column} ({r['figure']}) | {_factor(r['full'])} | {_factor(r['compounded'])} | "
            + " | ".join(singles)
            + f" | {_factor(r['excess'])} | {r['verdict']} |"
        )
    return "\n".join(lines)


def _factor(s: dict) -> str:
    cell = f"{s['mean']:.3f}x"
    if s["n"] > 1:
        cell += f" [{s['min']:.3f}, {s['max']:.3f}]"
    return cell


def markdown(report: dict) -> str:
    s = report["settings"]
    tasks: dict[str, int] = {}
    for request in report["workload"]:
        tasks[request["task"]] = tasks.get(request["task"], 0) + 1
    loads = [load for run in report["runs"] for load in run["load"]]
    parts = [
        "# Ablation: the paper's Table 1, measured",
        f"- **Command:** `{s['command']}`",
        f"- **Date:** {s['date']}; **machine:** {s['machine']}; 1-minute load average "
        f"{min(loads):.1f}-{max(loads):.1f} during the runs",
        f"- **Workload:** `{s['workload']}`, {len(report['workload'])} requests "
        f"({', '.join(f'{n} {t}' for t, n in tasks.items())}), Poisson arrivals at "
        f"{s['rate']} req/s, {s['repeats']} repeat(s); engine {s['engine']}",
        f"- **Clock:** `{s['clock']}`: "
        + (
            "arrivals and latencies on this process's CPU time in engine steps (one torch "
            "thread), so other jobs on the machine do not move them; wall-clock figures below"
            if s["clock"] == "cpu"
            else "arrivals and latencies in wall-clock time"
        ),
        f"- **Pruning:** {s['pruning']}",
        f"- **Human references:** {s['references']}",
        "",
        "## Table 1 (relative to the baseline)",
        "",
        "Mean of the per-repeat ratios, their range in brackets; **bold**: every repeat on the "
        "same side of 1 and further from 1 than the baseline's own run-to-run variation. "
        "Latency: end-to-end time per output token. η: entropic time per CPU-second of engine "
        "stepping. Quality: mean ratio of passkey accuracy and ROUGE-L against human text.",
        "",
        table1(report["summary"]),
        "",
        "Against the paper's row values:",
        "",
        paper_table(report["summary"]),
        "",
        "## Absolute figures (mean ± sd over repeats; ratio to the baseline)",
        "",
        absolute_table(report["summary"]),
        "",
        "## Super-additivity (section 6.8)",
        "",
        "Gain factors over the baseline of the same repeat, above 1 where an arm helps: the "
        "ratio, inverted for latency (range over repeats in brackets). Compounded: the single "
        "layers' factors multiplied, what the full system would reach if they did not interact; "
        "excess: the full system's factor over that product (above 1: super-additive).",
        "",
        additivity_table(report["super_additivity"])
        if report["super_additivity"] is not None
        else "Not measured: the run left out the full system or a single layer.",
        "",
    ]
    if report["baseline_self_rouge"] is not None:
        parts.append(
            "Noise floor of ROUGE-L against the baseline: the baseline's own greedy answers, "
            f"repeat against repeat, score {report['baseline_self_rouge']:.3f}."
        )
    return "\n".join(parts) + "\n"


def plot_bars(report: dict, path: Path) -> None:
    """Per configuration, each figure relative to the baseline: the mean of the repeats and
    their range (error bars); the paper's values where it gives them."""
    plt = pyplot()
    summary = report["summary"]
    configs = list(summary)
    paper_columns = {name: i for i, (name, _) in enumerate(TABLE1.values())}
    fig, axes = plt.subplots(2, 4, figsize=(16, 7))
    for ax, name in zip(axes.flat, BARS, strict=True):
        means, low, high = [], [], []
        for config in configs:
            r = summary[config].get(name, {}).get("relative")
            mean = r["mean"] if r else float("nan")
            means.append(mean)
            # Clamped: a mean of equal ratios can land a rounding below their minimum.
            low.append(max(0.0, mean - r["min"]) if r else 0.0)
            high.append(max(0.0, r["max"] - mean) if r else 0.0)
        x = range(len(configs))
        ax.bar(x, means, yerr=[low, high], capsize=4, color="tab:blue", alpha=0.8, label="ours")
        if name in paper_columns:
            paper = [PAPER[c][paper_columns[name]] or float("nan") for c in configs]
            ax.scatter(x, paper, marker="_", s=400, color="tab:red", zorder=3, label="paper")
            ax.legend(fontsize=7)
        ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
        ax.set_xticks(list(x), [LABELS[c].replace(" ", "\n") for c in configs], fontsize=7)
        ax.set_title(FIGURES[name][0], fontsize=8)
        ax.set_ylabel("relative to baseline", fontsize=7)
    fig.suptitle(
        f"Ablation ({report['settings']['workload']} workload, "
        f"{report['settings']['repeats']} repeat(s); bars: mean, whiskers: range)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_trace(trace: dict, path: Path) -> None:
    """One sampled request under the full loop: entropy (with the baseline's), temperature and
    the share of KV blocks attention kept, step by step."""
    plt = pyplot()
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    top.plot(trace["baseline_entropies"], color="gray", linewidth=0.8, label="baseline, H (T=1)")
    top.plot(trace["entropies"], linewidth=1, label="full system, H (T=1)")
    top.plot(trace["tempered_entropies"], linewidth=1, label="full system, H sampled at")
    top.set_ylabel("entropy (nats)")
    top.legend(fontsize=8)
    middle.plot(trace["baseline_temperatures"], color="gray", linewidth=0.8, label="baseline")
    middle.plot(trace["temperatures"], linewidth=1, label="full system")
    middle.set_ylabel("temperature")
    middle.legend(fontsize=8)
    if trace["blocks_kept"]:
        # Decode step k produced token k + 1: the first token came from the prefill.
        steps = range(1, len(trace["blocks_kept"]) + 1)
        bottom.plot(steps, [100 * b for b in trace["blocks_kept"]], linewidth=1)
    bottom.set_ylabel("KV blocks read (%)")
    bottom.set_xlabel("output token")
    fig.suptitle(
        f"Request {trace['request']} ({trace['task']}, {trace['prompt_tokens']} prompt tokens) "
        f"under the {trace['config']} configuration"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
