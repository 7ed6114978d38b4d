"""Read a Hugging Face model folder: config.json, safetensors shards, tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer as HFTokenizer

from etinfer.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from etinfer.model.quantized import GGUFBlocks
from etinfer.model.tokenizer import Tokenizer


def load_hf_folder(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path}: not a Hugging Face model folder (expected config.json in it)")
    raw = json.loads(config_file.read_text())
    config = _model_config(raw, path)
    weights = _weights(path)
    if config.architecture == "phi3":
        weights = split_fused(weights, config)
    return config, weights, _tokenizer(path)


def _model_config(raw: dict, path: Path) -> ModelConfig:
    arch = raw.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: model_type {arch!r} is not supported; expected one of "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    heads = raw["num_attention_heads"]
    rope_scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
    local_rope = None
    if rope_scaling is not None and "full_attention" in rope_scaling:  # per layer type (Gemma 3)
        local_rope = rope_scaling.get("sliding_attention", {})
        rope_scaling = rope_scaling["full_attention"]
    rope_theta = raw.get("rope_theta") or (rope_scaling or {}).get("rope_theta", 10000.0)
    if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) in (
        None,
        "default",
    ):
        rope_scaling = None
    fields = dict(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        # Qwen2 always has q/k/v biases; Llama may declare them.
        attention_bias=arch == "qwen2" or raw.get("attention_bias", False),
        rope_scaling=rope_scaling,
        sliding_window=raw.get("sliding_window") if raw.get("use_sliding_window", True) else None,
    )
    gemma = arch in ("gemma2", "gemma3_text")
    activation = raw.get("hidden_activation" if gemma else "hidden_act")
    expected = "gelu_pytorch_tanh" if gemma else "silu"
    if activation not in (None, expected):
        raise ValueError(f"{path}: activation {activation!r} is not supported ({expected})")
    if gemma:
        fields |= _gemma_fields(raw, arch, local_rope, path)
    elif raw.get("layer_types") and fields["sliding_window"] is not None:
        # Qwen slides only from max_window_layers on, as layer_types spells out.
        window = fields["sliding_window"]
        windows = tuple(window if k == "sliding_attention" else None for k in raw["layer_types"])
        fields["layer_windows"] = windows
        if not any(windows):
            fields["sliding_window"] = None
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"{path}: partial_rotary_factor is not supported (RoPE on every dimension)"
        )
    return ModelConfig(**fields)


def split_fused(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` as the Llama names of their row blocks
    (float ones as views, no copy; a GGUF file's in their blocks, their rows gathered): the
    layer stacks them again as it prepares them."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    split = {
        "self_attn.qkv_proj.weight": (("q", q), ("k", kv), ("v", kv)),
        "mlp.gate_up_proj.weight": (("gate", config.intermediate_size), ("up", None)),
    }
    out = {}
    for name, weight in weights.items():
        fused = next((suffix for suffix in split if name.endswith(suffix)), None)
        if fused is None:
            out[name] = weight
            continue
        start, prefix = 0, name.removesuffix(fused) + fused.split(".")[0] + "."
        for part, rows in split[fused]:
            end = weight.shape[0] if rows is None else start + rows
            out[f"{prefix}{part}_proj.weight"] = (
                weight.rows(slice(start, end))
                if isinstance(weight, GGUFBlocks)
                else weight[start:end]
            )
            start = end
    return out


def _gemma_fields(raw: dict, arch: str, local_rope: dict | None, path: Path) -> dict:
    """What Gemma's config.json adds: per-layer windows (Gemma 2 slides on every other layer,
    Gemma 3 on five of six), Gemma 3's sliding layers' RoPE base, the query scale, Gemma 2's
    soft caps."""
    if raw.get("use_bidirectional_attention"):
        raise ValueError(f"{path}: use_bidirectional_attention is not supported")
    if local_rope and local_rope.get("rope_type", "default") != "default":
        raise ValueError(f"{path}: scaled RoPE on sliding layers is not supported")
    window = raw.get("sliding_window", 4096)  # transformers' defaults where a file omits them
    every = 2 if arch == "gemma2" else raw.get("sliding_window_pattern", 6)
    kinds = raw.get("layer_types") or [
        "full_attention" if (i + 1) % every == 0 else "sliding"
        for i in range(raw["num_hidden_layers"])
    ]
    fields = {
        "layer_windows": tuple(None if kind == "full_attention" else window for kind in kinds),
        "attention_scale": raw.get("query_pre_attn_scalar", 256) ** -0.5,
        # Gemma ties its head to the embeddings unless the file says otherwise.
        "tie_word_embeddings": raw.get("tie_word_embeddings", True),
    }
    if arch == "gemma2":  # one RoPE base for every layer; scores and logits soft-capped
        return fields | {
            "attention_softcap": raw.get("attn_logit_softcapping"),
            "logit_softcap": raw.get("final_logit_softcapping"),
        }
    local_theta = (local_rope or {}).get("rope_theta") or raw.get("rope_local_base_freq", 10000.0)
    for unsupported in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(unsupported) is not None:
            raise ValueError(f"{path}: {unsupported} is not supported on Gemma 3")
    return fields | {"local_rope_theta": float(local_theta)}


def _weights(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors weights in the folder")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(file))
    # Old checkpoints carry the rotary table as a buffer; it is recomputed from the config.
    return {name: w for name, w in weights.items() if not name.endswith("rotary_emb.inv_freq")}


def _tokenizer(path: Path) -> Tokenizer:
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(f"{path}: no tokenizer.json in the folder")
    backend = HFTokenizer.from_file(str(tokenizer_file))
    tok_config = _read_json(path / "tokenizer_config.json")
    gen_config = _read_json(path / "generation_config.json")

    def token_id(key: str) -> int | None:
        token = tok_config.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        return None if token is None else backend.token_to_id(token)

    eos = gen_config.get("eos_token_id")
    if eos is None:
        eos = token_id("eos_token")
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    template = tok_config.get("chat_template")
    template_file = path / "chat_template.jinja"
    if template is None and template_file.is_file():
        template = template_file.read_text()
    return Tokenizer(
        backend,
        eos_token_ids=eos_ids,
        bos_token_id=token_id("bos_token"),
        # tokenizer.json's post-processor adds BOS where the model wants it; only old Llama
        # tokenizer configs ask for it separately.
        add_bos_token=bool(tok_config.get("add_bos_token", False))
        and backend.post_processor is None,
        chat_template=template,
    )


def _read_json(file: Path) -> dict:
    return json.loads(file.read_text()) if file.is_file() else {}
