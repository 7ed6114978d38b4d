"""Architecture hyperparameters of a decoder-only model, whatever file they came from."""

from __future__ import annotations

from dataclasses import dataclass

# Names as Hugging Face's config.json spells them in `model_type`.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")


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
    # Each layer's own window where layers differ (Gemma 3: five of six layers slide, the sixth
    # attends to everything); None: every layer takes ``sliding_window``.
    layer_windows: tuple[int | None, ...] | None = None
    # RoPE base of the sliding layers where it is not ``rope_theta`` (Gemma 3: 10,000 against 1M).
    local_rope_theta: float | None = None
    # Attention's score scale where it is not head_dim ** -0.5 (Gemma's query_pre_attn_scalar).
    attention_scale: float | None = None
    # Gemma 2's soft caps: scores (after the scale) and final logits become cap * tanh(x / cap).
    attention_softcap: float | None = None
    logit_softcap: float | None = None

    @property
    def queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: the whole context)."""
        return self.sliding_window if self.layer_windows is None else self.layer_windows[layer]

    @property
    def mixed_windows(self) -> bool:
        """Whether some layers slide and others see the whole context."""
        return self.layer_windows is not None and len(set(self.layer_windows)) > 1

    @property
    def local_layers(self) -> frozenset[int]:
        """The sliding layers of a model whose layers differ in their window (none otherwise):
        the ones that read each step's ``local`` view and their own RoPE table."""
        if not self.mixed_windows:
            return frozenset()
        return frozenset(i for i in range(self.num_layers) if self.window(i) is not None)

    @property
    def uniform_window(self) -> int | None:
        """The window every layer shares (Mistral), or None (none, or they differ)."""
        return None if self.mixed_windows else self.window(0)

    @property
    def scale(self) -> float:
        return self.attention_scale or self.head_dim**-0.5
