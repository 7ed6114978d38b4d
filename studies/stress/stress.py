"""The paper's calibration stress test (section 6.2) and its estimators in the full loop (6.1).

    python -m studies stress --output results/stress
    python -m studies stress --quick --output results/stress-quick
    python -m studies stress --workload retrieval --cap 12 --skip-layers --output results/passkeys

The model is made to look over-confident (logits scaled up, entropy biased low) or
under-confident, or its entropy estimate is shifted by a constant (``StressConfig``: the control
layers read the distorted signal, requests sample from the model as it is). Each stress point
runs the paper's three layers on the ablation's long-context workload (passkey retrieval and
human-written documents, ``bench/common/mixed_workload.py``; ``--workload retrieval``: passkeys
only) under four arms:

- ``no guards``: the exact estimator, and pruning without its guards: no entropy floor (the
  budget's line goes on below it, down to ``budget_low`` at 0 nats minus the floor's share),
  a minimum budget of the always-kept blocks only, no rate limit on shrinking;
- ``guards``: the default ``PruningConfig`` (floor, minimum budget, rate limit) and the tail
  estimator, whose upper side pruning reads;
- ``calibration``: no guards, and the post-hoc temperature refitted on the stressed logits
  (``etinfer calibrate`` on the same corpus, ``calibrate.fit_calibration``); the refitted
  temperatures are reported;
- ``both``.

Each repeat also runs the layer-off engine (the reference of ROUGE-L between answers; passkeys
and human text are scored on their own) and section 6.1's estimators: the three layers with the
default guards and the ``exact`` or ``topk`` estimator (the guarded arm unstressed is the
``tail`` one). The speculative drafter's length and
Entropy Adaptive Decoding's switch read the same signal: ``bench/stress/layers.py`` runs them
under the same stresses. EntropyInfer's layers read attention entropy, which the stress does not
touch, and are left out.

Figures are ``bench/stress/metrics.py``'s; the report, plot and the result's figures
``bench/stress/report.py``'s. ``--output`` keeps the report (``stress.json``, the result's
``details``), its tables, plots and the refitted calibrations.
"""

from __future__ import annotations

import argparse
import gc
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm.auto import tqdm

from etinfer import options
from etinfer.bench.common.machine import cpu_flags, machine
from etinfer.bench.common.results import Figure, add_result_option, engine_device, recorded
from etinfer.calibrate import corpus_logits, fit_calibration
from etinfer.control.block_selection import PruningConfig
from etinfer.control.config import ControlConfig
from etinfer.control.stress import StressConfig
from etinfer.llm import LLM
from etinfer.model.loader import LoadedModel, load_model
from etinfer.options import positive_int
from studies import PROGRAM
from studies.ablation.metrics import run_figures
from studies.ablation.runner import run_once
from studies.common import mixed_workload as ablation_workload
from studies.common.mixed_workload import AblationRequest, Sizes
from studies.stress import layers as stress_layers
from studies.stress import metrics as stress_metrics
from studies.stress import report as stress_report

# Long prompts above the pruning threshold, every request queued at once. Four passkeys and
# four documents (a greedy continuation and a sampled one each) per repeat.
SIZES = Sizes(
    document_tokens=(1536, 2048),
    max_tokens={"retrieval": 10, "continuation": 48, "free": 64},
    rate=math.inf,
    cap=4,
)
# The ablation's quick documents (384-512 tokens, above the quick threshold below, so pruning
# acts) and half the outputs of a full run: enough decode steps for pruning and the scheduler's
# orders to show (the tests' quick grid measures 25 scheduling decisions an arm).
QUICK = replace(
    ablation_workload.QUICK, max_tokens={"retrieval": 10, "continuation": 24, "free": 32}
)
QUICK_MIN_CONTEXT = 256  # quick mode's prompts are shorter than the default threshold


@dataclass(frozen=True)
class Arm:
    guards: bool
    calibration: bool


ARMS = {
    "no guards": Arm(False, False),
    "guards": Arm(True, False),
    "calibration": Arm(False, True),
    "both": Arm(True, True),
}
ESTIMATORS = ("exact", "topk")  # section 6.1's; "tail" is the guarded arm's


def unguarded(config: PruningConfig) -> PruningConfig:
    """``config`` without its guards, on the same budget line above the floor."""
    slope = (config.budget_high - config.budget_low) / (config.entropy_high - config.entropy_floor)
    return replace(
        config,
        entropy_floor=0.0,
        budget_low=max(1e-3, config.budget_low - slope * config.entropy_floor),
        min_blocks=max(1, config.sink_blocks + config.recent_blocks),
        max_shrink=1.0,
    )


def stress_points(scales: list[float], biases: list[float]) -> dict[str, StressConfig | None]:
    """By name: the unstressed engine (``none``), each logit scale, each entropy bias."""
    points: dict[str, StressConfig | None] = {"none": None}
    points |= {f"scale {s:g}": StressConfig(logit_scale=s) for s in scales if s != 1}
    points |= {f"bias {b:+g}": StressConfig(entropy_bias=b) for b in biases if b != 0}
    return points


@dataclass(frozen=True)
class Setting:
    """One run of a repeat: its arm and stress, and what the engine and requests are given."""

    arm: str
    stress: str
    control: ControlConfig
    estimator: str
    engine: dict


def settings(
    pruning: PruningConfig, points: dict, calibrations: dict[float, str], arms: list[str]
) -> list[Setting]:
    full = {"sampling": True, "scheduling": True}
    runs = [Setting("layers off", "none", ControlConfig.baseline(), "exact", {})]
    for name in arms:
        arm = ARMS[name]
        control = ControlConfig(pruning=pruning if arm.guards else unguarded(pruning), **full)
        for point, stress in points.items():
            scale = 1.0 if stress is None else stress.logit_scale
            engine = {"stress": stress}
            if arm.calibration:
                engine["calibration"] = calibrations[scale]
            estimator = "tail" if arm.guards else "exact"
            runs.append(Setting(name, point, control, estimator, engine))
    control = ControlConfig(pruning=pruning, **full)
    runs += [Setting(f"estimator {e}", "none", control, e, {}) for e in ESTIMATORS]
    return runs


def refit_calibrations(
    loaded: LoadedModel, scales: set[float], out: Path, tokens: int
) -> dict[float, dict]:
    """The post-hoc temperature of each stressed model, written as ``etinfer calibrate`` does
    (``tokens`` to fit, as many held out)."""
    engine = LLM(loaded).engine
    fit, held_out = corpus_logits(engine, tokens, tokens)
    found = {}
    for scale in sorted(scales):
        calibration = fit_calibration(engine, fit, held_out, scale)
        path = out / f"calibration-scale-{scale:g}.json"
        calibration.save(path)
        found[scale] = {"path": str(path), **vars(calibration)}
    return found


def with_estimator(requests: list[AblationRequest], estimator: str) -> list[AblationRequest]:
    return [replace(r, params=replace(r.params, entropy_estimator=estimator)) for r in requests]


def run_grid(
    loaded: LoadedModel,
    requests: list[AblationRequest],
    runs: list[Setting],
    repeats: int,
    engine_kwargs: dict,
) -> list[dict]:
    records = []
    tokenizer = loaded.tokenizer
    with tqdm(total=repeats * len(runs), unit="run") as bar:
        for repeat in range(repeats):
            batch = ablation_workload.for_repeat(requests, repeat)
            # The layer-off reference first; the rest rotated, so none always runs first.
            rest = runs[1:]
            turn = repeat * len(rest) // max(1, repeats)
            for setting in [runs[0], *rest[turn:], *rest[:turn]]:
                bar.set_description(f"repeat {repeat + 1}/{repeats} {setting.arm} {setting.stress}")
                ours = with_estimator(batch, setting.estimator)
                kwargs = engine_kwargs | setting.engine
                run = run_once(
                    loaded, setting.arm, repeat, setting.control, ours, kwargs, "cpu",
                    tqdm(disable=True), meters=[stress_metrics.DecisionShadow],
                )  # fmt: skip
                record = run_figures(ours, run, tokenizer)
                shadow = run.meters[0]
                record["figures"]["decisions_changed"] = shadow.share_changed
                record["figures"]["scheduling_decisions"] = shadow.decisions
                records.append(record | {"arm": setting.arm, "stress": setting.stress})
                bar.update()
                gc.collect()
    return records


def run(args: argparse.Namespace, loaded: LoadedModel | None = None) -> tuple[list[Figure], dict]:
    options.set_threads(args)
    loaded = loaded or load_model(args.model)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    sizes = QUICK if args.quick else SIZES
    if args.cap is not None:
        sizes = replace(sizes, cap=args.cap)
    pruning = PruningConfig(min_context=QUICK_MIN_CONTEXT) if args.quick else PruningConfig()
    points = stress_points(args.scales, args.biases)
    started = time.strftime("%Y-%m-%d %H:%M")
    requests = ablation_workload.build(loaded.tokenizer, args.workload, sizes, args.seed)
    engine_kwargs = options.engine_kwargs(args)
    engine_kwargs["num_kvcache_blocks"] = args.num_kvcache_blocks or 1024
    scales = {1.0} | {p.logit_scale for p in points.values() if p}
    # Every engine of the study (the fits, the grid's runs, the layers') runs the same weights:
    # each form is prepared once, not once an engine.
    with loaded.keeping_prepared():
        calibrations = refit_calibrations(loaded, scales, out, args.calibration_tokens)
        paths = {scale: c["path"] for scale, c in calibrations.items()}
        grid = settings(pruning, points, paths, args.arms)
        records = run_grid(loaded, requests, grid, args.repeats, engine_kwargs)
        layers = None if args.skip_layers else stress_layers.run(loaded, points, paths, args)
    stress_metrics.compare(records)
    report = {
        "settings": {
            "command": command_line(args),
            "date": started,
            "machine": machine() | {"cpu_flags": cpu_flags()},
            "quick": args.quick,
            "workload": args.workload,
            "repeats": args.repeats,
            "seed": args.seed,
            "engine": {k: str(v) for k, v in engine_kwargs.items()},
            "pruning": vars(pruning),
            "pruning_unguarded": vars(unguarded(pruning)),
            "references": ablation_workload.REFERENCE_SOURCE,
        },
        "workload": [
            {"task": r.task, "prompt_tokens": len(r.prompt), "output_tokens": r.params.max_tokens}
            for r in requests
        ],
        "arms": args.arms,
        "calibrations": calibrations,
        "runs": records,
        "summary": stress_metrics.summarize(records),
        "layers": layers,
    }
    stress_report.write(report, out)
    device = {"device": engine_device(engine_kwargs)}
    return stress_report.figures(report), report | device


def command_line(args: argparse.Namespace) -> str:
    parts = [
        "python -m studies stress",
        f"--workload {args.workload}",
        "--quick" if args.quick else "",
    ]
    parts += [] if args.cap is None else [f"--cap {args.cap}"]
    parts += [] if args.arms == list(ARMS) else ["--arms " + " ".join(f"'{a}'" for a in args.arms)]
    parts += [f"--scales {' '.join(f'{s:g}' for s in args.scales)}"]
    parts += [f"--biases {' '.join(f'{b:g}' for b in args.biases)}"]
    parts += [f"--repeats {args.repeats}", f"--seed {args.seed}", f"--threads {args.threads}"]
    parts += [f"--calibration-tokens {args.calibration_tokens}"]
    parts += ["--skip-layers" if args.skip_layers else ""]
    return " ".join(
        p for p in [*parts, *options.engine_flags(args), f"--output {args.output}"] if p
    )


def add_command(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser(
        "stress", help="the paper's calibration stress test (6.2) and estimators in the loop (6.1)"
    )
    parser.add_argument("--output", required=True, help="directory for the report and plots")
    parser.add_argument("--quick", action="store_true", help="a small run, for tests")
    parser.add_argument(
        "--workload",
        choices=("long", "retrieval"),
        default="long",
        help="the ablation's mix: passkeys and documents, or passkeys only",
    )
    parser.add_argument("--cap", type=int, help="requests of each kind (default: 4)")
    parser.add_argument(
        "--arms",
        nargs="+",
        choices=list(ARMS),
        default=list(ARMS),
        help="the pruning arms stressed, with or without guards and calibration (default: all)",
    )
    parser.add_argument("--scales", type=float, nargs="+", default=[0.5, 0.75, 1.0, 1.5, 2.0])
    parser.add_argument("--biases", type=float, nargs="+", default=[-1.0, 1.0])
    parser.add_argument("--repeats", type=positive_int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--calibration-tokens",
        type=positive_int,
        default=4096,
        help="to refit on, as many held out",
    )
    parser.add_argument(
        "--skip-layers", action="store_true", help="leave out speculative drafting and EAD"
    )
    options.add_engine_options(
        parser,
        exclude=("control", "scheduling_policy", "seed", "stress", "calibration"),
        defaults={"max_num_seqs": 16},
        aliases={"num_kvcache_blocks": "--kv-blocks"},
        helps={"num_kvcache_blocks": "KV pool size (default: 1,024 blocks)"},
    )
    options.add_threads_option(parser, default=2)
    add_result_option(parser)
    parser.set_defaults(func=recorded("stress", run, PROGRAM))
