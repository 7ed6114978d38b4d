"""GGUF files we cannot read faithfully are refused by name, not loaded wrong."""

import functools
import gc
from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFWriter

from etinfer.model import gguf_reader, quant_kernels
from etinfer.model.catalog import default_model_path
from etinfer.model.gguf_reader import GGUFFile
from etinfer.model.linear import make_linear
from etinfer.model.loader import load_model
from etinfer.model.quantized import stack_rows


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
        ({"arch": "falcon"}, "GGUF architecture 'falcon' is not supported; expected one of llama"),
        ({"pre": "tekken"}, "pre-tokenizer 'tekken' is not supported"),
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


# The tiny files keep the default vocabulary's first 8,192 tokens (every byte it has is among
# its first 252) and the merges among them (its first 7,940). Transformers reads a file three
# times (configuration, tokenizer, model) with ``gguf``'s reader, at about 3.6 s for the whole
# vocabulary's 98,000 strings; the pre-tokenizers and the merges under test need far fewer.
TINY_VOCABULARY = 8192
GEMMA2_LOGIT_CAP = 15.0


@functools.cache
def default_vocabulary() -> dict[str, list]:
    """The default file's first ``TINY_VOCABULARY`` tokens with their types, and the merges of
    those tokens, read once (with etinfer's reader: ``gguf``'s takes seconds over the strings,
    and the tests write a dozen files)."""
    fields = GGUFFile(default_model_path()).fields
    tokens = fields["tokenizer.ggml.tokens"][:TINY_VOCABULARY]
    kept = set(tokens)

    def closed(merge: str) -> bool:
        left, right = merge.split(" ", 1)
        return left in kept and right in kept and left + right in kept

    return {
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": [m for m in fields["tokenizer.ggml.merges"] if closed(m)],
        "tokenizer.ggml.token_type": fields["tokenizer.ggml.token_type"][:TINY_VOCABULARY],
    }


def write_tiny_model(path, pre: str, arch: str = "llama") -> None:
    """A one-layer GGUF of ``arch`` (llama, qwen2 with q/k/v biases, qwen3 with query/key
    norms, gemma2 with its norms around both halves and soft caps) of random float32 weights,
    with the start of the default model's byte-level vocabulary and its merges under the
    pre-tokenizer name ``pre``, written by gguf's writer."""
    fields = default_vocabulary()
    tokens, vocab, hidden, ffn = fields["tokenizer.ggml.tokens"], TINY_VOCABULARY, 16, 32
    writer = GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.embedding_length", hidden)
    writer.add_uint32(f"{arch}.feed_forward_length", ffn)
    writer.add_uint32(f"{arch}.block_count", 1)
    writer.add_uint32(f"{arch}.attention.head_count", 4)
    writer.add_uint32(f"{arch}.attention.head_count_kv", 2)
    writer.add_uint32(f"{arch}.context_length", 256)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    # Qwen 3's heads are not hidden / heads wide: its files name the size, which transformers'
    # reader ignores for its default of 128, so the tiny model takes that.
    head = 128 if arch == "qwen3" else hidden // 4
    if arch in ("qwen3", "gemma2"):
        writer.add_uint32(f"{arch}.attention.key_length", head)
        writer.add_uint32(f"{arch}.attention.value_length", head)
    if arch == "gemma2":  # caps small enough that tanh bends what this model computes
        writer.add_uint32(f"{arch}.attention.sliding_window", 6)
        writer.add_float32(f"{arch}.attn_logit_softcapping", 2.0)
        # Its largest logits are about 15-19: a cap of 15 bends them; one of 3 would round them
        # all to 3.0, and greedy would then rest on how ties are broken.
        writer.add_float32(f"{arch}.final_logit_softcapping", GEMMA2_LOGIT_CAP)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", pre)
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.merges", fields["tokenizer.ggml.merges"])
    writer.add_array("tokenizer.ggml.token_type", fields["tokenizer.ggml.token_type"])
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    rng = np.random.default_rng(0)
    shapes = {
        "token_embd.weight": (len(tokens), hidden),
        "output_norm.weight": (hidden,),
        "blk.0.attn_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (4 * head, hidden),
        "blk.0.attn_k.weight": (2 * head, hidden),
        "blk.0.attn_v.weight": (2 * head, hidden),
        "blk.0.attn_output.weight": (hidden, 4 * head),
        "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.ffn_gate.weight": (ffn, hidden),
        "blk.0.ffn_up.weight": (ffn, hidden),
        "blk.0.ffn_down.weight": (hidden, ffn),
    }
    if arch == "qwen2":
        shapes |= {f"blk.0.attn_{p}.bias": ((4 if p == "q" else 2) * head,) for p in "qkv"}
    if arch == "qwen3":
        shapes |= {f"blk.0.attn_{p}_norm.weight": (head,) for p in "qk"}
    if arch == "gemma2":
        shapes |= {f"blk.0.{n}.weight": (hidden,) for n in ("post_attention_norm", "post_ffw_norm")}
    assert len(tokens) == vocab
    for name, shape in shapes.items():
        # Norms near one; matrices centred on zero, so that attention mixes positions unlike
        # each other (centred on one, every key and value looked alike, and a wrong query
        # scale or attention cap left the outputs within 1e-4).
        norm = name.endswith("norm.weight")
        values = 1.0 + rng.standard_normal(shape) * 0.2 if norm else rng.standard_normal(shape)
        writer.add_tensor(name, values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_tokenizes_as_transformers(path, ours, samples: list[str], decodes: bool = False) -> None:
    """Our tokenizer of a GGUF file gives transformers' ids for each sample (and, with
    ``decodes``, its text back from them), transformers' tokenizer read from the same file."""
    import transformers

    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for sample in samples:
        ids = ours.tokenizer.encode(sample, add_special_tokens=False)
        assert ids == reference.encode(sample, add_special_tokens=False), sample
        if decodes:
            assert ours.tokenizer.decode(ids) == reference.decode(ids), sample


def assert_greedy_equals_transformers(path, ours, prompt: list[int], **overrides) -> None:
    """Our float32 engine's greedy tokens for ``prompt`` are transformers' argmax, and their
    log-probabilities transformers', its model read by its own GGUF reader from the same file
    (``overrides``: configuration fields its reader leaves out)."""
    import transformers

    from etinfer import LLM, SamplingParams

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, **overrides
    )
    llm = LLM(ours, quantization="none", dtype="float32", kv_cache_dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    out = llm.generate([prompt], params)[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
    assert out.token_ids == logits.argmax(-1).tolist()
    expected = logits.log_softmax(-1)[torch.arange(len(out.token_ids)), out.token_ids]
    got = [step[token].logprob for step, token in zip(out.logprobs, out.token_ids, strict=True)]
    assert got == pytest.approx(expected.tolist(), abs=1e-4)


@pytest.mark.parametrize(
    ("pre", "arch"), [("llama-bpe", "llama"), ("qwen2", "qwen2"), ("qwen2", "qwen3")]
)
def test_a_byte_level_file_splits_text_as_its_model_does(tmp_path, pre, arch):
    """Llama 3's pattern keeps up to three digits together and Qwen 2's one: our tokenizer of a
    file naming either gives transformers' tokens, and a Llama, Qwen 2 or Qwen 3 file's model
    transformers' greedy tokens."""
    pytest.importorskip("transformers")

    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, pre, arch)
    ours = load_model(path)
    samples = [
        "In 2025, 1234567 people paid $3.50 each; that's 4,320,023.",
        "  indented\n\n\tcode = f(x)  # comment\r\nUnicode: ünïcödé, 日本語, 🙂",
        "I'M sure they'LL say it's fine, you'd think.",
    ]
    assert_tokenizes_as_transformers(path, ours, samples)
    pieces = ours.tokenizer.backend.pre_tokenizer.pre_tokenize_str("1234567")
    assert [p for p, _ in pieces] == (
        ["123", "456", "7"] if pre == "llama-bpe" else list("1234567")
    )
    prompt = ours.tokenizer.encode(samples[0], add_special_tokens=False)
    assert_greedy_equals_transformers(path, ours, prompt)


def write_tiny_phi3(path) -> list[str]:
    """A one-layer Phi-3 GGUF (fused qkv and gate-up) with a small Llama 2 style SentencePiece
    vocabulary (byte tokens, pieces ranked by score), written by gguf's writer; its pieces."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces = ["\u2581", *letters, *(f"\u2581{c}" for c in letters)]
    pieces += ["th", "\u2581th", "\u2581the", "he", "in", "\u2581in", "er", "on", "\u2581a", "an"]
    pieces += ["ing", "\u2581is", "at", "\u2581to", "re", "es", ".", ",", "\u2581\u2581"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    # Longer pieces merge later in Llama 2's files: score falls with the piece's position.
    scores = [0.0, 0.0, 0.0, *[0.0] * 256, *(-float(i) for i in range(len(pieces)))]
    hidden, ffn, heads, head = 16, 32, 4, 4
    writer = GGUFWriter(str(path), "phi3")
    writer.add_uint32("phi3.embedding_length", hidden)
    writer.add_uint32("phi3.feed_forward_length", ffn)
    writer.add_uint32("phi3.block_count", 1)
    writer.add_uint32("phi3.attention.head_count", heads)
    writer.add_uint32("phi3.attention.head_count_kv", heads)
    writer.add_uint32("phi3.rope.dimension_count", head)
    writer.add_uint32("phi3.context_length", 256)
    writer.add_float32("phi3.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.scores", scores)
    writer.add_array("tokenizer.ggml.token_type", types)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.add_uint32("tokenizer.ggml.unknown_token_id", 0)
    writer.add_uint32("tokenizer.ggml.padding_token_id", 0)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    rng = np.random.default_rng(0)
    shapes = {
        "token_embd.weight": (len(tokens), hidden),
        "output_norm.weight": (hidden,),
        "output.weight": (len(tokens), hidden),
        "blk.0.attn_norm.weight": (hidden,),
        "blk.0.attn_qkv.weight": (3 * heads * head, hidden),
        "blk.0.attn_output.weight": (hidden, heads * head),
        "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.ffn_up.weight": (2 * ffn, hidden),
        "blk.0.ffn_down.weight": (hidden, ffn),
    }
    for name, shape in shapes.items():
        scale = 0.2 if name.endswith("norm.weight") else 0.5
        writer.add_tensor(name, (1.0 + rng.standard_normal(shape) * scale).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return pieces


def test_a_phi3_file_reads_its_fused_matrices_and_sentencepiece_vocabulary(tmp_path):
    """Phi-3 from GGUF: the SentencePiece vocabulary tokenizes as transformers' reader of the
    same file does, and the model (its qkv and gate-up split at load) gives transformers'
    greedy tokens."""
    pytest.importorskip("transformers")

    path = tmp_path / "phi3.gguf"
    write_tiny_phi3(path)
    ours = load_model(path)
    assert ours.config.architecture == "phi3"
    samples = [
        "the thing is in the inn, at ten.",
        "  two spaces, then  more; Ünïcödé 🙂 and digits 1234",
        "re-entering",
    ]
    assert_tokenizes_as_transformers(path, ours, samples, decodes=True)
    assert ours.tokenizer.encode("the")[0] == 1  # the file asks for BOS
    assert_greedy_equals_transformers(path, ours, ours.tokenizer.encode(samples[0]))


def test_llamas_q_and_k_keep_the_files_bytes_and_read_rows_in_the_models_order(loaded_model):
    """llama.cpp stores q and k rows in its rotary layout: the loaded model keeps views of the
    file (no reordered copy) and reads them in the model's order, as the tests against
    transformers check end to end."""
    mapping = loaded_model.file_mapping
    for name in ("q_proj", "k_proj"):
        weight = loaded_model.weights[f"model.layers.3.self_attn.{name}.weight"]
        assert weight.order is not None and not torch.equal(weight.order, weight.order.sort()[0])
        assert 0 <= weight.data.data_ptr() - mapping.ctypes.data < mapping.nbytes
        picked = torch.tensor([0, 5, weight.shape[0] - 1])
        assert torch.equal(weight.dequantize(picked), weight.dequantize()[picked])
    # Where the rows are used: stacked into one matrix, and multiplied on the block kernels.
    q, k = (loaded_model.weights[f"model.layers.3.self_attn.{n}_proj.weight"] for n in "qk")
    assert torch.equal(stack_rows([q, k]).dequantize(), torch.cat([q.dequantize(), k.dequantize()]))
    if quant_kernels.available():
        x = torch.randn(3, q.shape[1])
        product = make_linear(replace(q, activation_bits=16))(x)  # about 15-bit activations
        torch.testing.assert_close(product, x @ q.dequantize().T, rtol=1e-3, atol=1e-3)
    split = loaded_model.weights["model.layers.0.mlp.down_proj.weight"].rows(slice(2, 9))
    assert split.data._base is not None  # a slice of rows in the file's order is a view


def test_our_reader_reads_what_ggufs_reader_reads():
    """The direct reader (model/gguf_reader.py) against the gguf package's, on the default file:
    every field's value, every tensor's name, type, shape and bytes."""
    path = default_model_path()
    ours, reference = GGUFFile(path), GGUFReader(path)
    fields = {n: f.contents() for n, f in reference.fields.items() if not n.startswith("GGUF.")}
    assert ours.fields == fields
    assert len(ours.tensors) == len(reference.tensors)
    for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
        assert (mine.name, mine.tensor_type) == (theirs.name, theirs.tensor_type)
        assert list(mine.shape) == theirs.shape.tolist()
        assert np.asarray(mine.data).tobytes() == np.asarray(theirs.data).tobytes(), mine.name


def test_string_arrays_read_the_same_natively_and_in_python(tmp_path, monkeypatch):
    """Long string arrays are walked by the native kernels; one holding a zero byte, or too
    short to be worth a call, in Python; both give gguf's values, and a truncated array is an
    error, not a short vocabulary."""
    words = [f"w{i}▁ü" * (i % 5) for i in range(3000)]
    for strings in (words, [*words[:2000], "zero\x00inside", *words[2000:]]):
        path = tmp_path / "strings.gguf"
        writer = GGUFWriter(str(path), "llama")
        writer.add_array("tokenizer.ggml.tokens", strings)
        writer.add_array("short", strings[:3])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        fields = GGUFFile(path).fields
        assert fields["tokenizer.ggml.tokens"] == strings and fields["short"] == strings[:3]
        monkeypatch.setattr(gguf_reader, "_NATIVE_STRINGS", len(strings) + 1)
        assert GGUFFile(path).fields == fields
        monkeypatch.undo()
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match="runs past the end of the file"):
        GGUFFile(path)


def test_a_gemma2_file_runs_as_transformers_reads_it(tmp_path):
    """Gemma 2 from GGUF: its norms stored as 1 + weight, norms after both halves, a sliding
    window, and scores and logits soft-capped, greedy as transformers computes them."""
    pytest.importorskip("transformers")
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, "smollm", "gemma2")
    ours = load_model(path)
    config = ours.config
    assert (config.attention_softcap, config.logit_softcap) == (2.0, GEMMA2_LOGIT_CAP)
    assert config.layer_windows == (6,)
    prompt = ours.tokenizer.encode(
        "The sky over the harbour was grey, and", add_special_tokens=False
    )
    # Transformers' GGUF reader maps neither soft cap nor the query scale for Gemma 2 (it keeps
    # its defaults of 50, 30 and 256): given the file's values, the comparison checks ours.
    file_values = dict(
        attn_logit_softcapping=2.0,
        final_logit_softcapping=GEMMA2_LOGIT_CAP,
        query_pre_attn_scalar=config.head_dim,
    )
    assert_greedy_equals_transformers(path, ours, prompt, **file_values)


def test_loading_pauses_the_cyclic_collector_and_gives_it_back(tmp_path):
    """A load pauses the cyclic collector (its walks over a growing vocabulary were a fifth of
    Gemma 3's load) and leaves it as it found it, a load that fails too."""
    write_gguf(tmp_path / "bad.gguf", pre="tekken")
    for enabled in (True, False):
        gc.enable() if enabled else gc.disable()
        try:
            with pytest.raises(ValueError, match="not supported"):
                load_model(tmp_path / "bad.gguf")
            assert gc.isenabled() is enabled
        finally:
            gc.enable()
