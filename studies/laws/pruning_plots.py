"""The pruning study's plots: blocks kept against entropy over one generation, and the KV
bytes each configuration read against its KL from dense attention (the frontier)."""

from __future__ import annotations

from pathlib import Path

from etinfer.llm import LLM
from etinfer.sampling_params import SamplingParams
from studies.common.plots import pyplot
from studies.laws.pruning_figures import bytes_read


def plot_blocks_against_entropy(pruned: LLM, corpus: list[int], context: int, path: Path) -> dict:
    plt = pyplot()

    out = pruned.generate(
        [corpus[:context]], SamplingParams(temperature=1.0, seed=0, max_tokens=256, ignore_eos=True)
    )[0]
    # The first token comes from the prefill; every later one from a decode step whose budget
    # followed the entropy of the token before it.
    entropies, kept = out.entropies[:-1], out.blocks_kept
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    left.plot(entropies, label="entropy of the previous token (nats)", linewidth=1)
    left.plot([10 * b for b in kept], label="blocks kept (x10 share)", linewidth=1)
    left.set_xlabel("decode step")
    left.legend()
    right.scatter(entropies, kept, s=6)
    right.set_xlabel("entropy of the previous token (nats)")
    right.set_ylabel("share of blocks kept")
    fig.suptitle(f"Entropic pruning over one generation after {context} tokens of context")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return {"entropies": out.entropies, "blocks_kept": out.blocks_kept}


def curve(name: str, config: dict) -> tuple[str, str]:
    """The curve an arm lies on: its ranking (the scorer, or the oracle's or a sketch's that
    replaced it) and its budget law (a share fixed at every entropy is the paper's law with
    its two ends equal)."""
    law = config["budget_law"]
    if law == "entropy" and config["budget_low"] == config["budget_high"]:
        law = "fixed share"
    ranking = name.split(" ")[-1] if " " in name else config["scorer"]
    ranking = "oracle ranking" if ranking == "oracle" else ranking
    return ranking, "fixed tokens" if law == "fixed" else law


def plot_bytes_against_kl(rows: list[dict], configs: dict[str, dict], path: Path) -> None:
    """KL from dense against the share of KV bytes read (left) and against the decode step
    over dense's (right), one curve per scorer and budget law (each point a configuration; a
    row of panels per batch of the run). The oracle's steps are not drawn: its ranking costs
    a dense attention more."""
    plt = pyplot()
    batches = sorted({row["batch"] for row in rows})
    fig, axes = plt.subplots(len(batches), 2, figsize=(14, 5 * len(batches)), squeeze=False)
    for (by_bytes, by_time), batch in zip(axes, batches, strict=True):
        curves: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        for row in rows:
            if row["batch"] == batch:
                config = configs[row["scorer"].split(" ")[0]]
                point = (100 * bytes_read(row), row["step_ratio"], row["kl_mean"])
                curves.setdefault(curve(row["scorer"], config), []).append(point)
        laws = sorted({law for _, law in curves})
        colours = dict(zip(laws, plt.get_cmap("tab10").colors, strict=False))
        sketches = sorted({scorer for scorer, _ in curves if "sketch" in scorer})
        markers = dict(zip(sketches, "^sv<>", strict=False))  # one sketch width from another
        for (scorer, law), points in sorted(curves.items()):
            reads, steps, kl = zip(*sorted(points), strict=True)
            # Colour: the law; line: the ranking (the oracle's dotted, reused masses dashed,
            # sketches dash-dotted).
            styles = {"oracle ranking": ":", "reused-mass": "--"}
            style = styles.get(scorer, "-." if "sketch" in scorer else "-")
            label = f"{scorer}, {law}"
            drawn = dict(marker=markers.get(scorer, "o"), color=colours[law], label=label)
            by_bytes.plot(reads, kl, style, **drawn)
            if scorer == "oracle ranking" or "sketch" in scorer:
                continue  # ranked in torch from the keys themselves: a measurement, not a cost
            by_time.plot(steps, kl, style, **drawn)
        by_bytes.set_xlabel("KV bytes read, % of dense")
        by_time.set_xlabel("decode step over dense's (CPU time)")
        for ax in (by_bytes, by_time):
            ax.set_yscale("log")
            ax.set_ylabel("KL(dense || pruned), nats per token")
            ax.set_title(f"batch {batch}, context {rows[0]['context']} tokens, teacher-forced")
            ax.grid(True, which="both", alpha=0.3)
        by_bytes.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
