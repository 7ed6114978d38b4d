"""Random-weight GGUF files of named model shapes, to measure decode where the model does not
fit in the last-level cache (the default model, 94 MiB, fits in many hosts' L3 and hides what
DRAM costs).

A shape is a real model's architecture (layers, widths, heads, rotary base, tied embeddings,
biases) with the default model's tokenizer, so its vocabulary, and so its embedding and head,
are the default's (49,152 tokens) and the rest is the real model's size. Weights are drawn at
random (normal, std 0.02; norms 1) and quantized by the ``gguf`` package's own quantizers into
one block format for every matrix (llama.cpp's ``--pure``); ``gguf``'s writer writes the file a
tensor at a time, so a shape needs memory for its largest matrix, not for the model. A file is
written once and kept: the same name and format give the same bytes.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from etinfer.model.catalog import default_model_path
from etinfer.model.gguf_reader import GGUFFile


@dataclass(frozen=True)
class Shape:
    arch: str  # GGUF architecture
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    rope_base: float
    tied: bool  # the head is the embedding (no output.weight)
    qkv_bias: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensors(self, vocab: int) -> dict[str, tuple[int, ...]]:
        """Every tensor's name and shape as torch orders it ([out, in] for a matrix)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, self.hidden)}
        for i in range(self.layers):
            block = f"blk.{i}."
            shapes |= {
                block + "attn_norm.weight": (self.hidden,),
                block + "attn_q.weight": (q, self.hidden),
                block + "attn_k.weight": (kv, self.hidden),
                block + "attn_v.weight": (kv, self.hidden),
                block + "attn_output.weight": (self.hidden, q),
                block + "ffn_norm.weight": (self.hidden,),
                block + "ffn_gate.weight": (self.ffn, self.hidden),
                block + "ffn_up.weight": (self.ffn, self.hidden),
                block + "ffn_down.weight": (self.hidden, self.ffn),
            }
            if self.qkv_bias:
                widths = {"q": q, "k": kv, "v": kv}
                shapes |= {block + f"attn_{p}.bias": (n,) for p, n in widths.items()}
        shapes["output_norm.weight"] = (self.hidden,)
        if not self.tied:
            shapes["output.weight"] = (vocab, self.hidden)
        return shapes


# The architectures of the models named (their config.json), the vocabulary aside.
SHAPES = {
    "llama-3.2-1b": Shape("llama", 16, 2048, 8192, 32, 8, 500000.0, tied=True),
    "tinyllama-1.1b": Shape("llama", 22, 2048, 5632, 32, 4, 10000.0, tied=False),
    "qwen2.5-1.5b": Shape("qwen2", 28, 1536, 8960, 12, 2, 1000000.0, tied=True, qkv_bias=True),
    "llama-3-8b": Shape("llama", 32, 4096, 14336, 32, 8, 500000.0, tied=False),
}
# The block formats gguf's quantizers write that etinfer's kernels and llama.cpp both take.
FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q8_0")
TOKENIZER_FIELDS = {  # the default file's tokenizer, copied by value type
    "tokenizer.ggml.model": "string",
    "tokenizer.ggml.pre": "string",
    "tokenizer.chat_template": "string",
    "tokenizer.ggml.tokens": "array",
    "tokenizer.ggml.token_type": "array",
    "tokenizer.ggml.merges": "array",
    "tokenizer.ggml.bos_token_id": "uint32",
    "tokenizer.ggml.eos_token_id": "uint32",
    "tokenizer.ggml.unknown_token_id": "uint32",
    "tokenizer.ggml.padding_token_id": "uint32",
    "tokenizer.ggml.add_bos_token": "bool",
}


def file_bytes(shape: Shape, qtype: GGMLQuantizationType, vocab: int) -> int:
    """The tensor data a file of ``shape`` in ``qtype`` holds."""
    block, size = GGML_QUANT_SIZES[qtype]
    total = 0
    for dims in shape.tensors(vocab).values():
        count = int(np.prod(dims))
        total += count // block * size if len(dims) == 2 else 4 * count
    return total


def random_gguf(name: str, fmt: str, folder: Path) -> Path:
    """The file of shape ``name`` in format ``fmt`` under ``folder``: written now if it is not
    there. Refuses an unknown shape or format by listing those known, and a shape whose file
    the disk or memory cannot hold by saying how much it needs, before writing anything."""
    if name not in SHAPES:
        raise ValueError(f"random shape {name!r} is not known; the shapes: {', '.join(SHAPES)}")
    if fmt not in FORMATS:
        raise ValueError(f"random format {fmt!r}: the formats written are {', '.join(FORMATS)}")
    path = Path(folder) / f"{name}-random.{fmt}.gguf"  # its labels: "<name>-random <fmt>"
    if path.is_file():
        return path
    shape, qtype = SHAPES[name], GGMLQuantizationType[fmt]
    source = GGUFFile(default_model_path())
    vocab = len(source.fields["tokenizer.ggml.tokens"])
    check_room(name, file_bytes(shape, qtype, vocab), Path(folder))
    Path(folder).mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    write(partial, shape, qtype, vocab, source.fields)
    partial.rename(path)  # a file under the final name is whole
    return path


def check_room(name: str, needed: int, folder: Path) -> None:
    """The file must fit on the disk, and loaded (by one engine at a time: each runs in a
    process of its own) in the memory the host has free."""
    import psutil

    existing = folder if folder.exists() else next(p for p in folder.parents if p.exists())
    disk, memory = shutil.disk_usage(existing).free, psutil.virtual_memory().available
    gib = 2**30
    if needed > disk:
        raise ValueError(
            f"random shape {name!r} needs {needed / gib:.1f} GiB of disk under {folder}; "
            f"{disk / gib:.1f} GiB are free"
        )
    if 1.25 * needed > memory:  # the weights, and room for the cache and activations
        raise ValueError(
            f"random shape {name!r} needs about {1.25 * needed / gib:.1f} GiB of memory to run "
            f"(its weights are {needed / gib:.1f} GiB); {memory / gib:.1f} GiB are available"
        )


def write(
    path: Path,
    shape: Shape,
    qtype: GGMLQuantizationType,
    vocab: int,
    fields: dict[str, Any],
    seed: int = 0,
) -> None:
    """``shape``'s file at ``path``: every matrix random in ``qtype``, the tokenizer from
    ``fields`` (a GGUF file's), a tensor at a time."""
    writer = GGUFWriter(str(path), shape.arch)
    arch = shape.arch
    for key, value in (
        ("block_count", shape.layers),
        ("context_length", 8192),
        ("embedding_length", shape.hidden),
        ("feed_forward_length", shape.ffn),
        ("attention.head_count", shape.heads),
        ("attention.head_count_kv", shape.kv_heads),
        ("rope.dimension_count", shape.head_dim),
        ("vocab_size", vocab),
    ):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", shape.rope_base)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    for key, kind in TOKENIZER_FIELDS.items():
        if key in fields:
            getattr(writer, f"add_{kind}")(key, fields[key])
    rng = np.random.default_rng(seed)
    tensors = shape.tensors(vocab)
    block, size = GGML_QUANT_SIZES[qtype]
    for name, dims in tensors.items():
        if len(dims) == 2:  # given as bytes per row, as the quantizer returns them
            row_bytes = dims[1] // block * size
            rows = (dims[0], row_bytes)
            nbytes = dims[0] * row_bytes
            writer.add_tensor_info(name, rows, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
        else:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * dims[0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims in tensors.items():
        if len(dims) == 2:
            weights = rng.standard_normal(dims, dtype=np.float32) * np.float32(0.02)
            writer.write_tensor_data(quantize(weights, qtype))
        elif name.endswith(".bias"):
            writer.write_tensor_data(rng.standard_normal(dims, dtype=np.float32) * 0.02)
        else:
            writer.write_tensor_data(np.ones(dims, dtype=np.float32))
    writer.close()
