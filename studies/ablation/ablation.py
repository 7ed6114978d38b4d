"""The ablation study of the paper's section 6: its Table 1, measured.

    python -m studies ablation --workload mixed --output results/ablation
    python -m studies ablation --quick --output results/ablation-quick

Five configurations run the same seeded workload (``bench/common/mixed_workload.py``) in one
process, over one copy of the weights: the baseline (FCFS, dense attention, fixed temperature), each
control layer alone, and all three. Each run gets a fresh engine, so no run inherits another's
prefix cache or random state. Repeats run the configurations in a rotated order, so a slow
spell of this shared machine does not always land on the same configuration.

The engine runs in this process, driven as in ``bench serving`` (``bench/common/driver.py``): a
request is added once its arrival time has passed on the run's clock, and the engine steps while it
has work. ``bench/ablation/runner.py`` runs one configuration and meters each step's work;
``bench/ablation/metrics.py`` turns runs into figures and ``bench/ablation/report.py`` into
tables and plots. ``--output`` keeps the report (``ablation.json``, the result's ``details``),
its tables and plots; the result's figures are Table 1's (``metrics.table1_figures``).
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from tqdm.auto import tqdm

from etinfer import options
from etinfer.bench.common.driver import CLOCKS
from etinfer.bench.common.machine import machine
from etinfer.bench.common.results import Figure, add_result_option, engine_device, recorded
from etinfer.control.block_selection import PruningConfig
from etinfer.control.config import ControlConfig
from etinfer.control.drafting import SpeculativeConfig
from etinfer.model.loader import LoadedModel, load_model
from etinfer.options import positive_int
from studies import PROGRAM
from studies.ablation import additivity, goodput
from studies.ablation import metrics as ablation_metrics
from studies.ablation import report as ablation_report
from studies.ablation.runner import Run, run_once
from studies.common import mixed_workload as ablation_workload
from studies.common.mixed_workload import AblationRequest

CONFIGS = ("baseline", "sampling", "scheduling", "attention", "full", "etinfer")
# Quick mode's contexts (384-512 tokens) are below where pruning starts by default (2-4K),
# so it lowers the threshold to keep pruning in play.
QUICK_MIN_CONTEXT = 256
# KV pools that hold the requests of the mode's workload that run at once, so no figure hangs
# on preemptions (a long prompt recomputed costs many seconds on this CPU): 2,048 blocks of 16
# tokens are 32K tokens, 0.7 GiB in float16; the long workload's 4,096 hold eight of its
# longest requests.
KV_BLOCKS = {"quick": 512, "full": 2048, "long": 4096, "long-scored": 4096}


@dataclass(frozen=True)
class Arm:
    """One configuration of the study: its control layers, and engine settings beyond them."""

    control: ControlConfig
    engine: dict = field(default_factory=dict)


def arms(pruning: PruningConfig) -> dict[str, Arm]:
    """The paper's five rows, and ``etinfer``: every layer that removes work and is meant to
    keep quality (the three laws, sparse prefill, prompt-lookup speculation; with key-bound
    pruning, per-head budgets too: reused masses make one choice for every head). KV
    compression stays out: it cannot run beside speculation yet."""
    ours = pruning if pruning.scorer == "reused-mass" else replace(pruning, head_budgets=True)
    return {
        "baseline": Arm(ControlConfig.baseline()),
        "sampling": Arm(ControlConfig(sampling=True)),
        "scheduling": Arm(ControlConfig(scheduling=True)),
        "attention": Arm(ControlConfig(pruning=pruning)),
        "full": Arm(ControlConfig(sampling=True, pruning=pruning, scheduling=True)),
        "etinfer": Arm(
            ControlConfig(
                sampling=True,
                pruning=ours,
                scheduling=True,
                sparse_prefill=True,
            ),
            {"speculative": SpeculativeConfig()},
        ),
    }


def run_all(
    loaded: LoadedModel,
    requests: list[AblationRequest],
    configurations: dict[str, Arm],
    repeats: int,
    engine_kwargs: dict,
    clock: str,
    concurrency: int | None = None,
) -> list[Run]:
    runs = []
    names = list(configurations)
    # Every arm runs the same weights: prepared once, not once an engine.
    total = repeats * len(names) * len(requests)
    with loaded.keeping_prepared(), tqdm(total=total, unit="req") as bar:
        for repeat in range(repeats):
            batch = ablation_workload.for_repeat(requests, repeat)
            # Rotate the order, so no configuration always runs first (or last) in a repeat.
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                bar.set_description(f"repeat {repeat + 1}/{repeats} {name}")
                arm = configurations[name]
                settings = engine_kwargs | arm.engine
                run = run_once(
                    loaded,
                    name,
                    repeat,
                    arm.control,
                    batch,
                    settings,
                    clock,
                    bar,
                    concurrency=concurrency,
                )
                runs.append(run)
                gc.collect()  # the finished engine's KV pool goes before the next one's
    return runs


def run(args: argparse.Namespace, loaded: LoadedModel | None = None) -> tuple[list[Figure], dict]:
    """The whole study; writes the report under ``args.output`` and returns Table 1's figures
    and the report."""
    # One thread by default: on a shared two-core machine, two threads of one process wait for
    # each other whenever another process holds a core (a quick run took 5.7 minutes with two,
    # 53 s with one, at a load average of 5), and one thread makes the CPU time of a step its
    # own work, which is what eta divides by.
    if "baseline" not in args.arms:
        raise ValueError(f"--arms must include baseline (every ratio is to it), got {args.arms}")
    if args.sweep_rates and (args.concurrency is not None or args.rate is not None):
        raise ValueError("--sweep-rates sets the arrivals: give it without --rate or --concurrency")
    if args.sweep_rates and min(args.sweep_rates) <= 0:
        raise ValueError(f"--sweep-rates must all be above 0, got {args.sweep_rates}")
    options.set_threads(args)
    loaded = loaded or load_model(args.model)
    mode = "quick" if args.quick else args.workload if args.workload.startswith("long") else "full"
    sizes = ablation_workload.SIZES[mode]
    if args.rate is not None:
        sizes = replace(sizes, rate=args.rate)
    repeats = args.repeats or (1 if args.quick else 2)
    pruning = PruningConfig(min_context=QUICK_MIN_CONTEXT) if args.quick else PruningConfig()
    requests = ablation_workload.build(loaded.tokenizer, args.workload, sizes, args.seed)
    engine_kwargs = options.engine_kwargs(args)
    engine_kwargs["num_kvcache_blocks"] = args.num_kvcache_blocks or KV_BLOCKS[mode]
    started = time.strftime("%Y-%m-%d %H:%M")
    chosen = {name: arm for name, arm in arms(pruning).items() if name in args.arms}
    if args.sweep_rates:
        run_at = {
            rate: ablation_workload.build(
                loaded.tokenizer, args.workload, replace(sizes, rate=rate), args.seed
            )
            for rate in args.sweep_rates
        }
        return sweep(args, loaded, run_at, chosen, repeats, engine_kwargs)
    if args.concurrency is not None:
        note = closed_loop_note(args.concurrency, len(requests), engine_kwargs["max_num_seqs"])
        if note:
            print(note)
    runs = run_all(loaded, requests, chosen, repeats, engine_kwargs, args.clock, args.concurrency)
    settings = {
        "command": command_line(args, repeats),
        "date": started,
        "machine": machine(),
        "workload": args.workload,
        "quick": args.quick,
        "repeats": repeats,
        "rate": sizes.rate,
        "concurrency": args.concurrency,
        "clock": args.clock,
        "seed": args.seed,
        "engine": engine_kwargs,
        "pruning": vars(pruning) | {"quick_mode_lowered_min_context": args.quick},
        "configurations": {name: repr(arm) for name, arm in chosen.items()},
        "references": ablation_workload.REFERENCE_SOURCE,
    }
    report = ablation_metrics.study(requests, runs, loaded.tokenizer, settings)
    report["super_additivity"] = additivity.super_additivity(report["runs"])
    ablation_report.write(report, Path(args.output))
    labels = {"workload": args.workload} | ({"quick": True} if args.quick else {})
    if args.concurrency is not None:  # throughput is then capacity: a closed loop's rate
        labels["concurrency"] = args.concurrency
    if list(args.arms) != list(CONFIGS):  # some arms: not a whole Table 1
        labels["arms"] = " ".join(args.arms)
    figures = ablation_metrics.table1_figures(report["summary"], labels)
    figures += additivity.additivity_figures(report["super_additivity"], labels)
    return figures, report | {"device": engine_device(engine_kwargs)}


def closed_loop_note(clients: int, requests: int, max_num_seqs: int) -> str | None:
    """What a closed loop of ``clients`` over ``requests`` leaves waiting in the engine's queue
    where more are in flight than ``max_num_seqs`` runs at once (None where none waits)."""
    in_flight = min(clients, requests)
    if in_flight <= max_num_seqs:
        return None
    note = f"{clients} clients and max_num_seqs {max_num_seqs}: "
    if clients > requests:
        note += f"all {requests} requests are sent at once, and "
    return note + f"up to {in_flight - max_num_seqs} of them wait in the queue"


def sweep(
    args: argparse.Namespace,
    loaded: LoadedModel,
    run_at: dict[float, list[AblationRequest]],
    chosen: dict[str, Arm],
    repeats: int,
    engine_kwargs: dict,
) -> tuple[list[Figure], dict]:
    """Every arm at every rate of ``run_at`` (its workload at that rate): each arm's SLO
    attainment and goodput per rate, and the highest rate it sustains (``goodput.py``)."""
    objective = goodput.Objective(args.slo_ttft, args.slo_tpot, args.slo_target)
    by_rate = {}
    for rate, requests in run_at.items():
        runs = run_all(loaded, requests, chosen, repeats, engine_kwargs, args.clock)
        by_rate[rate] = {name: [r for r in runs if r.config == name] for name in chosen}
    labels = {"workload": args.workload, "slo_ttft_s": args.slo_ttft, "slo_tpot_s": args.slo_tpot}
    figures, report, notes = goodput.sweep_figures(by_rate, objective, labels)
    print(
        f"\nSLO: TTFT <= {args.slo_ttft} s and TPOT <= {args.slo_tpot} s for "
        f"{100 * args.slo_target:.0f} % of requests ({args.clock} clock)"
    )
    print("| arm | " + " | ".join(f"{rate} req/s" for rate in by_rate) + " | sustained |")
    print("|---|" + "---:|" * (len(by_rate) + 1))
    for name in chosen:
        cells = [f"{100 * report['per_rate'][name][rate]['attainment']:.0f} %" for rate in by_rate]
        print(f"| {name} | {' | '.join(cells)} | {report['sustained'][name] or 'none'} |")
    for note in notes:
        print(note)
    report |= {"command": command_line(args, repeats), "notes": notes}
    return figures, report | {"device": engine_device(engine_kwargs)}


def command_line(args: argparse.Namespace, repeats: int) -> str:
    """The command that reproduces this run (defaults spelled out)."""
    parts = ["python -m studies ablation", f"--workload {args.workload}"]
    parts += ["--quick"] if args.quick else []
    parts += [f"--repeats {repeats}", f"--seed {args.seed}", f"--threads {args.threads}"]
    parts += [f"--clock {args.clock}"]
    parts += [] if list(args.arms) == list(CONFIGS) else ["--arms", *args.arms]
    parts += [] if args.rate is None else [f"--rate {args.rate}"]
    parts += [] if args.concurrency is None else [f"--concurrency {args.concurrency}"]
    if args.sweep_rates:
        parts += ["--sweep-rates", *map(str, args.sweep_rates), f"--slo-ttft {args.slo_ttft}"]
        parts += [f"--slo-tpot {args.slo_tpot}", f"--slo-target {args.slo_target}"]
    return " ".join([*parts, *options.engine_flags(args), f"--output {args.output}"])


def add_command(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser(
        "ablation", help="the paper's Table 1: five control configurations on one workload"
    )
    parser.add_argument("--workload", choices=tuple(ablation_workload.MIXES), default="mixed")
    parser.add_argument("--quick", action="store_true", help="a small run (about a minute)")
    parser.add_argument("--output", required=True, help="directory for the report and plots")
    parser.add_argument("--repeats", type=positive_int, help="default: 2, or 1 with --quick")
    parser.add_argument("--rate", type=float, help="requests/s (default: the mode's own)")
    parser.add_argument(
        "--concurrency",
        type=positive_int,
        help="a closed loop of this many clients instead of the arrival times (vLLM's "
        "benchmark at request rate inf): throughput is then each arm's capacity",
    )
    parser.add_argument(
        "--sweep-rates",
        type=float,
        nargs="+",
        help="run every arm at each of these rates (req/s) and report each arm's goodput: "
        "the highest rate whose requests meet the SLO (--slo-ttft, --slo-tpot, --slo-target)",
    )
    parser.add_argument("--slo-ttft", type=float, default=30.0, help="seconds (default 30)")
    parser.add_argument("--slo-tpot", type=float, default=1.0, help="seconds (default 1)")
    parser.add_argument(
        "--slo-target", type=float, default=0.9, help="share of requests (default 0.9)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--arms",
        nargs="+",
        choices=CONFIGS,
        default=list(CONFIGS),
        type=str,
        help="the configurations to run (the baseline among them: every ratio is to it)",
    )
    # Each configuration sets the control layers; the scheduling layer replaces the baseline's
    # FCFS; --seed seeds the workload.
    options.add_engine_options(
        parser,
        exclude=("control", "scheduling_policy", "seed"),
        defaults={"max_num_seqs": 16},
        aliases={"num_kvcache_blocks": "--kv-blocks"},
        helps={"num_kvcache_blocks": "KV pool size (default: the mode's own)"},
    )
    options.add_threads_option(parser, default=1)
    parser.add_argument(
        "--clock",
        choices=CLOCKS,
        default="cpu",
        help="time arrivals and latencies by this process's CPU time in engine steps (default; "
        "robust to other jobs on the machine) or by wall-clock time",
    )
    add_result_option(parser)
    parser.set_defaults(func=recorded("ablation", run, PROGRAM))
