"""Where a decode step goes, by torch's profiler: the operators that take the host's time, and
per step the device kernels launched, the host-device copies, the host syncs (each a wait for
the device on CUDA, where a step should have at most one) and the tensor values read back.

    etinfer bench step-profile --batch 16 --steps 10
"""

from __future__ import annotations

import argparse
import contextlib
import warnings
from collections import Counter
from collections.abc import Iterator

import torch
from torch.profiler import ProfilerActivity, profile

from etinfer import options
from etinfer.bench.common.prompts import TOPICS
from etinfer.bench.common.results import Figure, add_result_option, recorded
from etinfer.llm import LLM
from etinfer.options import positive_int
from etinfer.sampling_params import SamplingParams

# Host-side events that move data or wait for the device, as the profiler names them (a
# replayed CUDA graph is one launch). A read of a CUDA tensor's value waits through one of the
# waits counted; scalar reads are counted apart, on any device (on the CPU they wait for nothing).
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
SCALAR_READ_EVENTS = ("aten::item",)
# torch's profiler synchronizes the device as it stops, inside its own window
# (``torch.autograd.profiler.profile.__exit__``): an H200 counted one cudaDeviceSynchronize
# whether 10 or 40 steps were profiled. It is no step's, and not counted as one.
PROFILER_OWN_SYNC = "cudaDeviceSynchronize"
COPY_EVENTS = ("Memcpy HtoD", "Memcpy DtoH", "Memcpy DtoD")
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
# Each figure a step: its subject, and its unit.
SUBJECTS = {
    "host ms a step": ("host time a step", "ms"),
    "device ms a step": ("device time a step", "ms"),
    "kernel launches a step": ("kernel launches a step", "count"),
    "host-device copies a step": ("host-device copies a step", "count"),
    "host syncs a step": ("host syncs a step", "count"),
    "scalar reads a step": ("scalar reads a step", "count"),
}


def run(args: argparse.Namespace) -> tuple[list[Figure], dict]:
    """The figures a decode step, and the report: the device, and each figure by its name."""
    llm = LLM(args.model, max_num_seqs=args.batch, **options.engine_kwargs(args))
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.warmup + args.steps + 8, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"Write a detailed essay about {TOPICS[i % len(TOPICS)]}.", params)
    for _ in range(args.warmup):  # prefills, and the first decode steps
        engine.step()
    activities = [ProfilerActivity.CPU]
    on_cuda = engine.config.torch_device().type == "cuda"
    if on_cuda:
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as profiler, synchronizing_calls(on_cuda) as waits:
        for _ in range(args.steps):
            engine.step()
    events = profiler.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    for place, count in waits.most_common():
        print(f"  a synchronizing operation at {place}: {count / args.steps:.1f} a step")
    for e in events:
        if e.key.startswith(SYNC_EVENTS):
            own = " (one is the profiler's own)" if e.key == PROFILER_OWN_SYNC else ""
            print(f"  {e.key}: {e.count} in {args.steps} steps{own}")
    profiler_syncs = sum(e.count for e in events if e.key == PROFILER_OWN_SYNC)

    def per_step(names: tuple[str, ...], not_the_steps: int = 0) -> float:
        return (
            sum(e.count for e in events if e.key.startswith(names)) - not_the_steps
        ) / args.steps

    figures = {
        "host ms a step": sum(e.self_cpu_time_total for e in events) / 1000 / args.steps,
        "device ms a step": sum(e.self_device_time_total for e in events) / 1000 / args.steps,
        "kernel launches a step": per_step(LAUNCH_EVENTS),
        "host-device copies a step": per_step(COPY_EVENTS),
        "host syncs a step": per_step(SYNC_EVENTS, min(1, profiler_syncs)),
        "scalar reads a step": per_step(SCALAR_READ_EVENTS),
    }
    print(f"{engine.config.torch_device()}, batch {args.batch}, {args.steps} decode steps:")
    for name, value in figures.items():
        print(f"  {name}: {value:.1f}")
    found = []
    for name, value in figures.items():
        subject, unit = SUBJECTS[name]
        found.append(Figure(subject, value, unit, {"batch": args.batch}, n=args.steps))
    report = {"device": str(engine.config.torch_device()), "steps": args.steps, "per_step": figures}
    return found, report


@contextlib.contextmanager
def synchronizing_calls(on_cuda: bool) -> Iterator[Counter[str]]:
    """Where the host waited for the device, on CUDA: torch's sync debug mode warns at each
    operation that synchronizes (a value read back, a shape that depends on data), and each
    warning's place in the code is counted, filled in when the block ends. Explicit waits on
    events are not operations and are not seen here; the profile's counts have them."""
    places: Counter[str] = Counter()
    if not on_cuda:
        yield places
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield places
        finally:
            torch.cuda.set_sync_debug_mode("default")
    places.update(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))


def add_command(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("step-profile", help="where a decode step goes (torch's profiler)")
    options.add_engine_options(parser, exclude=("max_num_seqs",))
    parser.add_argument(
        "--batch", type=positive_int, default=16, help="sequences decoding together"
    )
    parser.add_argument("--warmup", type=int, default=8, help="steps run before profiling")
    parser.add_argument("--steps", type=positive_int, default=10, help="decode steps profiled")
    parser.add_argument("--rows", type=positive_int, default=25, help="operators listed")
    add_result_option(parser)
    parser.set_defaults(func=recorded("step-profile", run))
