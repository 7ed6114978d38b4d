"""Resident memory of an engine against its file and KV cache ("memory as loaded").

    etinfer bench memory --modes auto gguf none

Each mode runs in a fresh process of its own (Linux: the figures are the process's resident set
from ``/proc/self/status``, the file's resident pages from ``/proc/self/pagemap``), measured over
what ``import torch, etinfer`` holds, at four points:

- ``model``: after ``load_model`` (the file's metadata read, the tokenizer built);
- ``loaded``: after ``LLM(model, quantization=MODE, num_kvcache_blocks=N)``;
- ``request``: after one short request;
- ``steady``: after ``--steady-tokens`` more generated at temperature 1, where rows read at
  random (the embedding's, the head's candidates) have had time to bring pages back.

The target compares these with the file's size plus the KV pool's bytes. The pool's pages are
written once at load, so that they count as they do once the pool has filled (untouched, they
would not be resident and the figures would flatter). ``file pages`` is what of the GGUF mapping
is resident at the end: the weights' prepared copy replaces it, so anything here is held twice.

The run's result holds each mode's resident memory at the four points, its steady ratio to file
+ KV pool and its file pages (its ``details``: every mode's figures as the children print them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from etinfer.bench.common.child import child_figures, with_child
from etinfer.bench.common.machine import cpu_flags
from etinfer.bench.common.results import Figure, add_result_option, model_labels, recorded
from etinfer.model.catalog import resolve
from etinfer.options import positive_int

MiB = 2**20


def resident_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise OSError("no VmRSS in /proc/self/status")


def mapping_resident_mib(mapping: np.memmap) -> float:
    """How much of ``mapping`` is resident in this process: the present bit of each of its
    pages in ``/proc/self/pagemap`` (readable without privileges; the frame numbers are not)."""
    page = os.sysconf("SC_PAGE_SIZE")
    first = mapping.ctypes.data // page
    last = (mapping.ctypes.data + mapping.nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = np.frombuffer(pagemap.read((last - first + 1) * 8), dtype=np.uint64)
    present = int(np.count_nonzero(entries >> np.uint64(63)))
    return present * page / MiB


def child(args: argparse.Namespace) -> dict:
    import torch

    import etinfer  # noqa: F401  (the baseline holds what importing the package holds)
    from etinfer import LLM, SamplingParams
    from etinfer.model.loader import load_model

    torch.set_num_threads(args.threads)
    base = resident_mib()
    model = load_model(args.model)
    after = {"model": resident_mib() - base}
    llm = LLM(model, quantization=args.child, num_kvcache_blocks=args.kv_blocks)
    for tensor in llm.engine.runner.cache.tensors:  # every page, as once the pool has filled
        tensor.zero_()
    after["loaded"] = resident_mib() - base
    llm.generate(["Hello, how are you?"], SamplingParams(max_tokens=16))  # base models too
    after["request"] = resident_mib() - base
    params = SamplingParams(temperature=1.0, max_tokens=args.steady_tokens, seed=0, ignore_eos=True)
    llm.generate(["Write a long story about a lighthouse keeper."], params)
    after["steady"] = resident_mib() - base
    return {
        "after": after,
        "file_mib": model.path.stat().st_size / MiB if model.path.is_file() else 0.0,
        "kv_mib": llm.engine.runner.cache.nbytes / MiB,
        "file_pages_mib": 0.0
        if model.file_mapping is None
        else mapping_resident_mib(model.file_mapping),
    }


def table(results: dict[str, dict]) -> str:
    lines = [
        "| mode | model read (MiB) | loaded | after a request | steady | file + KV | steady / "
        "(file + KV) | file pages resident |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, r in results.items():
        a, budget = r["after"], r["file_mib"] + r["kv_mib"]
        lines.append(
            f"| {mode} | {a['model']:.1f} | {a['loaded']:.1f} | {a['request']:.1f} | "
            f"{a['steady']:.1f} | {budget:.1f} | **{a['steady'] / budget:.3f}x** | "
            f"{r['file_pages_mib']:.1f} |"
        )
    return "\n".join(lines)


def figures(results: dict[str, dict], model: dict) -> list[Figure]:
    found = []
    for mode, r in results.items():
        labels = {"mode": mode} | model
        for point, mib in r["after"].items():
            found.append(Figure("resident memory", mib, "MiB", labels | {"point": point}))
        budget = r["file_mib"] + r["kv_mib"]
        steady = labels | {"point": "steady", "vs": "file + kv pool"}
        found.append(Figure("resident memory", r["after"]["steady"] / budget, "x", steady))
        found.append(Figure("file pages resident", r["file_pages_mib"], "MiB", labels))
    return found


def run(args: argparse.Namespace) -> tuple[list[Figure], dict]:
    if not Path("/proc/self/pagemap").exists():
        raise SystemExit(
            "error: bench memory reads Linux's /proc/self/status and /proc/self/pagemap"
        )
    results = {}
    for mode in args.modes:
        command = [sys.executable, "-m", "etinfer.cli", "bench", "memory", "--child", mode]
        command += ["--kv-blocks", str(args.kv_blocks), "--threads", str(args.threads)]
        command += ["--steady-tokens", str(args.steady_tokens)]
        command += ["--model", args.model] if args.model else []
        measured = child_figures(command, mode)
        if measured is None:
            raise SystemExit(f"error: the {mode} engine failed")
        results[mode] = measured
        print(f"{mode}: {json.dumps(measured)}", flush=True)
    print(f"\nMiB over `import torch, etinfer`, {args.threads} threads, CPU flags: {cpu_flags()}")
    print(table(results))
    report = {"threads": args.threads, "kv_blocks": args.kv_blocks, "modes": results}
    return figures(results, model_labels(resolve(args.model))), report


def add_command(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("memory", help="resident memory against the file and KV cache")
    parser.add_argument("--model", help="a .gguf file, a folder or an installed model's name")
    parser.add_argument("--modes", nargs="+", default=["auto", "gguf", "none"])
    parser.add_argument("--kv-blocks", type=positive_int, default=64, help="the KV pool's blocks")
    parser.add_argument("--steady-tokens", type=positive_int, default=512)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    add_result_option(parser)
    parser.set_defaults(func=with_child(child, recorded("memory", run)))
