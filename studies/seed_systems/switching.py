"""Entropy Adaptive Decoding's curve: large-model share against quality, over
thresholds, and what it costs, against the large model alone in the same run.

The workload is the ablation's greedy tasks (``bench/common/mixed_workload.py``): passkey retrieval
(accuracy), continuation of human-written text (ROUGE-L to the text that really follows) and
chat instructions; documents of 512-768 tokens. Quality also as the large model's perplexity of
each output (teacher-forced, output tokens only). Cost as wall time of the whole batch and as
weight FLOPs: two per weight for every row the large model computes (prompts, its own tokens and
the catch-up chunks over the small model's tokens), the first N layers and the exit adapter for
every small-model row, and the output head for every sampled row.

    python -m studies switching --exit-layers 22 --thresholds 0.5 1 1.5 2 3 --plot switching.png

The run's result holds, per threshold, the large model's share of the tokens, the quality
relative to the large model's, and the wall time and TFLOPs against its own (its ``details``:
every row as printed).
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from etinfer import LLM, ControlConfig, options
from etinfer.bench.common.machine import cpu_flags
from etinfer.bench.common.results import Figure, add_result_option, engine_device, recorded
from etinfer.control.switching import EXIT_MODEL, SwitchingConfig
from etinfer.model.loader import load_model
from etinfer.options import positive_int
from studies import PROGRAM
from studies.common.mixed_workload import Sizes, answers, build
from studies.common.plots import pyplot
from studies.common.quality import task_quality
from studies.common.work import matmul_params

SIZES = Sizes(
    document_tokens=(512, 768),
    max_tokens={"retrieval": 10, "continuation": 64, "free": 64, "instruction": 64, "chat": 64},
    rate=math.inf,
)


def run_requests(llm: LLM, requests: list) -> tuple[list, float, int]:
    """Outputs in request order, wall seconds, and rows computed over all steps."""
    engine, rows = llm.engine, []
    ids = [
        engine.add_request(r.prompt, r.params, forced_token_ids=list(r.forced) or None)
        for r in requests
    ]
    outs = {}
    start = time.perf_counter()
    with engine.observing(lambda step: rows.append(sum(step.num_tokens))):
        while engine.has_unfinished_requests():
            outs |= {o.request_id: o for o in engine.step() if o.finished}
    return [outs[i] for i in ids], time.perf_counter() - start, sum(rows)


def figures(llm: LLM, scorer: LLM, requests: list, exit_layers: int) -> dict:
    outs, wall, rows = run_requests(llm, requests)
    tok = llm.tokenizer
    scores = task_quality(requests, answers(requests, outs, tok.eos_token_ids), tok)
    nll, count = 0.0, 0
    for r, o in zip(requests, outs, strict=True):
        ids = list(r.prompt) + o.token_ids
        logp = scorer.engine.score(ids)[:-1].log_softmax(-1)
        start = len(r.prompt) + len(r.forced)  # the first generated token; row start - 1
        targets = torch.tensor(ids[start:])
        nll -= logp[start - 1 :].gather(1, targets[:, None]).sum().item()
        count += len(targets)
    models = [m for o in outs for m in (o.token_models or [])]
    small = models.count(EXIT_MODEL)
    # Small-model tokens the large model later caught up on (a final stretch never is).
    caught_up = sum(
        (o.token_models or [])[: _last_target(o.token_models or [])].count(EXIT_MODEL) for o in outs
    )
    config = llm.engine.model_config
    h, v = config.hidden_size, config.vocab_size
    per_layer = matmul_params(config) / config.num_layers
    flops = 2 * per_layer * config.num_layers * (rows - small)
    flops += 2 * (per_layer * exit_layers + h * h) * small
    flops += 2 * h * v * sum(len(o.token_ids) for o in outs)
    # The catch-up runs every layer; only those above the exit would be needed with the stream
    # at the exit kept per token (not built): what that would save.
    upper_only = flops - 2 * per_layer * exit_layers * caught_up
    return {
        "large_share": 1 - small / len(models) if models else 1.0,
        "tflops_upper_only": upper_only / 1e12,
        "passkey": scores["passkey_accuracy"],
        "rouge_l": scores["rouge_l_human"],
        "perplexity": math.exp(nll / count),
        "wall_s": wall,
        "tflops": flops / 1e12,
    }


def _last_target(models: list[str]) -> int:
    return max((i for i, m in enumerate(models) if m != EXIT_MODEL), default=-1)


def run(args: argparse.Namespace) -> tuple[list[Figure], dict]:
    options.set_threads(args)
    loaded = load_model()
    large = LLM(loaded, max_num_seqs=32)
    requests = [r for r in build(large.tokenizer, "mixed", SIZES, args.seed) if r.greedy]
    rows = {"large alone": figures(large, large, requests, 0)}
    print(f"large alone: {rows['large alone']}", flush=True)
    for threshold in args.thresholds:
        config = SwitchingConfig(
            threshold=threshold,
            hysteresis=min(0.25, threshold),
            exit_adapter=not args.no_exit_adapter,
        )
        llm = LLM(
            loaded,
            max_num_seqs=32,
            draft_model=f"self:{args.exit_layers}",
            control=ControlConfig(switching=config),
        )
        name = f"EAD threshold {threshold:g}"
        rows[name] = figures(llm, large, requests, args.exit_layers)
        print(f"{name}: {rows[name]}", flush=True)
    print(f"\n{args.threads} threads, CPU flags: {cpu_flags()}, exit at layer {args.exit_layers}")
    print(table(rows))
    if args.plot:
        plot(rows, args.plot, args.exit_layers)
    report = {"device": engine_device({}), "exit_layers": args.exit_layers, "rows": rows}
    return curve_figures(rows, args.exit_layers), report


def curve_figures(rows: dict[str, dict], exit_layers: int) -> list[Figure]:
    base = rows["large alone"]
    found = []
    for name, r in rows.items():
        labels = {"arm": name, "exit_layers": exit_layers}
        found.append(Figure("large share", 100 * r["large_share"], "%", labels))
        if name == "large alone":
            continue
        versus = labels | {"vs": "large alone"}
        found += [
            Figure("quality", quality(r, base), "x", versus),
            Figure("wall time", r["wall_s"] / base["wall_s"], "x", versus),
            Figure("tflops", r["tflops"] / base["tflops"], "x", versus),
        ]
    return found


def table(rows: dict[str, dict]) -> str:
    base = rows["large alone"]
    lines = [
        "| setting | large share | passkey | ROUGE-L | perplexity | quality vs large | "
        "wall s | TFLOPs | TFLOPs, catch-up above the exit only |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['large_share']:.0%} | {r['passkey']:.0%} | {r['rouge_l']:.3f} | "
            f"{r['perplexity']:.2f} | {quality(r, base):.0%} | {r['wall_s']:.1f} "
            f"({r['wall_s'] / base['wall_s']:.2f}x) | {r['tflops']:.2f} "
            f"({r['tflops'] / base['tflops']:.2f}x) | {r['tflops_upper_only']:.2f} "
            f"({r['tflops_upper_only'] / base['tflops']:.2f}x) |"
        )
    return "\n".join(lines)


def quality(r: dict, base: dict) -> float:
    """The mean of the three task scores relative to the large model's (perplexity inverted)."""
    ratios = [base["perplexity"] / r["perplexity"]]
    for key in ("passkey", "rouge_l"):
        if base[key] > 0:
            ratios.append(r[key] / base[key])
    return float(np.mean(ratios))


def plot(rows: dict[str, dict], path: str, exit_layers: int) -> None:
    plt = pyplot()

    base = rows["large alone"]
    points = [(r["large_share"], quality(r, base), n) for n, r in rows.items()]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p[0] for p in points], [p[1] for p in points], "o-")
    for share, q, name in points:
        ax.annotate(name.replace("EAD threshold ", "H>"), (share, q), fontsize=7)
    ax.axhline(0.95, color="grey", linestyle=":", label="95% of the large model")
    ax.axvline(0.5, color="grey", linestyle="--", label="half the tokens")
    ax.set_xlabel("share of tokens written by the large model")
    ax.set_ylabel("quality relative to the large model")
    ax.set_title(f"Entropy Adaptive Decoding, small model = first {exit_layers} of 30 layers")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_command(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("switching", help="Entropy Adaptive Decoding's curve")
    parser.add_argument("--exit-layers", type=positive_int, default=22)
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.5, 1.0, 1.5, 2.0, 3.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-exit-adapter", action="store_true", help="the bare exit")
    parser.add_argument("--plot", help="write the curve to this PNG")
    options.add_threads_option(parser, default=2)
    add_result_option(parser)
    parser.set_defaults(func=recorded("switching", run, PROGRAM))
