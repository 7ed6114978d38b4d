"""The stress test's outputs: stress.json, stress.md (a table per arm, the refitted temperatures,
section 6.1's estimators, the newer layers), stress.png (figures against the stress, per arm,
with the spread over repeats), and the figures its result carries (those of the tables)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from etinfer.bench.common.results import Figure
from studies.common.plots import pyplot

# Column: (figure, header, format of the mean).
COLUMNS = {
    "kv_read_share": ("blocks read", "{:.1%}"),
    "efficiency_kept": ("saving kept", "{:.2f}"),
    "passkey_accuracy": ("passkey", "{:.0%}"),
    "rouge_l_baseline": ("ROUGE-L vs layers off", "{:.3f}"),
    "rouge_l_human": ("ROUGE-L vs human", "{:.3f}"),
    "decisions_changed": ("decisions changed", "{:.1%}"),
    "sampled_entropy_sd": ("entropy sd", "{:.3f}"),
    "sampled_temperature_mean": ("T mean", "{:.2f}"),
    "throughput_vs_layers_off": ("tok/s vs layers off", "{:.2f}"),
}


# The columns as a result carries them: figure -> (subject, unit, multiplier, reference).
FIGURES = {
    "kv_read_share": ("blocks read", "%", 100, None),
    "efficiency_kept": ("saving kept", "x", 1, "unstressed"),
    "passkey_accuracy": ("passkey accuracy", "%", 100, None),
    "rouge_l_baseline": ("rouge-l", "", 1, "layers off"),
    "rouge_l_human": ("rouge-l", "", 1, "human text"),
    "decisions_changed": ("decisions changed", "%", 100, None),
    "sampled_entropy_sd": ("entropy sd", "nats", 1, None),
    "sampled_temperature_mean": ("temperature", "", 1, None),
    "throughput_vs_layers_off": ("throughput", "x", 1, "layers off"),
}


def figures(report: dict) -> list[Figure]:
    """Per arm and stress, the tables' figures: the mean over the repeats with its sd; and
    each refitted calibration's temperature."""
    found = []
    for entry in report["summary"].values():
        labels = {"arm": entry["arm"], "stress": entry["stress"]}
        for name, (subject, unit, scale, reference) in FIGURES.items():
            value = entry["figures"].get(name)
            # Against the run itself (the layer-off arm against the layer-off engine, an
            # unstressed run against its arm unstressed) a ratio says nothing.
            unstressed = reference == "unstressed" and entry["stress"] == "none"
            if value is None or reference == entry["arm"] or unstressed:
                continue
            versus = labels if reference is None else labels | {"vs": reference}
            sd = {"sd": scale * value["sd"]}
            found.append(Figure(subject, scale * value["mean"], unit, versus, sd, value["n"]))
    for scale, calibration in report["calibrations"].items():
        labels = {"stress": "none" if scale == 1 else f"scale {scale:g}"}
        found.append(Figure("calibration temperature", calibration["temperature"], "", labels))
    return found


def write(report: dict, out: Path) -> None:
    (out / "stress.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "stress.md").write_text(markdown(report))
    plot(report, out / "stress.png")
    plot_estimators(report["summary"], out / "stress_estimators.png")


def cell(entry: dict | None, form: str) -> str:
    """The mean, and the range over repeats where there is one."""
    if entry is None:
        return "-"
    text = form.format(entry["mean"])
    if entry["n"] > 1 and entry["max"] > entry["min"]:
        text += f" ({form.format(entry['min'])}-{form.format(entry['max'])})"
    return text


def arm_table(summary: dict, arm: str) -> str:
    rows = [e for e in summary.values() if e["arm"] == arm]
    lines = [
        "| stress | " + " | ".join(h for h, _ in COLUMNS.values()) + " |",
        "|---|" + "---:|" * len(COLUMNS),
    ]
    for entry in rows:
        cells = [cell(entry["figures"].get(k), form) for k, (_, form) in COLUMNS.items()]
        lines.append(f"| {entry['stress']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def estimator_runs(summary: dict) -> dict[str, dict]:
    """Section 6.1's runs: each estimator driving the three layers with the default guards (the
    guarded arm unstressed is the tail estimator's run, where the guarded arm ran)."""
    runs = {"exact": summary["estimator exact | none"], "topk": summary["estimator topk | none"]}
    if "guards | none" in summary:
        runs["tail"] = summary["guards | none"]
    return runs


def estimator_table(summary: dict) -> str:
    runs = estimator_runs(summary)
    exact = runs["exact"]["figures"]
    lines = [
        "| estimator | blocks read | decisions changed | tok/s vs exact | passkey | "
        "ROUGE-L vs layers off |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, entry in runs.items():
        f = entry["figures"]
        ratio = f["throughput"]["mean"] / exact["throughput"]["mean"]
        lines.append(
            f"| {name} | {cell(f['kv_read_share'], '{:.1%}')} | "
            f"{cell(f.get('decisions_changed'), '{:.1%}')} | {ratio:.3f} | "
            f"{cell(f['passkey_accuracy'], '{:.0%}')} | "
            f"{cell(f['rouge_l_baseline'], '{:.3f}')} |"
        )
    return "\n".join(lines)


def calibration_table(calibrations: dict) -> str:
    lines = [
        "| logit scale | refitted T_cal | NLL before -> after | ECE before -> after |",
        "|---:|---:|---:|---:|",
    ]
    for scale, c in sorted(calibrations.items(), key=lambda kv: float(kv[0])):
        lines.append(
            f"| {float(scale):g} | {c['temperature']:.4f} | {c['nll_before']:.3f} -> "
            f"{c['nll_after']:.3f} | {c['ece_before']:.3f} -> {c['ece_after']:.3f} |"
        )
    return "\n".join(lines)


def layers_table(layers: dict) -> str:
    """Per layer, arm and stress: the means over repeats."""
    groups: dict[tuple, list[dict]] = {}
    for row in layers["rows"]:
        groups.setdefault((row["layer"], row["arm"], row["stress"]), []).append(row)
    walls = layers["reference_wall_s"]
    lines = [
        "| layer | arm | stress | drafts/token | accepted | tokens = plain | large share | "
        "passkey | ROUGE-L vs large | wall vs without the layer |",
        "|---|---|---|---:|---:|:---:|---:|---:|---:|---:|",
    ]
    for (layer, arm, stress), rows in groups.items():
        base = walls["plain" if layer == "speculative" else "large alone"]

        def avg(key: str, form: str, rows=rows) -> str:
            values = [r[key] for r in rows if r.get(key) is not None]
            return form.format(statistics.fmean(values)) if values else "-"

        equal = {r.get("tokens_equal_plain") for r in rows} - {None}
        lines.append(
            f"| {layer} | {arm} | {stress} | {avg('drafts_per_token', '{:.2f}')} | "
            f"{avg('acceptance', '{:.0%}')} | {'-' if not equal else 'yes' if all(equal) else 'NO'}"
            f" | {avg('large_share', '{:.0%}')} | {avg('passkey_accuracy', '{:.0%}')} | "
            f"{avg('rouge_l_large', '{:.3f}')} | "
            f"{statistics.fmean(r['wall_s'] for r in rows) / base:.2f} |"
        )
    return "\n".join(lines)


def markdown(report: dict) -> str:
    s = report["settings"]
    parts = [
        "# Calibration stress test (section 6.2) and estimators in the loop (section 6.1)",
        f"`{s['command']}`, {s['date']}, {s['machine']['processor']} "
        f"({s['machine']['torch_threads']} threads; CPU flags: {s['machine']['cpu_flags']}), "
        f"{s['repeats']} repeats: mean (min-max).",
        "'saving kept': the share of the arm's unstressed saving in blocks read that the stressed "
        "run keeps (above 1: it prunes harder). 'decisions changed': steps whose scheduling "
        "orders differ from those the unstressed exact signal gives (bench/stress/metrics.py).",
    ]
    for arm in report["arms"]:
        parts += [f"## {arm}", arm_table(report["summary"], arm)]
    parts += ["## Layers off", arm_table(report["summary"], "layers off")]
    parts += ["## Refitted calibration", calibration_table(report["calibrations"])]
    parts += ["## Estimators driving the three layers (6.1)", estimator_table(report["summary"])]
    if report["layers"]:
        parts += ["## Speculative drafting and EAD", layers_table(report["layers"])]
    return "\n\n".join(parts) + "\n"


PANELS = {
    "kv_read_share": "blocks read (share of context)",
    "passkey_accuracy": "passkey accuracy",
    "rouge_l_baseline": "ROUGE-L vs layers off",
    "decisions_changed": "scheduling decisions changed",
}


def plot(report: dict, path: Path) -> None:
    """Two rows (logit scale, entropy bias), a panel per figure, a line per arm."""
    plt = pyplot()
    summary = report["summary"]
    fig, axes = plt.subplots(2, len(PANELS), figsize=(4 * len(PANELS), 7), squeeze=False)
    for row, (kind, label) in enumerate((("scale", "logit scale"), ("bias", "entropy bias"))):
        for arm in report["arms"]:
            points = sorted(
                (x, e["figures"])
                for e in summary.values()
                if e["arm"] == arm and (x := _position(e["stress"], kind)) is not None
            )
            for col, name in enumerate(PANELS):
                ax = axes[row][col]
                have = [(x, f[name]) for x, f in points if name in f]
                xs = [x for x, _ in have]
                mid = [v["mean"] for _, v in have]
                low = [v["mean"] - v["min"] for _, v in have]
                high = [v["max"] - v["mean"] for _, v in have]
                ax.errorbar(xs, mid, yerr=[low, high], marker="o", capsize=3, label=arm)
        for col, name in enumerate(PANELS):
            axes[row][col].set_xlabel(label)
            axes[row][col].set_title(PANELS[name], fontsize=9)
            if kind == "scale":
                axes[row][col].set_xscale("log", base=2)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("The three layers under a stressed entropy signal (bench stress)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _position(stress: str, kind: str) -> float | None:
    """Where a stress point lies on the axis of ``kind``; the unstressed point lies on both."""
    if stress == "none":
        return 1.0 if kind == "scale" else 0.0
    name, _, value = stress.partition(" ")
    return float(value) if name == kind else None


NOTHING = {"mean": 0.0, "min": 0.0, "max": 0.0}


def plot_estimators(summary: dict, path: Path) -> None:
    """Section 6.1: per estimator, blocks read, decisions changed and throughput against exact."""
    plt = pyplot()
    runs = estimator_runs(summary)
    exact = runs["exact"]["figures"]["throughput"]["mean"]
    panels = {
        "blocks read (share of context)": [r["figures"]["kv_read_share"] for r in runs.values()],
        # No figure where the scheduler never had two sequences to order.
        "scheduling decisions changed": [
            r["figures"].get("decisions_changed", NOTHING) for r in runs.values()
        ],
        "throughput / exact's": [
            {k: v / exact if k in ("mean", "min", "max") else v
             for k, v in r["figures"]["throughput"].items()}
            for r in runs.values()
        ],
    }  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (title, entries) in zip(axes, panels.items(), strict=True):
        means = [e["mean"] for e in entries]
        spread = [[m - e["min"] for m, e in zip(means, entries, strict=True)],
                  [e["max"] - m for m, e in zip(means, entries, strict=True)]]  # fmt: skip
        ax.bar(list(runs), means, yerr=spread, capsize=4, color="#4c72b0")
        ax.set_title(title, fontsize=9)
    fig.suptitle("Estimators driving the three layers (section 6.1; bars: mean, whiskers: range)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
