"""The GPU kernels compile once per configuration, not once per step's shapes: Triton compiles a
variant for each pattern of integer arguments being 1 or a multiple of 16, unless told not to,
and a compile in the middle of a served step costs seconds (Table 1's eager arms on an H200).
Compiled kernels exist only on a GPU; Triton's interpreter compiles nothing."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from etinfer.model.gpu import available

pytestmark = pytest.mark.skipif(
    not (available() and torch.cuda.is_available()), reason="compiles happen on a GPU only"
)


@contextlib.contextmanager
def compiles() -> Iterator[Counter[str]]:
    """Kernels compiled (or loaded from Triton's disk cache) in the block, by name."""
    from triton import knobs

    counted: Counter[str] = Counter()

    def hook(*, fn, **_) -> None:
        counted[fn.name] += 1

    previous = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield counted
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def test_decode_compiles_once_for_every_batch_and_context() -> None:
    from etinfer.model.gpu.paged_decode import paged_decode

    kv_heads, heads, dim, bs, num_blocks = 3, 9, 64, 16, 128
    keys = torch.randn(kv_heads, num_blocks * bs, dim, device="cuda").bfloat16()
    values = torch.randn_like(keys)

    def step(rows: int, width: int, window: int | None, keep: bool) -> None:
        tables = torch.randint(0, num_blocks, (rows, width), device="cuda")
        lens = torch.full((rows,), width * bs - 3, device="cuda")
        kept = torch.rand(rows, kv_heads, width, device="cuda") < 0.5 if keep else None
        q = torch.randn(rows, heads, dim, device="cuda")
        paged_decode(q, keys, values, None, None, tables, lens, bs, dim**-0.5, window, kept)

    for keep in (False, True):
        step(2, 3, None, keep)  # this configuration's one compile, if no test compiled it yet
    with compiles() as counted:
        for rows, width, window in [(1, 1, None), (16, 17, 5), (5, 32, 16), (64, 100, 1)]:
            for keep in (False, True):
                step(rows, width, window, keep)
    assert not counted, f"recompiled as the batch changed: {dict(counted)}"


def test_prefill_compiles_once_for_every_chunk() -> None:
    from etinfer.model.gpu.paged_prefill import paged_prefill

    kv_heads, heads, dim, num_slots = 2, 6, 64, 2048
    keys = torch.randn(kv_heads, num_slots, dim, device="cuda").half()
    values = torch.randn_like(keys)

    def chunk(queries: int, context: int, window: int | None) -> None:
        slots = torch.randperm(num_slots, device="cuda")[:context]
        q = torch.randn(queries, heads, dim, device="cuda")
        paged_prefill(q, keys, values, None, None, slots, dim**-0.5, window, None)

    chunk(20, 70, None)
    with compiles() as counted:
        for queries, context, window in [(1, 1, None), (16, 32, 7), (33, 513, 16), (128, 1000, 1)]:
            chunk(queries, context, window)
    assert not counted, f"recompiled as the chunk changed: {dict(counted)}"


def test_weight_only_compiles_once_for_every_batch() -> None:
    from etinfer.model.gpu.weight_only import WeightOnlyLinear
    from etinfer.model.quantized import Int4Weight

    layer = WeightOnlyLinear(Int4Weight.quantize(torch.randn(96, 128), "w").to("cuda"))
    layer(torch.randn(3, 128, device="cuda").bfloat16())
    with compiles() as counted:
        for rows in (1, 16, 17, 64, 200):
            layer(torch.randn(rows, 128, device="cuda").bfloat16())
    assert not counted, f"recompiled as the batch changed: {dict(counted)}"
