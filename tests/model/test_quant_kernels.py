"""The quantized matmul kernels against the ``gguf`` package's own dequantization: each format's
blocks read as gguf reads them, the integer dot products exact, the 8-bit activations' error
bounded, and each row's result the same bits however the call is grouped."""

import os
import threading

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from etinfer.model import linear, native_kernels, quant_kernels
from etinfer.model.linear import BlockLinear
from etinfer.model.quantized import GGUFBlocks
from tests.builds import built_for

pytestmark = pytest.mark.skipif(not quant_kernels.available(), reason="no AVX2 kernels here")

Q = GGMLQuantizationType
FORMATS = list(quant_kernels.ACTIVATION_BLOCK)
# Where each block keeps its float16 fields (scale, minimum): set to sane values, the rest random.
HALF_FIELDS = {
    Q.Q4_0: [0],
    Q.Q4_1: [0, 2],
    Q.Q5_0: [0],
    Q.Q8_0: [0],
    Q.Q4_K: [0, 2],
    Q.Q5_K: [0, 2],
    Q.Q6_K: [208],
}


@pytest.fixture(params=["native", "x86-64-v3", "x86-64-v3, Zen 3 tuning"])
def build(request, monkeypatch):
    """The quantized kernels as an AVX2 host would build them (and this host), in place of the
    engine's build: a row's bits must not depend on the call in any of them."""
    library = built_for(request.param, quant_kernels.compiled)
    monkeypatch.setattr(quant_kernels, "library", lambda: library)
    return request.param


def random_blocks(qtype, out: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random bytes as [out, bytes a row] blocks, with float16 fields of moderate size."""
    rng = np.random.default_rng(seed)
    elements, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (out * k // elements, size), dtype=np.uint8)
    for at in HALF_FIELDS[qtype]:
        values = (rng.random(blocks.shape[0]) * 0.02 + 0.001).astype(np.float16)
        blocks[:, at : at + 2] = values.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(out, -1))


def reference_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """The activations as the kernels see them: codes round(x * 127 / max) (float32 products,
    halves away from zero, as C's roundf) times the block's max / 127."""
    groups = x.float().view(x.shape[0], -1, block)
    largest = groups.abs().amax(-1, keepdim=True)
    product = (groups * torch.where(largest > 0, 127 / largest, 0)).double()
    codes = torch.sign(product) * torch.floor(product.abs() + 0.5)
    return (codes * (largest / 127).double()).view(x.shape)


@pytest.mark.parametrize("out", [40, 36])  # rows interleaved by eight where the format has it
@pytest.mark.parametrize("qtype", FORMATS, ids=[q.name for q in FORMATS])
def test_each_format_computes_gguf_dequantized_weights_times_its_8_bit_activations(qtype, out):
    k = 512
    data = random_blocks(qtype, out, k)
    weight = quant_kernels.BlockWeight.prepare(qtype, data, k)
    assert weight.interleaved == (qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0) and out == 40)
    weights = torch.from_numpy(dequantize(data.numpy(), qtype).reshape(out, k)).double()
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(1))
    got = quant_kernels.BlockProduct([weight])(x).double()
    block = quant_kernels.ACTIVATION_BLOCK[qtype]
    exact = reference_activations(x, block) @ weights.T
    # The integer dot products are exact; what remains is float32 scaling and summation.
    assert (got - exact).abs().max() <= 1e-5 * exact.abs().max()
    # Against the float activations: the 8-bit codes' rounding, documented in BENCHMARKS.md.
    full = x.double() @ weights.T
    assert ((got - full).norm() / full.norm()).item() < (0.01 if block == 32 else 0.02)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=["Q4_0", "Q4_1"])
def test_float_activations_give_float32s_product_the_same_for_a_row_in_any_batch(qtype, build):
    """``auto``'s 4-bit path without AVX-512: the file's weights times the activations as they
    are (float32's error, no 8-bit rounding), a row's bits the same alone, in any batch and on
    any thread count, two stacked parts as one call."""
    k = 512
    first, second = random_blocks(qtype, 40, k, seed=5), random_blocks(qtype, 16, k, seed=6)
    parts = [quant_kernels.BlockWeight.prepare(qtype, d, k) for d in (first, second)]
    product = quant_kernels.BlockProduct(parts, float_activations=True)
    weights = torch.from_numpy(
        dequantize(torch.cat([first, second]).numpy(), qtype).reshape(56, k)
    ).double()
    x = torch.randn(150, k, generator=torch.Generator().manual_seed(2))  # block sums split too
    got = product(x)
    exact = x.double() @ weights.T
    assert (got.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for rows in (slice(3, 4), slice(0, 5), slice(2, 11), slice(70, 150)):
                assert torch.equal(product(x[rows]), got[rows])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("out", [40, 36])
@pytest.mark.parametrize("qtype", FORMATS, ids=[q.name for q in FORMATS])
def test_rows_read_back_from_the_prepared_copy_are_the_files_rows(qtype, out):
    """A tied embedding and the head's candidates read rows from the kernels' copy (rows
    interleaved by eight or not): the file's bytes, so the same values as gguf's dequantize."""
    k = 512
    data = random_blocks(qtype, out, k, seed=3)
    weight = quant_kernels.BlockWeight.prepare(qtype, data, k)
    rows = torch.tensor([0, out - 1, 9, 9, 17, 3])
    assert torch.equal(weight.file_rows(rows), data[rows])
    expected = torch.from_numpy(dequantize(data[rows].numpy(), qtype).reshape(-1, k))
    layer = BlockLinear(GGUFBlocks(qtype, data, k))
    assert torch.equal(layer.dequantize(rows.view(2, 3)), expected.view(2, 3, k))
    for outside in (out, -1 if weight.interleaved else -out - 1):  # torch's rows wrap from -out
        with pytest.raises(IndexError):
            weight.file_rows(torch.tensor([0, outside]))


@pytest.mark.parametrize("out", [40, 36])
@pytest.mark.parametrize("qtype", FORMATS, ids=[q.name for q in FORMATS])
def test_precise_activations_follow_the_float_activations_to_about_15_bits(qtype, out):
    """``gguf-a16``: each activation block as its 8-bit codes plus the codes of the remainder."""
    k = 512
    data = random_blocks(qtype, out, k)
    weight = quant_kernels.BlockWeight.prepare(qtype, data, k)
    weights = torch.from_numpy(dequantize(data.numpy(), qtype).reshape(out, k)).double()
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(1))
    full = x.double() @ weights.T
    eight = quant_kernels.BlockProduct([weight])(x).double()
    precise = quant_kernels.BlockProduct([weight], precise=True)(x).double()
    error = ((precise - full).norm() / full.norm()).item()
    # Measured 2e-5 to 3e-5, 200 to 280 times below the 8-bit activations' error.
    assert error < 1e-4 and error < ((eight - full).norm() / full.norm()).item() / 100


@pytest.mark.parametrize("precise", [False, True], ids=["a8", "a16"])
@pytest.mark.parametrize("qtype", FORMATS, ids=[q.name for q in FORMATS])
def test_a_row_has_the_same_bits_alone_in_any_batch_and_on_any_thread_count(qtype, precise, build):
    out, k = 200, 768 if quant_kernels.ACTIVATION_BLOCK[qtype] == 256 else 576
    data = random_blocks(qtype, out, k, seed=3)
    weight = quant_kernels.BlockWeight.prepare(qtype, data, k)
    # 40 rows: enough for the activations to be quantized on several threads too.
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(2))
    product = quant_kernels.BlockProduct([weight], precise=precise)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = product(x)
        for threads in (2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(product(x), whole)
            assert torch.equal(product(x.flip(0)), whole.flip(0))
        for i in range(x.shape[0]):
            assert torch.equal(product(x[i : i + 1])[0], whole[i])
            rows = [*range(i), *range(i + 1, x.shape[0]), i][-5:]
            assert torch.equal(product(x[rows])[-1], whole[i])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q6_K], ids=["Q4_1", "Q6_K"])
def test_precise_tokens_past_the_products_buffer_are_each_as_alone(qtype):
    """A precise call holds its two products a token in a 16 MiB buffer, so a wide output (a
    vocabulary's head) takes a few tokens at a time: 65,536 outputs, 32 tokens a time."""
    out, k = 65536, 256
    weight = quant_kernels.BlockWeight.prepare(qtype, random_blocks(qtype, out, k, seed=4), k)
    product = quant_kernels.BlockProduct([weight], precise=True)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(5))
    whole = product(x)
    for i in (0, 31, 32, 39):
        assert torch.equal(product(x[i : i + 1])[0], whole[i])


def test_a_weight_whose_rows_do_not_match_the_input_is_refused():
    data = random_blocks(Q.Q4_0, 8, 64)
    with pytest.raises(ValueError, match="Q4_0 weight of 36 bytes a row for an input of 96"):
        quant_kernels.BlockWeight.prepare(Q.Q4_0, data, 96)
    weight = quant_kernels.BlockWeight.prepare(Q.Q4_0, data, 64)
    with pytest.raises(ValueError, match="an input of 96 for a Q4_0 weight of 64"):
        quant_kernels.BlockProduct([weight])(torch.randn(1, 96))


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux's memory map")
def test_the_kernels_share_torchs_openmp_threads():
    """The kernels bring no OpenMP runtime of their own, they use torch's: a second one would keep
    threads of its own, which fight torch's spinning ones for the cores (a batch-1 step took
    1.4x as long). Runtimes that other Python packages bundle (scikit-learn's, where an image
    imports it) live in their own package folders; one outside every package folder could
    only be the system's, which is what a kernel library linked on its own would load."""
    quant_kernels.BlockProduct(
        [quant_kernels.BlockWeight.prepare(Q.Q8_0, random_blocks(Q.Q8_0, 16, 64), 64)]
    )(torch.randn(2, 64))
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line or "libomp" in line}
    assert any("torch" in path for path in runtimes), runtimes
    assert all("-packages/" in path for path in runtimes), runtimes


def test_a_compiler_without_openmp_builds_the_kernels_for_one_thread(tmp_path, monkeypatch, caplog):
    """clang without libomp refuses -fopenmp: the kernels are built without it, said once, and
    give the same bits on one thread."""
    real = native_kernels.compiler()
    compiler = tmp_path / "cc"
    refuse = '[ "$a" = -fopenmp ] && { echo "no omp" >&2; exit 1; }'
    compiler.write_text(f'#!/bin/sh\nfor a in "$@"; do {refuse}; done\nexec {real} "$@"\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no build of ours to find
    weight = quant_kernels.BlockWeight.prepare(Q.Q4_1, random_blocks(Q.Q4_1, 64, 256), 256)
    x = torch.randn(24, 256, generator=torch.Generator().manual_seed(4))
    expected = quant_kernels.BlockProduct([weight])(x)
    with caplog.at_level("WARNING", logger="etinfer.model"):
        library = quant_kernels.compiled(native_kernels.target())
    assert "without OpenMP" in caplog.text and "no omp" in caplog.text
    monkeypatch.setattr(quant_kernels, "library", lambda: library)
    assert torch.equal(quant_kernels.BlockProduct([weight])(x), expected)


def test_no_rows_give_an_empty_product_on_any_thread():
    """A thread that never ran the kernels has no scratch yet: zero rows still answer."""
    weight = quant_kernels.BlockWeight.prepare(Q.Q8_0, random_blocks(Q.Q8_0, 16, 64), 64)
    product = quant_kernels.BlockProduct([weight])
    answers = []
    thread = threading.Thread(target=lambda: answers.append(product(torch.empty(0, 64))))
    thread.start()
    thread.join()
    assert answers[0].shape == (0, 16)


@pytest.mark.parametrize("out", [40, 36])  # rows interleaved by eight where the format has it
@pytest.mark.parametrize("qtype", FORMATS, ids=[q.name for q in FORMATS])
def test_the_dense_path_multiplies_ggufs_dequantized_weights_in_float32(qtype, out, monkeypatch):
    """Prefill's path: the weights decoded to float32 (native/quant_dequantize.c) are gguf's
    values, multiplied by the float activations as they are, in one band or in several, with
    other parts stacked beside them."""
    k = 512
    data, other = random_blocks(qtype, out, k), random_blocks(Q.Q5_0, 24, k, seed=5)
    parts = [
        quant_kernels.BlockWeight.prepare(q, d, k) for q, d in ((qtype, data), (Q.Q5_0, other))
    ]
    weights = torch.cat(
        [
            torch.from_numpy(dequantize(d.numpy(), q).reshape(-1, k))
            for q, d in ((qtype, data), (Q.Q5_0, other))
        ]
    )
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(1))
    product = quant_kernels.BlockProduct(parts)
    assert torch.equal(product.dense(x), x @ weights.T)
    monkeypatch.setattr(quant_kernels, "DENSE_BAND_ELEMENTS", 5 * k)  # bands of 5 rows
    torch.testing.assert_close(product.dense(x), x @ weights.T, rtol=1e-6, atol=1e-6)


def test_many_rows_take_the_dense_path_unless_rows_must_be_computed_alone():
    """A Q6_K layer (not interleaved) multiplies DENSE_ROWS rows or more in float32, fewer on
    the block kernels with 8-bit activations; inside ``rows_alone`` every call is the block
    kernels', each row's bits the same alone or among any rows. Interleaved Q4_1 rows keep their
    own kernel at any row count."""
    k, rows = 512, linear.DENSE_ROWS
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(4))
    layer = BlockLinear(GGUFBlocks(Q.Q6_K, random_blocks(Q.Q6_K, 48, k), k))
    many, few = layer(x), layer(x[:8])
    assert torch.equal(many, layer.product.dense(x)) and not torch.equal(many[:8], few)
    assert torch.equal(few, layer.product(x[:8]))
    with linear.rows_alone():
        assert torch.equal(layer(x)[:8], few)
    assert torch.equal(layer(x), many)  # outside it again
    interleaved = BlockLinear(GGUFBlocks(Q.Q4_1, random_blocks(Q.Q4_1, 48, k), k))
    assert interleaved.dense_rows is None and torch.equal(interleaved(x)[:8], interleaved(x[:8]))
