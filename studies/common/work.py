"""The work a step does by a model's shapes: the weights a token multiplies by, and what decode
attention reads."""

from __future__ import annotations

from etinfer.model.config import ModelConfig


def matmul_params(config: ModelConfig) -> int:
    """Weights one token multiplies by in the decoder layers (the LM head is counted apart)."""
    h, inter, d = config.hidden_size, config.intermediate_size, config.head_dim
    attention = h * d * (2 * config.num_heads + 2 * config.num_kv_heads)  # q, o; k, v
    return config.num_layers * (attention + 3 * h * inter)


def attention_work(pairs: float, config: ModelConfig, block_size: int) -> tuple[float, float]:
    """FLOPs and KV bytes of decode attention over ``pairs`` (block, KV head) pairs in a token's
    step, summed over layers: scores and weighted sum are two multiply-adds per element."""
    tokens = pairs * block_size
    flops = tokens * config.queries_per_kv * config.head_dim * 4
    kv_bytes = tokens * config.head_dim * 4 * 2
    return flops, kv_bytes
