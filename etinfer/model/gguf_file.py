"""Read a GGUF file: hyperparameters, weights under Hugging Face names (float tensors as float,
the others still in their blocks), tokenizer."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from etinfer.model.config import ModelConfig
from etinfer.model.quantized import GGUFBlocks, Weight
from etinfer.model.tokenizer import Tokenizer

# GGUF architectures read here (Mistral files say "llama"). Other families load from their
# Hugging Face folders.
_ARCHITECTURES = ("llama",)
# llama.cpp's pre-tokenizer names whose splitting is GPT-2's byte-level regex; the SmolLM one is
# checked token for token against transformers in the tests. Others (llama-bpe, qwen2, ...) use
# other regexes that could not be checked here, so they are refused rather than guessed.
_GPT2_PRE_TOKENIZERS = ("default", "gpt2", "smollm")

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4


class _CheckedReader(GGUFReader):
    """The gguf package's reader, refusing a tensor whose data the file does not hold by name:
    the reader itself fails on a numpy reshape that names neither tensor nor file (a download cut
    short). Checked before the reader maps the tensors (``_build_tensors``, which every version
    of the reader calls once the tensor infos are read)."""

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            qtype = GGMLQuantizationType(raw_type[0])
            elements, size = GGML_QUANT_SIZES[qtype]
            need = int(np.prod(dims)) * size // elements
            start = int(start_offs + offset[0])
            if start + need > len(self.data):
                raise ValueError(
                    f"tensor {bytes(name).decode()!r} ({qtype.name}) is truncated: the file "
                    f"holds {max(0, len(self.data) - start)} of its {need} bytes"
                )
        super()._build_tensors(start_offs, fields)


def load_gguf(path: Path) -> tuple[ModelConfig, dict[str, Weight], Tokenizer, np.memmap]:
    """The file's configuration, weights and tokenizer, and its memory mapping: the weights in
    blocks are read-only views of it (the OS pages them in as they are read)."""
    try:
        reader = _CheckedReader(path)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from error
    meta = {name: field.contents() for name, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; expected one of "
            f"{', '.join(_ARCHITECTURES)}"
        )
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    config = _model_config(meta, arch, path, tie_word_embeddings=not has_output)
    tokenizer = _tokenizer(meta, path)
    weights = {_hf_name(t.name, path): _tensor(t) for t in reader.tensors}
    for name, tensor in weights.items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            weights[name] = _unpermute_rotary_rows(tensor, heads)
    return config, weights, tokenizer, reader.data


def _model_config(meta: dict, arch: str, path: Path, *, tie_word_embeddings: bool) -> ModelConfig:
    def get(key: str, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(
            f"{path}: GGUF rope scaling {scaling!r} is not supported (load the Hugging Face folder)"
        )
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings=tie_word_embeddings,
    )


def _hf_name(name: str, path: Path) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER.fullmatch(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise ValueError(f"{path}: unexpected tensor {name!r} in a Llama-family GGUF file")


def _tensor(t) -> Weight:
    # GGUF lists dimensions fastest-first, so [in, out] there is row-major [out, in] here. Float
    # tensors are copied (as float32); blocks stay read-only views of the memory-mapped file,
    # which nothing writes to (an engine prepares its own copy when it changes their layout):
    # one copy of the weights in memory, not two.
    shape = tuple(reversed(t.shape.tolist()))
    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return torch.from_numpy(np.array(t.data, np.float32).reshape(shape))
    with warnings.catch_warnings():  # torch's notice that the view is not writable
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(np.asarray(t.data, np.uint8).reshape(shape[0], -1))
    return GGUFBlocks(t.tensor_type, data, shape[-1])


def _unpermute_rotary_rows(weight: Weight, heads: int) -> Weight:
    """Undo llama.cpp's reordering of q/k rows (pairs interleaved) back to Hugging Face's halves.
    Only whole rows move, so a weight still in blocks is reordered as it is."""
    out_features = weight.shape[0]
    half = out_features // heads // 2
    order = torch.arange(out_features).reshape(heads, half, 2).transpose(1, 2).reshape(-1)
    return weight.rows(order) if isinstance(weight, GGUFBlocks) else weight[order]


def _tokenizer(meta: dict, path: Path) -> Tokenizer:
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in _GPT2_PRE_TOKENIZERS:
        raise ValueError(
            f"{path}: GGUF tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported; "
            f"expected 'gpt2' with one of {', '.join(_GPT2_PRE_TOKENIZERS)} "
            "(load the model's Hugging Face folder instead)"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    backend = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type", [])
    backend.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, kind in enumerate(types)
            if kind in (_CONTROL, _USER_DEFINED)
        ]
    )
    # End of turn (llama.cpp's EOT) ends a generation as end of sequence does.
    ends = [meta.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot")]
    return Tokenizer(
        backend,
        eos_token_ids=list(dict.fromkeys(int(t) for t in ends if t is not None)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
    )
