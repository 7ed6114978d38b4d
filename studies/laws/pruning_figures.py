"""The figures a pruning (or fidelity) run's result carries, from its report's parts: per
configuration (``arm``) its decode step against dense's and the blocks it kept (timed on the
report's ``clock``); teacher-forced KL, top-1 agreement, perplexity and step time against dense
(``workload`` ``teacher-forced``, CPU time); passkeys found per haystack; KL with the first
layers dense."""

from __future__ import annotations

from etinfer.bench.common.results import Figure
from studies.laws.pruning_passkeys import DENSE as DENSE_ARM
from studies.laws.pruning_passkeys import RECHECK, lost_by_both

DENSE = {"vs": "dense"}


def figures(report: dict, steps: int) -> list[Figure]:
    """``steps``: the decode steps timed for each point of the speed part."""
    setting = setting_labels(report.get("setting", {}))
    return [
        *speed_figures(report.get("speed", []), steps, report["clock"], setting),
        *fidelity_figures(report.get("fidelity", []), setting),
        *passkey_figures(report.get("passkey", []), setting),
        *layer_figures(report.get("dense_layers", [])),
    ]


def speed_figures(rows: list[dict], steps: int, clock: str, setting: dict) -> list[Figure]:
    found = []
    for row in rows:
        point = {"batch": row["batch"], "context": row["context"]}
        for name, arm in row.items():
            if name in point:
                continue
            labels = {"arm": name} | point | {"clock": clock} | setting
            found += [
                Figure("decode step", arm["ms"], "ms", labels, n=steps),
                Figure("decode step", arm["ratio"], "x", labels | DENSE, n=steps),
                Figure("blocks kept", 100 * arm["blocks_kept"], "%", labels, n=steps),
            ]
    return found


def fidelity_figures(rows: list[dict], setting: dict) -> list[Figure]:
    found = []
    for row in rows:
        labels = {"arm": row["scorer"], "batch": row["batch"], "context": row["context"]}
        labels["workload"] = "teacher-forced"
        labels |= setting
        n = row["steps"]
        found += [
            Figure("kl", row["kl_mean"], "nats", labels | DENSE, n=n),
            Figure("kl max", row["kl_max"], "nats", labels | DENSE, n=n),
            Figure("top-1 agreement", 100 * row["top1_agreement"], "%", labels | DENSE, n=n),
            Figure("perplexity", row["perplexity_ratio"], "x", labels | DENSE, n=n),
            Figure("blocks kept", 100 * row["blocks_kept"], "%", labels, n=n),
            Figure("kv bytes read", 100 * bytes_read(row), "%", labels | DENSE, n=n),
            Figure("decode step", row["step_ratio"], "x", labels | DENSE, n=n),
        ]
    return found


def setting_labels(setting: dict) -> dict:
    """The engine's block size, weights and model (a report's ``setting``) where they are not
    the defaults (16, ``auto``, the embedded model), and whether its cache kept the key copy:
    the tables of runs on the defaults then leave these out (runs before them carry none)."""
    labels = {}
    if setting.get("model") is not None:
        labels["model"] = setting["model"]
    if setting.get("block_size", 16) != 16:
        labels["block_size"] = setting["block_size"]
    if setting.get("quantization", "auto") != "auto":
        labels["quantization"] = setting["quantization"]
    if setting.get("key_copy"):
        labels["key_copy"] = "kept"
    if setting.get("sketch_rank") is not None:
        labels["sketch_rank"] = setting["sketch_rank"]
    return labels


def bytes_read(row: dict) -> float:
    """A fidelity row's share of the KV bytes dense attention reads: the blocks it kept, and
    what a sketch read of every key, over the share of the whole context dense reads."""
    kept = row["blocks_kept"] + row.get("sketch_reads", 0.0)
    return kept / row.get("dense_reads", 1.0)


def passkey_figures(rows: list[dict], setting: dict) -> list[Figure]:
    """Passkeys found per configuration (dense too) and haystack, over every length and
    depth; per pruned configuration the cases it lost of those dense found (n), counting only
    those dense finds under both of its kernels (``pruning_passkeys.py``). ``setting``: the
    engine's labels (``setting_labels``)."""
    found: dict[tuple[str, str], list[bool]] = {}
    for row in rows:
        for name, hit in row.items():
            if name not in ("haystack", "length", "depth", RECHECK):
                found.setdefault((name, row["haystack"]), []).append(hit)
    figures = []
    for (arm, haystack), hits in found.items():
        labels = {"arm": arm, "workload": haystack} | setting
        figures.append(Figure("passkeys found", sum(hits), "count", labels, n=len(hits)))
        if arm != DENSE_ARM:
            of_haystack = [row for row in rows if row["haystack"] == haystack]
            lost, dense_found = lost_by_both(of_haystack, arm), sum(found[DENSE_ARM, haystack])
            figures.append(Figure("passkeys lost", lost, "count", labels, n=dense_found))
    return figures


def layer_figures(rows: list[dict]) -> list[Figure]:
    found = []
    for row in rows:
        labels = {"arm": "bound", "dense_layers": row["dense_layers"], "workload": "teacher-forced"}
        found.append(Figure("kl", row["kl_mean"], "nats", labels | DENSE))
    return found
