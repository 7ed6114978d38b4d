"""Architecture hyperparameters of a Llama-family model, whatever file they came from."""

from __future__ import annotations

from dataclasses import dataclass

# Names as Hugging Face's config.json spells them in `model_type`.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2 puts biases on q, k and v
    rope_scaling: dict | None = None
    sliding_window: int | None = None

    @property
    def queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads
