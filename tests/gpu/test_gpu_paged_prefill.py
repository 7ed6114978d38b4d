"""The GPU's paged prefill kernel against causal attention computed in float64 from gathered
rows. Without a GPU the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET, which
conftest.py sets before anything imports Triton)."""

from __future__ import annotations

import pytest
import torch

from etinfer.model.gpu import available
from etinfer.model.gpu.paged_prefill import SIXTEEN_BIT, paged_prefill

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


def random_case(case):
    """The case's queries and a shuffled cache: (q, keys, values, key scales, value scales,
    slots), on the CPU."""
    queries, context, heads, kv_heads, dim, dtype, _, _ = case
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
    return q, keys, values, k_scales, v_scales, slots


def on_device(*tensors):
    return [None if t is None else t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_paged_prefill_matches_float64_attention(case):
    """IEEE float32 dots, whatever the cache stores: float64's result to float32's rounding."""
    *_, dim, _, window, cap = case
    tensors = random_case(case)
    scale = dim**-0.5
    got = paged_prefill(*on_device(*tensors), scale, window, cap, tensor_cores=False)
    want = reference(*tensors, scale, window, cap)
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5)


# Triton 3.6's interpreter computes bfloat16 dots wrongly (1e10 off a float32 product of the
# same 16x16 inputs, where float16's are right): compiled on a GPU they run.
SIXTEEN_BIT_CASES = [
    pytest.param(
        case, id=str(i),
        marks=pytest.mark.skipif(
            case[5] == torch.bfloat16 and DEVICE == "cpu",
            reason="Triton's interpreter gets bfloat16 dots wrong",
        ),
    )
    for i, case in enumerate(CASES) if case[5] in SIXTEEN_BIT
]  # fmt: skip
# The same shapes over float16 caches, which the interpreter computes right.
SIXTEEN_BIT_CASES += [
    pytest.param((*case[:5], torch.float16, *case[6:]), id=f"{i}-float16")
    for i, case in enumerate(CASES) if case[5] == torch.bfloat16
]  # fmt: skip


@pytest.mark.parametrize("case", SIXTEEN_BIT_CASES)
def test_tensor_core_dots_round_as_flash_attention_does(case):
    """A 16-bit cache's default: dots in its type on tensor cores. The queries (scaled) and each
    tile's softmax weights are rounded to that type, so the result agrees with float64 to that
    rounding: against queries rounded alike, what is left is the weights' rounding."""
    *_, dim, dtype, window, cap = case
    q, keys, values, _, _, slots = random_case(case)
    scale = dim**-0.5
    got = paged_prefill(
        *on_device(q, keys, values), None, None, slots.to(DEVICE), scale, window, cap
    )
    rounded_q = (q * scale).to(dtype).double() / scale
    want = reference(rounded_q, keys, values, None, None, slots, scale, window, cap)
    bound = 2 * torch.finfo(dtype).eps  # two units in the last place of a weight
    torch.testing.assert_close(got.double().cpu(), want, rtol=bound, atol=bound)
    exact = paged_prefill(
        *on_device(q, keys, values), None, None, slots.to(DEVICE), scale, window, cap,
        tensor_cores=False,
    )  # fmt: skip
    assert (got - exact).abs().max().item() > 0  # the rounding did happen: another path


def test_tensor_cores_need_a_sixteen_bit_cache():
    keys = torch.zeros(1, 32, 16, device=DEVICE)
    with pytest.raises(ValueError, match="tensor_cores needs a 16-bit cache"):
        paged_prefill(
            torch.zeros(4, 1, 16, device=DEVICE), keys, keys, None, None,
            torch.arange(8, device=DEVICE), 0.25, tensor_cores=True,
        )  # fmt: skip


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


@pytest.mark.parametrize(
    ("cache", "prefill_calls", "tolerance"),
    # float16 for the 16-bit cache: the interpreter gets bfloat16 dots wrong (above).
    [("float32", 0, 1e-4), ("float16", 2 * 2, 1e-2)],
)
def test_an_engine_on_the_gpu_kernels_gives_the_torch_paths_tokens(
    tiny_model, monkeypatch, cache, prefill_calls, tolerance
):
    """The kernels wired into the engine, on the CPU in the interpreter: a prompt prefilled in
    chunks and decoded through the decode kernel gives the CPU paths' greedy tokens, with
    logprobs to rounding. Over a float32 cache a chunk after a prefix takes SDPA over the
    gathered prefix (faster than float32 dots on an H200); over a 16-bit cache it takes the
    prefill kernel's tensor-core dots, whose rounding of queries and weights the tolerance
    allows for."""
    from etinfer import LLM, SamplingParams
    from etinfer.model.attention import triton_backend
    from etinfer.model.gpu import paged_decode

    prompt = [(17 * i + 5) % 1000 for i in range(80)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    settings = {"dtype": "float32", "kv_cache_dtype": cache, "max_num_batched_tokens": 32}
    plain = LLM(tiny_model, **settings).generate([prompt], params)[0]
    calls = {"prefill": 0, "decode": 0}

    def counted(name, kernel):
        def call(*args, **kwargs):
            calls[name] += 1
            return kernel(*args, **kwargs)

        return call

    monkeypatch.setattr(
        triton_backend, "paged_prefill", counted("prefill", triton_backend.paged_prefill)
    )
    monkeypatch.setattr(paged_decode, "paged_decode", counted("decode", paged_decode.paged_decode))
    kernels = LLM(tiny_model, cuda_graphs=False, attention_backend="triton", **settings)
    kernels = kernels.generate([prompt], params)[0]
    # Two layers: the five decode steps; the two chunks after the first, where the cache is
    # 16-bit (80 tokens in chunks of 32).
    assert calls == {"prefill": prefill_calls, "decode": 2 * 5}
    assert kernels.token_ids == plain.token_ids
    for ours, theirs, token in zip(kernels.logprobs, plain.logprobs, plain.token_ids, strict=True):
        assert ours[token].logprob == pytest.approx(theirs[token].logprob, abs=tolerance)


@pytest.mark.parametrize("cache", ["float16", "int8"])
def test_the_prefill_attention_bench_times_both_paths_and_they_agree(cache):
    """`etinfer bench prefill-attention` at a toy size on the suite's device: every arm timed,
    at the launcher's tiles and at those ``--tiles`` adds; the kernel's float32 dots within
    float32's rounding of SDPA over the gathered prefix, its 16-bit dots within theirs."""
    from etinfer.bench.speed import prefill_attention
    from etinfer.cli import build_parser

    argv = ["bench", "prefill-attention", "--prefix", "96", "--queries", "32", "--repeats", "1"]
    argv += ["--cache-dtype", cache, "--tiles", "32x16x2"]
    found, report = prefill_attention.run(build_parser().parse_args(argv))
    figures = report["arms"]
    assert all(f["ms"] > 0 for f in figures.values())
    for tiles in ("", ", tiles 32x16x2"):
        assert figures[f"paged-prefill kernel, float32 dots{tiles}"]["max_difference"] < 1e-5
        if cache == "float16":
            rounded = figures[f"paged-prefill kernel, 16-bit dots{tiles}"]["max_difference"]
            assert 0 < rounded < 2e-2
    assert len(figures) == (5 if cache == "float16" else 3)
    # Each arm's time; each kernel arm's ratio to SDPA's and its largest difference.
    assert len(found) == len(figures) + 2 * (len(figures) - 1)
    assert {f.labels["kv_cache_dtype"] for f in found} == {cache}


@pytest.mark.parametrize("value", ["64x64", "64x8x4", "48x64x4", "axbxc", "64x64x0"])
def test_the_bench_refuses_tiles_that_cannot_launch(value, capsys):
    from etinfer.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "prefill-attention", "--tiles", value])
    assert "--tiles" in capsys.readouterr().err
