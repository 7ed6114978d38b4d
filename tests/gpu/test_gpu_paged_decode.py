"""The GPU's paged decode kernel against attention computed in float64 from gathered rows.

Without a GPU the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET, which conftest.py
sets before anything imports Triton): the same program, element by element, so its indexing,
masking and split merging are checked on every host where Triton is installed."""

from __future__ import annotations

import pytest
import torch

from etinfer.model.gpu import available
from etinfer.model.gpu import paged_decode as gpu

pytestmark = pytest.mark.skipif(not available(), reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(
    q, keys, values, k_scales, v_scales, tables, context_lens, bs, scale, window, keep, cap=None
):
    rows, heads, dim = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    out = torch.zeros(rows, heads, dim, dtype=torch.float64)
    row_max = torch.full((rows, heads), -torch.inf, dtype=torch.float64)
    sums = torch.zeros(rows, heads, dtype=torch.float64)
    for row in range(rows):
        n = int(context_lens[row])
        positions = torch.arange(n)
        visible = torch.ones(n, dtype=torch.bool)
        if window:
            visible &= positions >= n - window
        slots = tables[row, positions // bs].long() * bs + positions % bs
        for head in range(heads):
            h = head // group
            seen = visible.clone()
            if keep is not None:
                seen &= keep[row, h, positions // bs].cpu()
            if not seen.any():
                continue
            k = keys[h, slots.to(keys.device)].double().cpu()
            v = values[h, slots.to(keys.device)].double().cpu()
            if k_scales is not None:
                k *= k_scales[h, slots.to(keys.device)].double().cpu()[:, None]
                v *= v_scales[h, slots.to(keys.device)].double().cpu()[:, None]
            scores = k @ q[row, head].double().cpu() * scale
            if cap is not None:
                scores = cap * torch.tanh(scores / cap)
            scores[~seen] = -torch.inf
            out[row, head] = torch.softmax(scores, 0) @ v
            row_max[row, head] = scores.max()
            sums[row, head] = (scores - scores.max()).exp().sum()
    return out, row_max, sums


CASES = [
    # rows, heads, kv_heads, dim, block_size, cache dtype, window, keep, contexts, soft cap
    (3, 9, 3, 64, 16, torch.float32, None, False, [1, 37, 300], None),
    (2, 4, 1, 96, 4, torch.bfloat16, None, False, [5, 130], None),
    (4, 8, 8, 32, 16, torch.float16, 20, False, [0, 16, 17, 90], None),
    (2, 6, 2, 64, 8, torch.int8, None, True, [70, 200], None),
    (1, 9, 3, 64, 16, torch.float32, None, True, [1000], None),  # many splits
    (2, 9, 3, 64, 16, torch.float16, 300, True, [1000, 333], None),  # a window from mid-tile
    # Gemma 2's soft cap, small enough to bend most scores (theirs is 50 on larger scores)
    (3, 8, 4, 32, 16, torch.float32, None, False, [3, 90, 400], 0.5),
    (2, 8, 4, 32, 16, torch.bfloat16, 40, True, [300, 77], 2.0),
]


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_paged_decode_matches_float64_attention(case) -> None:
    rows, heads, kv_heads, dim, bs, dtype, window, with_keep, contexts, cap = case
    g = torch.Generator().manual_seed(len(contexts) * 7 + dim)
    num_blocks = 200
    slots = num_blocks * bs
    raw_keys = torch.randn(kv_heads, slots, dim, generator=g)
    raw_values = torch.randn(kv_heads, slots, dim, generator=g)
    k_scales = v_scales = None
    if dtype == torch.int8:
        keys, values = (raw_keys * 40).to(torch.int8), (raw_values * 40).to(torch.int8)
        k_scales = torch.rand(kv_heads, slots, generator=g) * 0.05
        v_scales = torch.rand(kv_heads, slots, generator=g) * 0.05
    else:
        keys, values = raw_keys.to(dtype), raw_values.to(dtype)
    context_lens = torch.tensor(contexts)
    width = max(1, -(-max(contexts) // bs))
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in range(rows)])
    wide = torch.zeros(rows, width + 5, dtype=tables.dtype)  # rows of a wider buffer, as graphs
    wide[:, :width] = tables
    keep = None
    if with_keep:
        keep = torch.rand(rows, kv_heads, width, generator=g) < 0.6
    q = torch.randn(rows, heads, dim, generator=g)
    scale = dim**-0.5
    moved = [
        None if t is None else t.to(DEVICE)
        for t in (q, keys, values, k_scales, v_scales, wide, context_lens, keep)
    ]
    moved[5] = moved[5][:, :width]
    got, row_max, denominators = gpu.paged_decode(
        *moved[:7], bs, scale, window, moved[7], softcap=cap
    )
    want, want_max, want_sum = reference(
        q, keys, values, k_scales, v_scales, tables, context_lens, bs, scale, window, keep, cap
    )
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(row_max.double().cpu(), want_max, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(denominators.double().cpu(), want_sum, rtol=1e-5, atol=1e-5)


def test_splits_fill_the_gpu_and_stay_powers_of_two() -> None:
    assert gpu.num_splits(rows=1, kv_heads=3, max_context=8192) == 32
    assert gpu.num_splits(rows=256, kv_heads=3, max_context=8192) == 1
    assert gpu.num_splits(rows=1, kv_heads=3, max_context=100) == 2  # no split shorter than a tile
    assert gpu.num_splits(rows=8, kv_heads=3, max_context=8192) == 16


def test_one_split_makes_a_row_independent_of_its_batch() -> None:
    """batch_invariant's contract on the GPU: with one split a row's result is bit for bit the
    same alone as beside other rows (the default split count follows the batch size)."""
    g = torch.Generator().manual_seed(3)
    kv_heads, heads, dim, bs, slots = 3, 9, 64, 16, 64 * 16
    keys = torch.randn(kv_heads, slots, dim, generator=g).to(DEVICE)
    values = torch.randn(kv_heads, slots, dim, generator=g).to(DEVICE)
    q = torch.randn(5, heads, dim, generator=g).to(DEVICE)
    tables = torch.stack([torch.randperm(64, generator=g)[:40] for _ in range(5)]).to(DEVICE)
    lens = torch.tensor([640, 17, 300, 639, 1]).to(DEVICE)

    def attend(rows: slice) -> torch.Tensor:
        args = (q[rows], keys, values, None, None, tables[rows], lens[rows], bs, dim**-0.5)
        return gpu.paged_decode(*args, splits=1)[0]

    batched = attend(slice(None))
    for row in range(5):
        assert torch.equal(attend(slice(row, row + 1))[0], batched[row])
