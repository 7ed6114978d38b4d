"""Random-weight GGUF files of named shapes (``bench quantization --random-shape``): written by
gguf's writer and quantizers, read by gguf's reader and by etinfer, and refused where unknown or
too large before anything is written."""

import shutil

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader

from etinfer import LLM, SamplingParams
from etinfer.bench.speed.random_shapes import (
    SHAPES,
    Shape,
    check_room,
    file_bytes,
    random_gguf,
    write,
)
from etinfer.model.catalog import default_model_path
from etinfer.model.gguf_reader import GGUFFile

TINY = {
    "llama": Shape("llama", 2, 64, 128, 4, 2, 10000.0, tied=False),
    "qwen2": Shape("qwen2", 2, 64, 96, 4, 1, 1000000.0, tied=True, qkv_bias=True),
}


@pytest.fixture(scope="module")
def fields():
    return GGUFFile(default_model_path()).fields


@pytest.mark.parametrize("arch", list(TINY))
def test_a_random_shape_is_written_as_named_and_runs(tmp_path, fields, arch):
    shape, qtype = TINY[arch], GGMLQuantizationType.Q4_0
    vocab = len(fields["tokenizer.ggml.tokens"])
    path = tmp_path / "tiny.gguf"
    write(path, shape, qtype, vocab, fields)
    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == set(shape.tensors(vocab))
    assert sum(int(t.n_bytes) for t in tensors.values()) == file_bytes(shape, qtype, vocab)
    q = tensors["blk.1.attn_q.weight"]
    assert q.tensor_type == qtype and list(q.shape) == [64, 64]  # GGUF's order: in, out
    assert ("output.weight" in tensors) == (not shape.tied)
    assert ("blk.0.attn_k.bias" in tensors) == shape.qkv_bias
    llm = LLM(str(path), num_kvcache_blocks=16)
    assert llm.engine.model_config.num_layers == 2
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate(["The capital"], greedy)
    assert len(out[0].token_ids) == 4
    # The same name and format give the same bytes.
    again = tmp_path / "again.gguf"
    write(again, shape, qtype, vocab, fields)
    assert np.array_equal(np.fromfile(path, np.uint8), np.fromfile(again, np.uint8))


def test_unknown_shapes_and_formats_are_refused_listing_those_known(tmp_path):
    with pytest.raises(ValueError, match=r"'llama-9b' is not known; the shapes: llama-3\.2-1b"):
        random_gguf("llama-9b", "Q4_0", tmp_path)
    with pytest.raises(ValueError, match="the formats written are Q4_0, Q4_1, Q5_0, Q8_0"):
        random_gguf("llama-3.2-1b", "Q4_K", tmp_path)
    assert not any(tmp_path.iterdir())


def test_a_shape_too_large_for_the_host_says_what_it_needs_before_writing(tmp_path):
    import psutil

    folder = tmp_path / "shapes"
    with pytest.raises(ValueError, match=r"'llama-3-8b' needs 1024.0 GiB of disk under .+ free"):
        check_room("llama-3-8b", 2**40, folder)
    memory = psutil.virtual_memory().available
    if memory < shutil.disk_usage(tmp_path).free:
        with pytest.raises(ValueError, match=r"needs about [\d.]+ GiB of memory to run \(its"):
            check_room("llama-3-8b", memory, folder)
    assert not folder.exists()


def test_the_named_shapes_have_their_models_sizes():
    vocab = 49152
    sizes = {name: file_bytes(s, GGMLQuantizationType.Q4_0, vocab) for name, s in SHAPES.items()}
    assert 500 < sizes["llama-3.2-1b"] / 2**20 < 700
    assert 3500 < sizes["llama-3-8b"] / 2**20 < 4500
