"""Weight-matmul kernels for one decode step of the default model, side by side: what a quantized
weight path can gain on this machine before any of it is built.

Each candidate multiplies ``rows`` activation rows by every weight of one step: per layer the
fused q/k/v, the output projection, the fused gate/up and the down projection, and the output
head once. Weights are random with the model's shapes (a kernel's speed does not depend on the
values). ``--isa avx2`` runs the same in a second process with ATen and oneDNN held to AVX2, so
an AVX-512 host shows beside its own figures what an AVX2-only host's kernels do.

    etinfer bench kernels --rows 1 4 16 --isa avx2

The run's result holds each kernel's milliseconds a step by rows and ISA (its ``details``: the
tables by kernel and rows).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from etinfer.bench.common.child import child_figures, with_child
from etinfer.bench.common.machine import ISA_ENV, cpu_flags
from etinfer.bench.common.results import Figure, add_result_option, recorded
from etinfer.model.linear import Linear
from etinfer.options import positive_int

GROUP = 32  # weights per scale: GGUF's Q4_0, Q4_1 and Q8_0 blocks
# Kernels that cost a second per call at 16 rows are timed less.
SLOW = ("int4, f32 activations", "int8, f32 activations")


def step_shapes(model: str | None) -> list[tuple[int, int, int]]:
    """(out, in, count) of one decode step's weight matmuls."""
    from etinfer.model.loader import load_model

    c = load_model(model).config
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    layer = [
        (qkv, c.hidden_size),
        (c.hidden_size, c.num_heads * c.head_dim),
        (2 * c.intermediate_size, c.hidden_size),
        (c.hidden_size, c.intermediate_size),
    ]
    return [(o, i, c.num_layers) for o, i in layer] + [(c.vocab_size, c.hidden_size, 1)]


def candidates(out: int, inp: int, rows: int) -> dict[str, Callable[[], torch.Tensor]]:
    weight = torch.randn(out, inp) * 0.02
    x = torch.randn(rows, inp)
    xb = x.to(torch.bfloat16)
    packed = Linear(weight)  # oneDNN's blocked layout, the engine's float path
    wb = weight.to(torch.bfloat16)
    codes = torch.randint(0, 16, (out, inp), dtype=torch.int32)
    int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales = torch.randn(inp // GROUP, out, 2)
    int8 = torch.randint(-127, 128, (out, inp), dtype=torch.int8)
    channel = torch.rand(out)
    mm4 = torch.ops.aten._weight_int4pack_mm_for_cpu
    mm8 = torch.ops.aten._weight_int8pack_mm
    return {
        "f32 F.linear": lambda: F.linear(x, weight),
        "f32 oneDNN packed": lambda: packed(x),
        "bf16 F.linear": lambda: F.linear(xb, wb),
        "int4 g32, bf16 activations": lambda: mm4(xb, int4, GROUP, scales.bfloat16()),
        "int4, f32 activations": lambda: mm4(x, int4, GROUP, scales),
        "int8 per channel, bf16 activations": lambda: mm8(xb, int8, channel.bfloat16()),
        "int8, f32 activations": lambda: mm8(x, int8, channel),
    }


def seconds(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    for _ in range(2):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def measure(model: str | None, rows_list: list[int], repeats: int) -> dict[str, dict[str, float]]:
    """Milliseconds per step, by kernel and then by rows."""
    shapes = step_shapes(model)
    table: dict[str, dict[str, float]] = {}
    for rows in rows_list:
        for out, inp, count in shapes:
            for name, fn in candidates(out, inp, rows).items():
                n = max(2, repeats // 10) if name in SLOW else repeats
                row = table.setdefault(name, {})
                row[str(rows)] = row.get(str(rows), 0.0) + 1000 * count * seconds(fn, n)
    return table


def add_command(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("kernels", help="weight-matmul kernels of one decode step")
    parser.add_argument("--model", help="GGUF file or folder (default: the embedded model)")
    parser.add_argument("--rows", type=positive_int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=positive_int, default=30)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--isa", choices=sorted(ISA_ENV), help="also run held to this ISA")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_result_option(parser)
    parser.set_defaults(func=with_child(child, recorded("kernels", run)))


def child(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """The table of this process: the held-ISA child's part, and the parent's own."""
    torch.set_num_threads(args.threads)
    return measure(args.model, args.rows, args.repeats)


def run(args: argparse.Namespace) -> tuple[list[Figure], dict]:
    table = child(args)
    columns = {"native": table}
    if args.isa:
        command = [sys.executable, "-m", "etinfer.cli", *sys.argv[1:], "--child"]
        command.remove("--isa")
        command.remove(args.isa)
        env = {**os.environ, **ISA_ENV[args.isa]}
        held = child_figures(command, f"held to {args.isa}", env)
        if held is None:
            raise SystemExit(f"error: the kernels held to {args.isa} failed")
        columns[f"held to {args.isa}"] = held
    print(f"ms per decode step's weight matmuls, {args.threads} threads, torch {torch.__version__}")
    print(f"CPU flags: {cpu_flags()}")
    heads = [f"{isa}, {rows} rows" for isa in columns for rows in args.rows]
    print("| kernel | " + " | ".join(heads) + " |")
    print("|---|" + "---:|" * len(heads))
    for name in table:
        cells = [f"{t[name][str(r)]:,.1f}" for t in columns.values() for r in args.rows]
        print(f"| {name} | " + " | ".join(cells) + " |")
    figures = [
        Figure("weight matmuls", ms, "ms", {"kernel": name, "rows": int(rows), "isa": isa})
        for isa, kernels in columns.items()
        for name, by_rows in kernels.items()
        for rows, ms in by_rows.items()
    ]
    return figures, {"threads": args.threads, "columns": columns}
