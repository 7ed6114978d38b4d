"""Read a GGUF file: hyperparameters, weights under Hugging Face names (float tensors as float,
the others still in their blocks), tokenizer."""

from __future__ import annotations

import re
import struct
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from etinfer.model import sentencepiece
from etinfer.model.config import ModelConfig
from etinfer.model.gguf_reader import GGUFFile, GGUFTensor
from etinfer.model.hf_folder import split_fused
from etinfer.model.quantized import GGUFBlocks, Weight
from etinfer.model.sentencepiece import (
    CONTROL,
    USER_DEFINED,
    gemma_merges,
    gemma_pieces,
    gemma_tokenizer,
    llama_merges,
    llama_tokenizer,
)
from etinfer.model.tokenizer import Tokenizer
from etinfer.model.tokenizer_cache import cached_merges

# GGUF architectures read here, and the name each has in ModelConfig (Hugging Face's
# model_type; Mistral files say "llama"). Other families load from their Hugging Face folders.
_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
}
# llama.cpp's pre-tokenizer names whose splitting is GPT-2's byte-level regex (SmolLM's)...
_GPT2_PRE_TOKENIZERS = ("default", "gpt2", "smollm")
# ... and those that split by their model's own pattern first (its tokenizer.json's): Llama 3
# keeps up to three digits together, Qwen 2 one. Each is checked token for token against
# transformers in the tests; other names are refused rather than guessed.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}

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
_QK_NORM_NAMES = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Gemma 3 has norms after attention and MLP too, and query/key norms; its "ffn_norm" is the
# norm before the MLP.
_GEMMA3_LAYER_NAMES = (
    _LAYER_NAMES
    | _QK_NORM_NAMES
    | {
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    }
)
_LAYER_NAMES_BY_ARCH = {
    "llama": _LAYER_NAMES,
    # Qwen 2 has biases on q, k and v; Qwen 3 none, but query and key norms.
    "qwen2": _LAYER_NAMES | {f"attn_{p}.bias": f"self_attn.{p}_proj.bias" for p in "qkv"},
    "qwen3": _LAYER_NAMES | _QK_NORM_NAMES,
    "gemma2": _GEMMA3_LAYER_NAMES,  # Gemma 3's, without query/key norms
    "gemma3": _GEMMA3_LAYER_NAMES,
    # Phi-3 keeps q, k and v in one matrix and gate and up in another (gate rows first).
    "phi3": {
        k: v
        for k, v in _LAYER_NAMES.items()
        if not k.startswith(("attn_q.", "attn_k.", "attn_v.", "ffn_gate.", "ffn_up."))
    }
    | {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
}
# What llama.cpp fixes for Gemma 3 rather than writing to the file: one layer in six attends to
# the whole context (the others slide), and the sliding layers' RoPE base.
_GEMMA3_GLOBAL_EVERY = 6
_GEMMA3_LOCAL_ROPE_THETA = 10_000.0
# Gemma 2 attends to the whole context on every other layer (the odd ones), one RoPE base.
_GEMMA2_GLOBAL_EVERY = 2
# Gemma's 27B models scale queries by hidden / heads rather than the head size (llama.cpp tells
# them apart by their layer count).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")


def load_gguf(path: Path) -> tuple[ModelConfig, dict[str, Weight], Tokenizer, np.memmap]:
    """The file's configuration, weights and tokenizer, and its memory mapping: the weights in
    blocks are read-only views of it (the OS pages them in as they are read)."""
    try:
        reader = GGUFFile(path)
    except (ValueError, struct.error) as error:
        raise ValueError(f"{path}: {error}") from error
    meta = reader.fields
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; expected one of "
            f"{', '.join(_ARCHITECTURES)}"
        )
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    config = _model_config(meta, arch, path, tie_word_embeddings=not has_output)
    tokenizer = _tokenizer(meta, arch, path)
    weights = {_hf_name(t.name, arch, path): _tensor(t) for t in reader.tensors}
    for name, tensor in weights.items():
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            weights[name] = _unpermute_rotary_rows(tensor, heads)
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            # llama.cpp stores Gemma's norms as the 1 + weight they scale by; Hugging Face's
            # convention (which the model's reader follows) is the weight.
            weights[name] = tensor - 1
    if arch == "phi3":
        weights = split_fused(weights, config)
    return config, weights, tokenizer, reader.data


def _model_config(meta: dict, arch: str, path: Path, *, tie_word_embeddings: bool) -> ModelConfig:
    def get(key: str, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    rope_scaling = None
    if arch == "gemma3" and scaling == "linear":  # Gemma 3 4B and larger, on global layers
        rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling != "none":
        raise ValueError(
            f"{path}: GGUF rope scaling {scaling!r} is not supported (load the Hugging Face folder)"
        )
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    extra = {}
    if arch == "phi3":  # Phi-3 mini's 4K files slide over 2,047 tokens (llama.cpp's n_swa)
        extra = {"sliding_window": meta.get(f"{arch}.attention.sliding_window") or None}
    if arch in ("gemma2", "gemma3"):
        window, layers = int(get("attention.sliding_window")), int(get("block_count"))
        head_dim = int(get("attention.key_length"))
        every = _GEMMA2_GLOBAL_EVERY if arch == "gemma2" else _GEMMA3_GLOBAL_EVERY
        extra = {
            "head_dim": head_dim,
            "layer_windows": tuple(None if (i + 1) % every == 0 else window for i in range(layers)),
            "sliding_window": window,
            # query_pre_attn_scalar is the head size but on 27B, whose is hidden / heads.
            "attention_scale": (hidden / heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim)
            ** -0.5,
            "rope_scaling": rope_scaling,
        }
        if arch == "gemma3":
            extra["local_rope_theta"] = _GEMMA3_LOCAL_ROPE_THETA
        else:
            extra["attention_softcap"] = meta.get(f"{arch}.attn_logit_softcapping")
            extra["logit_softcap"] = meta.get(f"{arch}.final_logit_softcapping")
    fields = dict(
        architecture=_ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", get("rope.dimension_count", hidden // heads))),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings=tie_word_embeddings,
        attention_bias=arch == "qwen2",
    )
    return ModelConfig(**(fields | extra))


def _hf_name(name: str, arch: str, path: Path) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match, names = _LAYER.fullmatch(name), _LAYER_NAMES_BY_ARCH[arch]
    if match and match.group(2) in names:
        return f"model.layers.{match.group(1)}.{names[match.group(2)]}"
    raise ValueError(f"{path}: unexpected tensor {name!r} in a {arch} GGUF file")


def _tensor(t: GGUFTensor) -> Weight:
    # GGUF lists dimensions fastest-first, so [in, out] there is row-major [out, in] here. Float
    # tensors are copied (as float32); blocks stay read-only views of the memory-mapped file,
    # which nothing writes to (an engine prepares its own copy when it changes their layout):
    # one copy of the weights in memory, not two.
    shape = tuple(reversed(t.shape))
    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return torch.from_numpy(np.array(t.data, np.float32).reshape(shape))
    with warnings.catch_warnings():  # torch's notice that the view is not writable
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(np.asarray(t.data, np.uint8).reshape(shape[0], -1))
    return GGUFBlocks(t.tensor_type, data, shape[-1])


def _unpermute_rotary_rows(weight: Weight, heads: int) -> Weight:
    """Undo llama.cpp's reordering of q/k rows (pairs interleaved) back to Hugging Face's halves.
    Only whole rows move: a weight still in blocks keeps the file's bytes and reads its rows in
    this order (``GGUFBlocks.order``)."""
    out_features = weight.shape[0]
    half = out_features // heads // 2
    order = torch.arange(out_features).reshape(heads, half, 2).transpose(1, 2).reshape(-1)
    return replace(weight, order=order) if isinstance(weight, GGUFBlocks) else weight[order]


# What rebuilds a SentencePiece vocabulary's merges: kept merges are of this source's build.
SENTENCEPIECE = Path(sentencepiece.__file__)


def _tokenizer(meta: dict, arch: str, path: Path) -> Tokenizer:
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type", [])
    if kind == "llama" and arch in ("gemma2", "gemma3"):  # SentencePiece BPE, Gemma's spelling
        pieces = gemma_pieces(tokens)
        merges = cached_merges(pieces, (arch,), [SENTENCEPIECE], lambda: gemma_merges(pieces))
        backend = gemma_tokenizer(pieces, types, merges)
    elif kind == "llama" and arch == "phi3":  # SentencePiece BPE, Llama 2's
        scores = meta["tokenizer.ggml.scores"]
        merges = cached_merges(
            tokens, (arch, scores), [SENTENCEPIECE], lambda: llama_merges(tokens, scores)
        )
        backend = llama_tokenizer(tokens, types, merges)
    elif kind == "gpt2" and (pre in _GPT2_PRE_TOKENIZERS or pre in _PRE_TOKENIZER_SPLITS):
        backend = _byte_level_tokenizer(meta, tokens, types, _PRE_TOKENIZER_SPLITS.get(pre))
    else:
        known = ", ".join([*_GPT2_PRE_TOKENIZERS, *_PRE_TOKENIZER_SPLITS])
        raise ValueError(
            f"{path}: GGUF tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported; "
            f"expected 'gpt2' with one of {known}, or a Gemma 3 or Phi-3 file's 'llama' "
            "(SentencePiece) (load the model's Hugging Face folder instead)"
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


def _byte_level_tokenizer(
    meta: dict, tokens: list[str], types: list[int], split: str | None
) -> HFTokenizer:
    """Byte-level BPE with the file's merges: text split by GPT-2's regex (SmolLM), or by the
    model's own ``split`` pattern and then mapped to bytes (Llama 3, Qwen 2)."""
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    backend = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, kind in enumerate(types)
            if kind in (CONTROL, USER_DEFINED)
        ]
    )
    return backend
