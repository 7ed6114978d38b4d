"""The native decode-attention kernel against the torch operations it replaces, and the
properties the engine rests on: each row computed independently of the others, bit for bit."""

import ctypes
import subprocess

import pytest
import torch

from etinfer.model import native_kernels
from etinfer.model.attention import torch_backend
from etinfer.model.attention.options import AttentionOptions
from etinfer.model.attention.pattern import build_decode_pattern, visible_blocks
from etinfer.model.attention.registry import auto_backend
from etinfer.model.attention.torch_backend import gathered_scores, pattern_attention
from etinfer.model.block_layout import DecodeBlocks
from etinfer.model.kv_cache import quantize_rows
from tests.builds import BUILDS, built_for

pytestmark = pytest.mark.skipif(
    native_kernels.compiler() is None or not native_kernels.enabled(), reason="no C compiler"
)
KV_DTYPES = list(native_kernels.KV_KINDS)


def test_the_kernels_build_where_a_compiler_is():
    """A compiler that cannot build them (a source error) fails here, instead of every kernel
    test skipping and the engine quietly taking its torch paths."""
    assert native_kernels.available()


def test_a_source_that_does_not_compile_fails_the_build_with_the_compilers_words(tmp_path):
    """Sources compile side by side: one that fails among good ones still fails the build,
    with what the compiler said, and leaves no library behind."""
    good, bad = tmp_path / "good.c", tmp_path / "bad.c"
    good.write_text("int one(void) { return 1; }\n")
    bad.write_text("int two(void) { return missing; }\n")
    cache = tmp_path / "cache"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(cache))
        with pytest.raises(subprocess.CalledProcessError) as failed:
            native_kernels.build_library([good, bad], ["-march=native"])
        assert "missing" in failed.value.stderr
        assert not list((cache / "etinfer" / "native").glob("*.so"))
        library = ctypes.CDLL(str(native_kernels.build_library([good], ["-march=native"])))
        assert library.one() == 1


def test_the_kernels_command_builds_both_libraries(capsys):
    from etinfer.cli import main

    assert main(["kernels"]) == 0
    said = capsys.readouterr().out
    assert "attention and cache: /" in said and "weight blocks: /" in said


HEADS, KV_HEADS, BLOCK, SLOTS_BLOCKS = 12, 4, 16, 96
GROUP = HEADS // KV_HEADS


def case(lengths, dim=64, window=None, keep=None, seed=0):
    """A random cache, queries, and the decode pattern and layout of sequences of ``lengths``;
    ``keep``: the share of blocks a random selection keeps (None: all)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(KV_HEADS * SLOTS_BLOCKS * BLOCK, dim, generator=gen)
    values = torch.randn(KV_HEADS * SLOTS_BLOCKS * BLOCK, dim, generator=gen)
    width = max(-(-n // BLOCK) for n in lengths)
    tables = torch.stack([torch.randperm(SLOTS_BLOCKS, generator=gen)[:width] for _ in lengths])
    blocks = DecodeBlocks(tables, torch.tensor(lengths), BLOCK)
    mask = None
    if keep is not None:
        mask = torch.rand(len(lengths), KV_HEADS, width, generator=gen) < keep
    visible = visible_blocks(blocks, KV_HEADS, mask, window)
    pattern = build_decode_pattern(blocks, visible, GROUP, SLOTS_BLOCKS * BLOCK, window)
    q = torch.randn(len(lengths) * HEADS, dim, generator=gen)
    return q, keys, values, pattern, blocks


def native(q, keys, values, pattern, *scales):
    return native_kernels.decode_attention(
        q,
        keys,
        values,
        pattern.crow,
        pattern.cols,
        pattern.outside,
        GROUP,
        q.shape[1] ** -0.5,
        *scales,
    )


@pytest.mark.parametrize("piece_bytes", [512 << 20, 1000 * 2 * 64 * 4])
def test_gathered_scores_equal_sampled_addmms_over_unsorted_tables(monkeypatch, piece_bytes):
    """The scores the torch form computes off the CPU (gathered rows, in one piece or in many)
    against the CPU's ``sampled_addmm``, on block tables in the pool's random order."""
    monkeypatch.setattr(torch_backend, "_GATHERED_BYTES", piece_bytes)
    q, keys, _, pattern, blocks = case([37, 5, 200, 16], 64, None, 0.5)
    assert (blocks.block_tables.diff(dim=1) < 0).any()  # the columns are not sorted
    structure = torch.sparse_csr_tensor(
        pattern.crow,
        pattern.cols,
        pattern.zeros,
        (q.shape[0], keys.shape[0]),
        check_invariants=False,
    )
    expected = torch.sparse.sampled_addmm(structure, q, keys.t(), beta=0.0, alpha=0.125)
    got = gathered_scores(q, keys, pattern, 0.125)
    torch.testing.assert_close(got, expected.values(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("lengths", "dim", "window", "keep"),
    [
        ([1], 64, None, None),
        ([37, 5, 200, 16], 64, None, None),
        ([300, 129], 128, 50, None),
        ([250, 90, 17], 16, None, 0.4),
        ([1000, 1000, 1000], 64, None, None),  # enough entries to split among threads
    ],
)
def test_native_matches_torch_operations(lengths, dim, window, keep):
    q, keys, values, pattern, _ = case(lengths, dim, window, keep)
    expected = pattern_attention(q, keys, values, pattern, dim**-0.5)
    got = native(q, keys, values, pattern)
    for name, a, b in zip(
        ("out", "row max", "denominators", "weights"), got, expected, strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    # Entries outside the context carry no weight at all.
    assert not got[3][pattern.masked].any()


def test_a_row_is_the_same_alone_and_in_any_batch():
    lengths = [700, 33, 400, 1200, 64]
    q, keys, values, pattern, blocks = case(lengths)
    batched = native(q, keys, values, pattern)[0].view(len(lengths), HEADS, -1)
    for i, length in enumerate(lengths):
        alone = DecodeBlocks(blocks.block_tables[i : i + 1], blocks.context_lens[i : i + 1], BLOCK)
        visible = visible_blocks(alone, KV_HEADS)
        pattern = build_decode_pattern(alone, visible, GROUP, SLOTS_BLOCKS * BLOCK)
        out = native(q[i * HEADS : (i + 1) * HEADS], keys, values, pattern)[0]
        assert torch.equal(out.view(HEADS, -1), batched[i]), f"sequence {i} ({length} tokens)"


@pytest.fixture(params=list(BUILDS))
def build(request, monkeypatch):
    """The kernels as compiled for ``BUILDS[param]``, in place of the engine's build."""
    library = built_for(request.param, native_kernels.compiled)
    monkeypatch.setattr(native_kernels, "library", lambda: library)
    return request.param


@pytest.mark.parametrize(("dim", "block"), [(64, 16), (128, 12), (40, 5)])
def test_every_build_gives_a_row_the_same_bits_however_the_call_is_grouped(
    build, dim, block, monkeypatch
):
    """A decode row alone, before and after other sequences, as one of a sequence's verification
    rows (its last token and drafts: each row its own context) and split among threads: the
    same bits, in every build. Blocks of 12 or 5 tokens give rows whose entries are not a
    multiple of eight (the last ones take the kernel's remainder path); a head size of 40, the
    loops not specialised for 64 or 128. What differs between the engine's paths (a prefill row
    against a decode row) is another computation, not another grouping: batch_invariant takes
    prefill rows through this kernel too (tests/test_correctness.py)."""
    lengths = [700, 33, 400, 1200, 64, 401, 402, 403, 7]  # 401-403: one sequence verifying
    count, slots = len(lengths), 256 * block
    gen = torch.Generator().manual_seed(4)
    keys, values = (torch.randn(KV_HEADS * slots, dim, generator=gen) for _ in "kv")
    tables = torch.stack([torch.randperm(256, generator=gen)[: -(-1200 // block)] for _ in lengths])
    tables[6:8] = tables[5]  # the verifying sequence's rows read its blocks
    context = torch.tensor(lengths)
    q = torch.randn(count, HEADS, dim, generator=gen)

    def attend(rows: list[int], threads: int) -> torch.Tensor:
        """Output, row max and denominator of each head of ``rows`` in one call."""
        blocks = DecodeBlocks(tables[rows], context[rows], block)
        pattern = build_decode_pattern(blocks, visible_blocks(blocks, KV_HEADS), GROUP, slots)
        monkeypatch.setattr(native_kernels, "_ENTRIES_PER_THREAD", 1 if threads > 1 else 1 << 30)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out, row_max, denominators, _ = native(q[rows].flatten(0, 1), keys, values, pattern)
        finally:
            torch.set_num_threads(before)
        stats = torch.stack([row_max, denominators], -1)
        return torch.cat([out, stats], -1).view(len(rows), HEADS, dim + 2)

    everything = list(range(count))
    whole = attend(everything, threads=1)
    for threads in (2, 3):
        assert torch.equal(attend(everything, threads), whole), f"{build}: {threads} threads"
        assert torch.equal(attend(everything[::-1], threads), whole.flip(0)), f"{build}: reversed"
    for i in everything:
        others = everything[:i] + everything[i + 1 :]
        for rows, threads in (([i], 1), ([*others, i], 2), ([i, *others[:3]], 3)):
            got = attend(rows, threads)[rows.index(i)]
            assert torch.equal(got, whole[i]), f"{build}: row {i} ({lengths[i]} tokens), {rows}"


def test_every_build_norms_a_row_the_same_alone_and_in_a_batch(build):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 576, generator=gen) * 3
    residual = torch.randn(9, 576, generator=gen).bfloat16()
    weight = torch.rand(576, generator=gen) + 0.5
    out, h = native_kernels.residual_rms_norm(x, residual, weight, 1e-5)
    for rows in [*(slice(i, i + 1) for i in range(9)), slice(2, 7), slice(5, 9)]:
        part_out, part_h = native_kernels.residual_rms_norm(x[rows], residual[rows], weight, 1e-5)
        assert torch.equal(part_out, out[rows]) and torch.equal(part_h, h[rows]), f"{build}: {rows}"


def test_rows_of_a_group_with_different_entries_are_refused():
    q, keys, values, pattern, _ = case([40, 40])
    crow = pattern.crow.clone()
    crow[1] -= BLOCK  # the first group's rows no longer read the same number of entries
    with pytest.raises(ValueError, match="rows a group"):
        native_kernels.decode_attention(
            q, keys, values, crow, pattern.cols, pattern.outside, GROUP, 0.125
        )


def test_entries_outside_the_cache_are_refused_before_any_read():
    q, keys, values, pattern, _ = case([40, 40])
    cols = pattern.cols.clone()
    cols[-1] = keys.shape[0]  # one row past the cache
    with pytest.raises(IndexError, match="outside"):
        native_kernels.decode_attention(
            q, keys, values, pattern.crow, cols, pattern.outside, GROUP, 0.125
        )
    cols[-1] = -1
    with pytest.raises(IndexError, match="outside"):
        native_kernels.decode_attention(
            q, keys, values, pattern.crow, cols, pattern.outside, GROUP, 0.125
        )
    crow = pattern.crow.clone()
    crow[-1] -= 1  # offsets that no longer count the entries
    with pytest.raises(IndexError, match="count"):
        native_kernels.decode_attention(
            q, keys, values, crow, pattern.cols, pattern.outside, GROUP, 0.125
        )


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("ETINFER_NATIVE", "0")
    native_kernels.library.cache_clear()
    try:
        assert not native_kernels.available()
        options = AttentionOptions(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=64)
        assert auto_backend(options, torch.device("cpu")) == "torch"
    finally:
        monkeypatch.delenv("ETINFER_NATIVE")
        native_kernels.library.cache_clear()
    assert native_kernels.available()


@pytest.mark.parametrize("residual_dtype", [None, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_residual_norm_matches_torch_operations(residual_dtype, out_dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 576, generator=gen) * 3
    residual = None
    if residual_dtype is not None:
        residual = torch.randn(7, 576, generator=gen).to(residual_dtype)
    weight = torch.rand(576, generator=gen) + 0.5
    out, h = native_kernels.residual_rms_norm(x, residual, weight, 1e-5, out_dtype)
    expected_x = x if residual is None else x + residual
    assert torch.equal(out, expected_x)  # the add is exact either way
    expected = torch.nn.functional.rms_norm(expected_x, (576,), weight, 1e-5)
    assert h.dtype == out_dtype
    if out_dtype == torch.float32:  # the sum of squares in another order: float rounding only
        torch.testing.assert_close(h, expected, rtol=1e-5, atol=1e-6)
        return
    # At most one bfloat16 step apart, and rarely.
    torch.testing.assert_close(h.float(), expected, rtol=2**-7, atol=0)
    assert (h != expected.bfloat16()).float().mean() < 0.01


def test_one_query_head_per_kv_head():
    gen = torch.Generator().manual_seed(2)
    lengths, dim = [45, 300], 64
    keys, values = (torch.randn(KV_HEADS * SLOTS_BLOCKS * BLOCK, dim, generator=gen) for _ in "kv")
    tables = torch.stack([torch.randperm(SLOTS_BLOCKS, generator=gen)[:19] for _ in lengths])
    blocks = DecodeBlocks(tables, torch.tensor(lengths), BLOCK)
    pattern = build_decode_pattern(
        blocks, visible_blocks(blocks, KV_HEADS), 1, SLOTS_BLOCKS * BLOCK
    )
    q = torch.randn(len(lengths) * KV_HEADS, dim, generator=gen)
    expected = pattern_attention(q, keys, values, pattern, dim**-0.5)
    got = native_kernels.decode_attention(
        q, keys, values, pattern.crow, pattern.cols, pattern.outside, 1, dim**-0.5
    )
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)


def test_cache_write_equals_indexed_copies():
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(2, KV_HEADS, 64, 16, generator=gen)
    # As the layer hands them over: views into one projection output, rows apart by its width.
    projection = torch.randn(5, 3 * KV_HEADS, 16, generator=gen)
    keys, values = projection[:, :KV_HEADS], projection[:, 2 * KV_HEADS :]
    slots = torch.tensor([7, 0, 63, 12, 30])
    expected = cache.clone()
    expected[0].index_copy_(1, slots, keys.transpose(0, 1))
    expected[1].index_copy_(1, slots, values.transpose(0, 1))
    assert native_kernels.write_cache(cache[0], cache[1], keys, values, slots)
    assert torch.equal(cache, expected)
    # What it does not take, it leaves to the caller; a slot outside the cache is refused.
    assert not native_kernels.write_cache(cache[0], cache[1], keys[:4], values, slots)
    with pytest.raises(IndexError, match="outside"):
        native_kernels.write_cache(cache[0], cache[1], keys, values, slots + 60)
    assert torch.equal(cache, expected)


SPECIAL = [
    0.0,
    -0.0,
    1.0,
    -2.5,
    65504.0,
    65519.9,
    65520.0,
    1e6,
    6e-8,
    3e-8,
    2.9e-8,
    1e-5,
    6.1e-5,
    -7.3e-6,
    1e-40,
    float("inf"),
    -float("inf"),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cache_write_rounds_as_torch_does(build, dtype):
    """Into a 16-bit cache, each float rounded to nearest even as ``Tensor.to`` rounds it, bit
    for bit: normal values, halfway cases, subnormals, overflow to infinity; in every build (the
    x86-64 one converts without F16C)."""
    gen = torch.Generator().manual_seed(5)
    dim, rows = 24, 40  # 24: a remainder past the vector loop
    floats = torch.randn(rows, KV_HEADS, dim, generator=gen) * 10.0 ** torch.randint(
        -9, 6, (rows, KV_HEADS, dim), generator=gen
    )
    floats.view(-1)[: len(SPECIAL)] = torch.tensor(SPECIAL)
    halfway = torch.arange(1024, 1024 + 64, dtype=torch.int32) << 13 | 1 << 12  # ties in float16
    floats.view(-1)[len(SPECIAL) : len(SPECIAL) + 64] = (halfway + (127 - 15 << 23)).view(
        torch.float32
    )
    cache = torch.zeros(2, KV_HEADS, 64, dim, dtype=dtype)
    slots = torch.randperm(64, generator=gen)[:rows]
    assert native_kernels.write_cache(cache[0], cache[1], floats, -floats, slots)
    expected = floats.transpose(0, 1).to(dtype)
    for got, want in ((cache[0][:, slots], expected), (cache[1][:, slots], -expected)):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    nan = torch.full((1, KV_HEADS, dim), float("nan"))
    assert native_kernels.write_cache(cache[0], cache[1], nan, nan, slots[:1])
    assert cache[0][:, slots[0]].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_over_a_16_bit_cache_is_decode_over_its_widened_values(build, dtype):
    """The kernel widens each stored element exactly and then computes as for float32: the
    same bits as the float32 kernel given the widened cache."""
    q, keys, values, pattern, _ = case([37, 5, 200, 16], dim=64, keep=0.5)
    keys, values = keys.to(dtype), values.to(dtype)
    got = native(q, keys, values, pattern)
    wide = native(q, keys.float(), values.float(), pattern)
    for a, b in zip(got, wide, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="one dtype"):
        native(q, keys, values.float(), pattern)


def test_an_int8_cache_is_written_as_quantize_rows_writes_it_and_read_with_its_scales(build):
    """The native write quantizes each (token, KV head) row exactly as the torch path does (the
    same scale bits, the same integers, ties to even); decode over the int8 rows equals decode
    over their dequantized values within float32 rounding."""
    gen = torch.Generator().manual_seed(6)
    dim, rows, slots = 64, 50, 96
    floats = torch.randn(rows, KV_HEADS, dim, generator=gen) * torch.rand(rows, KV_HEADS, 1) * 9
    floats[3, 1] = 0.0  # a zero row: scale 0, integers 0
    floats[4, 0, :2] = torch.tensor([127.0, 0.5])  # 0.5 rounds to 0 (even), 127 stays
    cache = torch.zeros(2, KV_HEADS, slots, dim, dtype=torch.int8)
    scales = torch.zeros(2, KV_HEADS, slots)
    where = torch.randperm(slots, generator=gen)[:rows]
    assert native_kernels.write_cache(cache[0], cache[1], floats, -floats, where, *scales)
    quantized, scale = quantize_rows(floats.transpose(0, 1))
    assert torch.equal(cache[0][:, where], quantized) and torch.equal(scales[0][:, where], scale)
    assert torch.equal(cache[1][:, where], -quantized) and torch.equal(scales[1][:, where], scale)
    assert cache[0][1, where[3]].eq(0).all() and scales[0][1, where[3]] == 0
    with pytest.raises(ValueError, match="scales"):
        native_kernels.write_cache(cache[0], cache[1], floats, floats, where)

    q, keys, values, pattern, _ = case([37, 5, 200, 16], dim=64, keep=0.5)
    (key_ints, key_scales), (value_ints, value_scales) = map(quantize_rows, (keys, values))
    got = native(q, key_ints, value_ints, pattern, key_scales, value_scales)
    dequantized = (key_ints * key_scales[:, None], value_ints * value_scales[:, None])
    expected = native(q, *dequantized, pattern)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="int8"):
        native(q, key_ints, value_ints, pattern)
