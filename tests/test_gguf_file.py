"""GGUF files we cannot read faithfully are refused by name, not loaded wrong."""

import pytest
from gguf import GGUFWriter

from etinfer.model.catalog import default_model_path
from etinfer.model.loader import load_model


def write_gguf(path, arch="llama", pre="smollm", rope_scaling=None):
    writer = GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.embedding_length", 8)
    writer.add_uint32(f"{arch}.feed_forward_length", 16)
    writer.add_uint32(f"{arch}.block_count", 1)
    writer.add_uint32(f"{arch}.attention.head_count", 2)
    writer.add_uint32(f"{arch}.context_length", 64)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    if rope_scaling:
        writer.add_string(f"{arch}.rope.scaling.type", rope_scaling)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", pre)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b"])
    writer.add_array("tokenizer.ggml.merges", ["a b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arch": "qwen2"}, "GGUF architecture 'qwen2' is not supported; expected one of llama"),
        ({"pre": "llama-bpe"}, "pre-tokenizer 'llama-bpe' is not supported"),
        ({"rope_scaling": "linear"}, "GGUF rope scaling 'linear' is not supported"),
    ],
)
def test_unsupported_gguf_files_are_refused_with_the_reason(tmp_path, kwargs, message):
    path = write_gguf(tmp_path / "model.gguf", **kwargs)
    with pytest.raises(ValueError, match=message):
        load_model(path)


def test_a_file_whose_block_data_is_cut_short_is_refused_naming_the_tensor(tmp_path):
    source = default_model_path()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(source.read_bytes()[:-100_000])  # the last tensor loses 100 KB
    with pytest.raises(ValueError, match=r"tensor '.+' \(\w+\) is truncated: the file holds \d+"):
        load_model(path)
