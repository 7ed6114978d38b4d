"""FCFS against the entropy policy on the same seeded workloads, side by side.

    etinfer bench serving-sweep --output-dir results/serving
    etinfer bench serving-sweep --ablation alpha hysteresis --capacity 0.26 \
        --output-dir results/serving-ablation

On a machine whose cores other work shares, the speed of the engine can move by half between
two runs minutes apart, far more than the effect measured. So the two sides of a comparison run
at the same time: two ``etinfer bench serving`` processes of one thread each, on the same
workload (a CSV trace) and the same prompts, started together once both have loaded the model.
Whatever else loads the machine loads both.

1. Capacity: requests finished per second while saturated, by two FCFS engines side by side,
   each sent ``3 x max_num_seqs`` requests at once (counted until the last is admitted: the
   tail, with few requests left running, would understate what the engine sustains).
2. Four settings, each with its own seeded workload: Poisson arrivals at 0.5x, 1x and 2x the
   capacity (2x is past saturation), and 1x with a KV pool of ``--kv-blocks`` blocks (memory
   pressure: preemptions). Each pair runs ``--repeats`` times; the tables show the means, and
   the ratio of the means.

``--ablation`` pairs the full entropy policy with itself less one term at a time (all of them,
or those named), in the busiest and the KV settings.

The run's result holds each setting's figures per policy, with their sd over the repeats and
their ratios to FCFS (to the full entropy policy under ``--ablation``); ``--output-dir`` keeps
the workloads' traces, the tables (``serving.md``) and the report (``serving.json``, the
result's ``details``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from etinfer import options
from etinfer.bench.common import workload
from etinfer.bench.common.results import Figure, add_result_option, recorded
from etinfer.bench.common.serving_metrics import METRICS, format_table, result_figures
from etinfer.bench.common.workload import TextPrompts
from etinfer.bench.serving.serving import add_engine_options
from etinfer.control.scheduling import SchedulingConfig
from etinfer.options import positive_int

READY_TIMEOUT_S = 600.0  # loading the model on a loaded machine
KV_PRESSURE = "KV pressure"  # the setting with a pool of --kv-blocks


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    policy: str
    overrides: dict | None = None  # SchedulingConfig fields changed from the defaults


FCFS = Variant("fcfs", "fcfs")
ENTROPY = Variant("entropy", "entropy")
# The entropy policy less one term (urgency cannot be zero: aging is made too slow to matter).
ABLATIONS = {
    "alpha": Variant("no entropy (alpha=0)", "entropy", {"alpha": 0.0}),
    "beta": Variant("no cost (beta=0)", "entropy", {"beta": 0.0}),
    "gamma": Variant("no memory (gamma=0)", "entropy", {"gamma": 0.0}),
    "aging": Variant("no aging", "entropy", {"aging_steps": 1e9, "aging_backlog": 0.0}),
    "hysteresis": Variant(
        "no hysteresis or cap",
        "entropy",
        {"min_run_steps": 0, "max_preemptions": 10**6, "admission_lookahead": 0},
    ),
}


@dataclasses.dataclass
class Setting:
    name: str
    rate: float  # requests per second
    kv_blocks: int | None  # None: the engine's default pool
    trace: Path


def make_setting(name: str, rate: float, kv_blocks, seed: int, args) -> Setting:
    requests = workload.generate(
        "sharegpt",
        args.num_requests,
        rate,
        seed,
        length_scale=args.length_scale,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
    )
    trace = Path(args.output_dir) / f"workload-{name.replace(' ', '-')}.csv"
    workload.write_trace(trace, requests)
    return Setting(name, rate, kv_blocks, trace)


def run_pair(setting: Setting, variants: tuple[Variant, Variant], args) -> list[dict]:
    """Both variants on the setting's workload, in two processes started together."""
    engine_args = argparse.Namespace(**{**vars(args), "num_kvcache_blocks": setting.kv_blocks})
    with tempfile.TemporaryDirectory() as tmp:
        go = Path(tmp) / "go"
        runs = []
        for i, variant in enumerate(variants):
            command = [
                sys.executable, "-m", "etinfer.cli", "bench", "serving",
                "--policy", variant.policy, "--trace", str(setting.trace),
                "--seed", str(args.seed), "--threads", "1",
                "--ready-file", f"{tmp}/ready{i}", "--go-file", str(go),
                "--output", f"{tmp}/out{i}.json", "--result", f"{tmp}/result{i}.json",
                *options.engine_flags(engine_args),
            ]  # fmt: skip
            if variant.overrides:
                command += ["--scheduling-config", json.dumps(variant.overrides)]
            runs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL))
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not all(Path(f"{tmp}/ready{i}").exists() for i in range(len(variants))):
            if any(run.poll() is not None for run in runs) or time.monotonic() > deadline:
                for run in runs:
                    run.kill()
                raise RuntimeError(f"a benchmark process of {setting.name} did not get ready")
            time.sleep(0.05)
        go.touch()
        for run in runs:
            if run.wait() != 0:
                raise RuntimeError(f"a benchmark process of {setting.name} failed")
        return [json.loads(Path(f"{tmp}/out{i}.json").read_text()) for i in range(len(variants))]


def saturated_capacity(result: dict) -> float:
    """Of a run where everything arrived at once: requests finished per second until the last
    one was admitted."""
    records = result["requests"]
    saturated = max(r["queue_time"] for r in records)
    return sum(r["e2e"] <= saturated for r in records) / saturated


def measure_capacity(args) -> float:
    args = argparse.Namespace(**{**vars(args), "num_requests": 3 * args.max_num_seqs})
    setting = make_setting("capacity", math.inf, args.num_kvcache_blocks, args.seed, args)
    results = run_pair(setting, (FCFS, FCFS), args)
    capacity = float(np.mean([saturated_capacity(r) for r in results]))
    print(f"capacity: {capacity:.3f} req/s (two FCFS engines side by side, saturated)")
    return capacity


def run_setting(setting: Setting, pairs: list[tuple[Variant, Variant]], args) -> dict:
    runs: dict[str, list[dict]] = {}
    for a, b in pairs:
        for rep in range(args.repeats):
            ra, rb = run_pair(setting, (a, b), args)
            for variant, result in ((a, ra), (b, rb)):
                del result["requests"]
                runs.setdefault(variant.name, []).append(result)
            print(
                f"  {setting.name:>14s} rep {rep}: {b.name} / {a.name}: "
                + ", ".join(
                    f"{m} {_ratio(ra[m], rb[m])}"
                    for m in ("e2e_mean", "e2e_p99", "max_queue_time", "request_throughput")
                )
                + f" ({a.name} e2e {ra['e2e_mean']:.2f} s)",
                flush=True,
            )
    return {
        "name": setting.name,
        "rate": setting.rate,
        "kv_blocks": setting.kv_blocks,
        "runs": runs,
        "mean": {name: _mean_of(results) for name, results in runs.items()},
    }


def _ratio(a: float | None, b: float | None) -> str:
    return f"{b / a:.2f}x" if a and b is not None else "-"


def _mean_of(results: list[dict]) -> dict:
    out = {}
    for metric in METRICS:
        values = [r[metric] for r in results if r[metric] is not None]
        out[metric] = float(np.mean(values)) if values else None
    for metric in ("num_requests", "completed", "failed", "preemptions", "recomputed_tokens"):
        if out[metric] is not None:
            out[metric] = round(out[metric])
    return out


def ratio_column(results: dict[str, dict], base: str, other: str) -> dict:
    ratios = {}
    for metric in METRICS:
        a, b = results[base].get(metric), results[other].get(metric)
        ratios[metric] = b / a if a and b is not None else None
    return ratios


def report(settings: list[dict], ablation: bool) -> str:
    parts = []
    for s in settings:
        columns = dict(s["mean"])
        if not ablation:
            columns["entropy / fcfs"] = ratio_column(s["mean"], "fcfs", "entropy")
        kv = "default pool" if s["kv_blocks"] is None else f"{s['kv_blocks']} KV blocks"
        parts.append(f"### {s['name']}: {s['rate']:.3f} req/s, {kv}\n\n{format_table(columns)}")
    return "\n\n".join(parts)


def figures(capacity: float, settings: list[dict], reference: str) -> list[Figure]:
    """The capacity, and each setting's figures per variant, against ``reference``'s."""
    found = [Figure("capacity", capacity, "req/s")]
    for s in settings:
        found += result_figures(s["runs"], reference, {"setting": s["name"]})
    return found


def run(args: argparse.Namespace) -> tuple[list[Figure], dict]:
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    capacity = args.capacity or measure_capacity(args)
    pool = args.num_kvcache_blocks
    settings = [
        make_setting(f"{m:g}x capacity", m * capacity, pool, args.seed + i + 1, args)
        for i, m in enumerate(args.rates)
    ]
    kv_seed = args.seed + len(args.rates) + 1
    settings.append(make_setting(KV_PRESSURE, capacity, args.kv_blocks, kv_seed, args))
    if args.ablation is not None:
        busiest = f"{max(args.rates):g}x"
        settings = [s for s in settings if s.name.startswith(busiest) or s.name == KV_PRESSURE]
        chosen = [v for k, v in ABLATIONS.items() if not args.ablation or k in args.ablation]
        pairs = [(ENTROPY, variant) for variant in chosen]
    else:
        pairs = [(FCFS, ENTROPY)]
    results = [run_setting(s, pairs, args) for s in settings]
    text = report(results, args.ablation is not None)
    print(text)
    summary = {
        "date": time.strftime("%Y-%m-%d"),
        "threads_per_engine": 1,
        "prompts": TextPrompts.SOURCE,
        "args": {k: v for k, v in vars(args).items() if k not in ("func", "engine_options")},
        "capacity_req_s": capacity,
        "scheduling_config": dataclasses.asdict(SchedulingConfig()),
        "settings": results,
    }
    name = "serving" if args.ablation is None else "ablation"
    (out / f"{name}.json").write_text(json.dumps(summary, indent=2))
    (out / f"{name}.md").write_text(text + "\n")
    reference = FCFS.name if args.ablation is None else ENTROPY.name
    return figures(capacity, results, reference), summary


def add_command(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("serving-sweep", help="FCFS against the entropy policy, side by side")
    add_engine_options(parser)  # --num-kvcache-blocks: the pool of all but the KV-pressure run
    parser.add_argument("--num-requests", type=positive_int, default=80)
    parser.add_argument(
        "--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0], help="times the capacity"
    )
    parser.add_argument("--capacity", type=float, help="req/s; skips measuring it")
    parser.add_argument(
        "--kv-blocks", type=positive_int, default=80, help="pool of the KV-pressure run"
    )
    parser.add_argument("--repeats", type=positive_int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--length-scale", type=float, default=0.35)
    parser.add_argument("--max-prompt-tokens", type=int)
    parser.add_argument("--max-output-tokens", type=int)
    parser.add_argument(
        "--ablation",
        nargs="*",
        choices=list(ABLATIONS),
        help="switch off one term at a time: these (default: all)",
    )
    parser.add_argument("--output-dir", default="results/serving")
    add_result_option(parser)
    parser.set_defaults(func=recorded("serving-sweep", run))
