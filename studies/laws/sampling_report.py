"""The sampling study's table (``sampling.md``) and the figures its result carries: per sampler
the entropy it samples from, its tracking error, temperature and text quality; per batch and
estimator the share of a decode step the estimate costs; per estimator its error against the
exact entropy."""

from __future__ import annotations

from etinfer.bench.common.results import Figure

SAMPLER_COLUMNS = {
    "entropy mean": ("entropy_mean", ".2f"),
    "sd": ("entropy_sd", ".2f"),
    "tracking MAE": ("tracking_mae", ".2f"),
    "mean T": ("temperature_mean", ".2f"),
    "loop rate": ("loop_rate", ".3f"),
    "distinct-2": ("distinct_2", ".3f"),
    "distinct-3": ("distinct_3", ".3f"),
    "rep-2": ("rep_2", ".3f"),
    "rep-3": ("rep_3", ".3f"),
    "rep-4": ("rep_4", ".3f"),
    "self-BLEU": ("self_bleu", ".3f"),
    "hit max_tokens": ("max_tokens_rate", ".2f"),
}


def markdown(report: dict) -> str:
    lines = [
        "| sampler | " + " | ".join(SAMPLER_COLUMNS) + " |",
        "|---|" + "---:|" * len(SAMPLER_COLUMNS),
    ]
    for name, r in report["samplers"].items():
        cells = [format(r[key], spec) for key, spec in SAMPLER_COLUMNS.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| batch | estimator | ms | share of decode step |", "|---:|---|---:|---:|"]
    for r in report["overhead"]:
        lines.append(
            f"| {r['batch']} | {r['estimator']} | {r['ms']:.3f} | {100 * r['share']:.2f} % |"
        )
    lines += [
        "",
        "| k | estimator | correlation | mean abs error | max abs error | bracket holds "
        "| T differs > 1 % |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["fidelity"]:
        lines.append(
            f"| {r['k']} | {r['estimator']} | {r['correlation']:.4f} | {r['mean_abs_error']:.4f} "
            f"| {r['max_abs_error']:.3f} | {r['bracket_holds']:.3f} "
            f"| {r['temperature_differs_1pct']:.3f} |"
        )
    return "\n".join(lines)


def figures(report: dict) -> list[Figure]:
    found = []
    for name, r in report["samplers"].items():
        labels, n = {"arm": name}, r["tokens"]
        found += [
            Figure("entropy mae", r["tracking_mae"], "nats", labels, n=n),
            Figure("entropy", r["entropy_mean"], "nats", labels, {"sd": r["entropy_sd"]}, n),
            Figure("temperature", r["temperature_mean"], "", labels, n=n),
            Figure("loop rate", r["loop_rate"], "", labels),
            Figure("distinct-2", r["distinct_2"], "", labels),
        ]
    for r in report["overhead"]:
        labels = {"estimator": r["estimator"], "batch": r["batch"], "vs": "decode step"}
        found.append(Figure("estimator cost", 100 * r["share"], "%", labels))
    for r in report["fidelity"]:
        labels = {"estimator": r["estimator"], "k": r["k"], "vs": "exact"}
        found.append(Figure("estimator error", r["mean_abs_error"], "nats", labels))
    return found
