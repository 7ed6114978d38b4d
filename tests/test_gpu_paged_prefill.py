"""The GPU's paged prefill kernel against causal attention computed in float64 from gathered
rows. Without a GPU the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET, which
conftest.py sets before anything imports Triton)."""

from __future__ import annotations

import pytest
import torch

from etinfer.model.gpu import available
from etinfer.model.gpu.paged_prefill import paged_prefill

pytestmark = pytest.mark.skipif(not available(), reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(q, keys, values, k_scales, v_scales, slots, scale, window, cap):
    queries, heads, _ = q.shape
    group = heads // keys.shape[0]
    context = slots.shape[0]
    k = keys[:, slots].double()
    v = values[:, slots].double()
    if k_scales is not None:
        k *= k_scales[:, slots].double()[..., None]
        v *= v_scales[:, slots].double()[..., None]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [heads, context, dim]
    scores = torch.einsum("qhd,hkd->hqk", q.double(), k) * scale
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    position = torch.arange(context - queries, context)[:, None]
    key = torch.arange(context)[None, :]
    visible = key <= position
    if window:
        visible &= key > position - window
    scores = scores.masked_fill(~visible, -torch.inf)
    return torch.einsum("hqk,hkd->qhd", torch.softmax(scores, -1), v)


CASES = [
    # queries, context, heads, kv_heads, dim, cache dtype, window, soft cap
    (70, 70, 9, 3, 64, torch.float32, None, None),  # no prefix
    (50, 300, 9, 3, 64, torch.float32, None, None),  # a chunk after a prefix
    (130, 200, 4, 1, 96, torch.bfloat16, None, None),  # a padded head dimension
    (64, 500, 8, 8, 32, torch.float16, 100, None),  # a window
    (33, 260, 6, 2, 64, torch.int8, 40, None),  # int8 with scales, a window shorter than a tile
    (40, 120, 8, 4, 32, torch.float32, None, 0.5),  # Gemma 2's soft cap
    (20, 90, 4, 1, 256, torch.bfloat16, 30, 2.0),  # Gemma's head dimension
]


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_paged_prefill_matches_float64_attention(case):
    queries, context, heads, kv_heads, dim, dtype, window, cap = case
    g = torch.Generator().manual_seed(queries + context)
    num_slots = 1024
    raw_keys = torch.randn(kv_heads, num_slots, dim, generator=g)
    raw_values = torch.randn(kv_heads, num_slots, dim, generator=g)
    k_scales = v_scales = None
    if dtype == torch.int8:
        keys, values = (raw_keys * 40).to(torch.int8), (raw_values * 40).to(torch.int8)
        k_scales = torch.rand(kv_heads, num_slots, generator=g) * 0.05
        v_scales = torch.rand(kv_heads, num_slots, generator=g) * 0.05
    else:
        keys, values = raw_keys.to(dtype), raw_values.to(dtype)
    slots = torch.randperm(num_slots, generator=g)[:context]  # the cache's order, not the text's
    q = torch.randn(queries, heads, dim, generator=g)
    scale = dim**-0.5
    moved = [None if t is None else t.to(DEVICE) for t in (q, keys, values, k_scales, v_scales)]
    got = paged_prefill(*moved, slots.to(DEVICE), scale, window, cap)
    want = reference(q, keys, values, k_scales, v_scales, slots, scale, window, cap)
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 50])
def test_listed_positions_are_read_alone_and_causally(window):
    """Sparse prefill's form: the keys are a list of positions (kept blocks, then the local
    window), each still masked causally by its position."""
    g = torch.Generator().manual_seed(7)
    queries, context, heads, dim, bs = 40, 400, 3, 64, 16
    keys, values = torch.randn(2, 1, 1024, dim, generator=g)
    slots = torch.randperm(1024, generator=g)[:context]
    kept = torch.tensor([0, 3, 9, 22, 23])  # blocks; 22 and 23 (352-383) pass queries 360..
    local = torch.arange(context - queries - 20, context)
    positions = torch.cat([(kept[:, None] * bs + torch.arange(bs)).flatten(), local])
    q = torch.randn(queries, heads, dim, generator=g)
    first, scale = context - queries, dim**-0.5
    moved = [t.to(DEVICE) for t in (q, keys, values)]
    got = paged_prefill(
        *moved[:3], None, None, slots.to(DEVICE), scale, window,
        key_positions=positions.to(DEVICE), first=first,
    )  # fmt: skip
    k, v = keys[0, slots[positions]].double(), values[0, slots[positions]].double()
    scores = torch.einsum("qhd,kd->hqk", q.double(), k) * scale
    query_at = torch.arange(first, context)[:, None]
    visible = positions[None, :] <= query_at
    if window:
        visible &= positions[None, :] > query_at - window
    weights = torch.softmax(scores.masked_fill(~visible, -torch.inf), -1)
    want = torch.einsum("hqk,kd->qhd", weights, v)
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5)


def test_an_engine_on_the_gpu_kernels_gives_the_torch_paths_tokens(tiny_model, monkeypatch):
    """The kernels wired into the engine, on the CPU in the interpreter: a prompt prefilled in
    chunks (each after the last one's prefix: SDPA over the gathered prefix, which beat the
    prefill kernel on an H200; the kernel serves sparse prefill's pieces) and decoded through
    the decode kernel gives the CPU paths' greedy tokens, with logprobs to rounding."""
    from etinfer import LLM, SamplingParams
    from etinfer.model import gpu, prefill_attention
    from etinfer.model.gpu import paged_decode

    prompt = [(17 * i + 5) % 1000 for i in range(80)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    settings = {"dtype": "float32", "kv_cache_dtype": "float32", "max_num_batched_tokens": 32}
    plain = LLM(tiny_model, **settings).generate([prompt], params)[0]
    calls = {"prefill": 0, "decode": 0}

    def counted(name, kernel):
        def call(*args, **kwargs):
            calls[name] += 1
            return kernel(*args, **kwargs)

        return call

    monkeypatch.setattr(gpu, "serves", lambda device: True)
    monkeypatch.setattr(
        prefill_attention, "paged_prefill", counted("prefill", prefill_attention.paged_prefill)
    )
    monkeypatch.setattr(paged_decode, "paged_decode", counted("decode", paged_decode.paged_decode))
    kernels = LLM(tiny_model, cuda_graphs=False, **settings).generate([prompt], params)[0]
    # Two layers: the five decode steps; dense chunks never reach the prefill kernel.
    assert calls == {"prefill": 0, "decode": 2 * 5}
    assert kernels.token_ids == plain.token_ids
    for ours, theirs, token in zip(kernels.logprobs, plain.logprobs, plain.token_ids, strict=True):
        assert ours[token].logprob == pytest.approx(theirs[token].logprob, abs=1e-4)


@pytest.mark.parametrize("cache", ["bfloat16", "int8"])
def test_the_prefill_attention_bench_times_both_paths_and_they_agree(cache):
    """`etinfer bench prefill-attention` at a toy size on the suite's device: both arms timed,
    the kernel within float32's rounding of SDPA over the gathered prefix."""
    from etinfer.bench.speed import prefill_attention
    from etinfer.cli import build_parser

    argv = ["bench", "prefill-attention", "--prefix", "96", "--queries", "32", "--repeats", "1"]
    figures = prefill_attention.run(build_parser().parse_args([*argv, "--cache-dtype", cache]))
    assert all(f["ms"] > 0 for f in figures.values())
    assert figures["paged-prefill kernel"]["max_difference"] < 1e-5
