"""The Llama-family forward pass (Llama, SmolLM, Mistral, Qwen2) over a paged KV cache.

Inference only: plain tensors, no autograd, no nn.Module machinery on the hot path. The batch is
flat: every row is one token of some sequence, so prefill chunks and decode tokens of different
sequences go through each weight matmul together.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from etinfer.model.config import ModelConfig
from etinfer.model.kv_cache import KVCache
from etinfer.model.linear import Linear
from etinfer.model.paged_attention import AttentionMetadata, PagedAttention
from etinfer.model.rotary import RotaryEmbedding


class DecoderLayer:
    def __init__(
        self, config: ModelConfig, take: Callable[[str], torch.Tensor], prefix: str
    ) -> None:

        self.eps = config.rms_norm_eps
        self.input_norm = take(prefix + "input_layernorm.weight")
        self.post_attention_norm = take(prefix + "post_attention_layernorm.weight")
        qkv_bias = None
        if config.attention_bias:
            qkv_bias = torch.cat([take(f"{prefix}self_attn.{p}_proj.bias") for p in "qkv"])
        self.qkv = Linear(
            torch.cat([take(f"{prefix}self_attn.{p}_proj.weight") for p in "qkv"]), qkv_bias
        )
        self.o = Linear(take(prefix + "self_attn.o_proj.weight"))
        self.gate_up = Linear(
            torch.cat([take(prefix + "mlp.gate_proj.weight"), take(prefix + "mlp.up_proj.weight")])
        )
        self.down = Linear(take(prefix + "mlp.down_proj.weight"))
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.intermediate = config.intermediate_size

    def __call__(
        self,
        index: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rope: RotaryEmbedding,
        attention: PagedAttention,
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        rows, hidden = x.shape
        h = F.rms_norm(x, (hidden,), self.input_norm, self.eps)
        qkv = self.qkv(h)
        qk_width = (self.num_heads + self.num_kv_heads) * self.head_dim
        qk = rope.apply(qkv[:, :qk_width].view(rows, -1, self.head_dim), cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, qk_width:].view(rows, self.num_kv_heads, self.head_dim)
        x = x + self.o(attention(index, q, k, v, cache, meta).to(x.dtype))
        h = F.rms_norm(x, (hidden,), self.post_attention_norm, self.eps)
        gate, up = self.gate_up(h).split(self.intermediate, dim=-1)
        return x + self.down(F.silu(gate) * up)


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        attention: PagedAttention,
        max_positions: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        """``weights`` (Hugging Face names) are read, not changed: engines can share them."""
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"the model's weights lack {name}")
            used.add(name)
            return weights[name].to(device=device, dtype=dtype)

        self.config = config
        self.embed = take("model.embed_tokens.weight")
        self.layers = [
            DecoderLayer(config, take, f"model.layers.{i}.") for i in range(config.num_layers)
        ]
        self.norm = take("model.norm.weight")
        tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        self.lm_head = Linear(self.embed if tied else take("lm_head.weight"))
        unexpected = sorted(set(weights) - used - {"lm_head.weight"})
        if unexpected:
            raise ValueError(f"unexpected weights in the model: {', '.join(unexpected[:5])}")
        self.rope = RotaryEmbedding(config, max_positions, device, dtype)
        self.attention = attention

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states [rows, hidden] of a flat batch of tokens."""
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rope.tables(positions)
        for index, layer in enumerate(self.layers):
            x = layer(index, x, cos, sin, self.rope, self.attention, cache, meta)
        return F.rms_norm(x, (x.shape[-1],), self.norm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
