"""The long-context benchmark's tables, its plot of attention entropy per head, and the figures
its result carries."""

from __future__ import annotations

from pathlib import Path

from etinfer.bench.common.results import Figure
from etinfer.control.sparse_prefill import AttentionProfile, SparsePrefillConfig
from studies.common.plots import pyplot

DENSE = {"vs": "dense"}


def figures(results: dict[str, dict], pressure: dict[str, dict]) -> list[Figure]:
    """Per arm and prompt length: time to first token, the share of dense prefill attention
    skipped, the decode rate, passkeys found; against dense (for the other arms) the time to
    first token, KV blocks held and the forced steps' agreement; under KV pressure, output
    tokens/s."""
    found = []
    for name, rows in results.items():
        for length, r in rows.items():
            labels = {"arm": name, "tokens": length}
            found += [
                Figure("ttft", r["ttft_s"], "s", labels),
                Figure("prefill attention skipped", 100 * r["skipped"], "%", labels),
                Figure("decode", r["decode_tok_s"], "tok/s", labels),
            ]
            hits = r.get("passkeys")
            if hits:
                found.append(Figure("passkeys found", sum(hits), "count", labels, n=len(hits)))
            if name == "dense":
                continue
            kept = r["kv_blocks"] / results["dense"][length]["kv_blocks"]
            found += [
                Figure("ttft", r["ttft_ratio"], "x", labels | DENSE),
                Figure("blocks kept", 100 * kept, "%", labels | DENSE),
                Figure("top-1 agreement", 100 * r["top1"], "%", labels | DENSE),
                Figure("kl", r["kl_mean"], "nats", labels | DENSE),
            ]
    for name, r in pressure.items():
        labels = {"arm": name, "workload": "kv pressure"}
        found.append(Figure("throughput", r["output_tok_s"], "tok/s", labels))
        if name != "dense":
            ratio = r["output_tok_s"] / pressure["dense"]["output_tok_s"]
            found.append(Figure("throughput", ratio, "x", labels | DENSE))
    return found


def table(results: dict[str, dict]) -> str:
    lines = [
        "| arm | tokens | TTFT s | vs dense | bound | attention share | estimate share | "
        "skipped | decode tok/s | compress ms | KV blocks | passkeys | top-1 | KL |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, rows in results.items():
        for length, r in rows.items():
            found = r.get("passkeys")
            passkeys = f"{sum(found)}/{len(found)}" if found else "-"
            lines.append(
                f"| {name} | {length} | {r['ttft_s']:.2f} | {r['ttft_ratio']:.2f} | "
                f"{r['bound']:.2f} | {r['attention_share']:.2f} | {r['estimate_share']:.3f} | "
                f"{r['skipped']:.0%} | {r['decode_tok_s']:.1f} | {r['compress_ms']:.0f} | "
                f"{r['kv_blocks']} | {passkeys} | "
                f"{r['top1']:.1%} | {r['kl_mean']:.4f} |"
            )
    return "\n".join(lines)


def pressure_table(pressure: dict[str, dict]) -> str:
    if not pressure:
        return ""
    base = pressure["dense"]["output_tok_s"]
    lines = [
        "| arm (KV pressure) | wall s | in prefill steps s | output tok/s | vs dense | "
        "bound (decode free) | mean batch | preemptions | KV blocks per request |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in pressure.items():
        # Decode made free leaves the steps that carry prefill: the arm's best over dense.
        bound = r["wall_s"] / r["prefill_s"] * r["output_tok_s"] / base
        lines.append(
            f"| {name} | {r['wall_s']:.0f} | {r['prefill_s']:.0f} | {r['output_tok_s']:.2f} | "
            f"{r['output_tok_s'] / base:.2f}x | {bound:.2f}x | {r['mean_batch']:.1f} | "
            f"{r['preemptions']} | {r['kv_blocks_mean']:.0f} |"
        )
    return "\n".join(lines)


def plot_profile(profile: AttentionProfile, config: SparsePrefillConfig, path: Path) -> None:
    """Attention entropy and budget per (layer, KV head) row across segments."""
    plt = pyplot()

    segments = int((~profile.entropy.isnan()).any((1, 2)).nonzero().max()) + 1
    entropy = profile.entropy[:segments].flatten(1).t()  # [layers * kv_heads, segments]
    budgets = profile.budgets[:segments].flatten(1).t()
    fig, axes = plt.subplots(1, 2, figsize=(11, 6), sharey=True)
    for ax, values, title, label in (
        (axes[0], entropy, "attention entropy (nats)", "nats"),
        (axes[1], budgets, "budget chosen (tokens; blank: dense)", "tokens"),
    ):
        image = ax.imshow(
            values,
            aspect="auto",
            interpolation="nearest",
            cmap="viridis",
        )
        ax.set_title(title)
        ax.set_xlabel(f"segment ({config.segment_size} tokens)")
        fig.colorbar(image, ax=ax, label=label)
    kv_heads = profile.entropy.shape[2]
    axes[0].set_ylabel(f"layer x KV head (row = layer * {kv_heads} + head)")
    fig.suptitle("Sparse prefill of one 8K prompt: entropy per head and segment, and budgets")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
