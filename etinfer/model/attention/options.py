"""The shape of a model's attention as every backend reads it, fixed when the engine is built."""

from __future__ import annotations

from dataclasses import dataclass

from etinfer.model.config import ModelConfig


@dataclass(frozen=True, kw_only=True)
class AttentionOptions:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # A registered backend's name (``registry.py``), or "auto": the device's best, as
    # ``registry.create_backend`` decides when the layer is built.
    backend: str = "auto"
    scale: float | None = None  # of q.k; None: head_dim ** -0.5
    sliding_window: int | None = None  # every layer's window (Mistral)
    # Where layers differ in their window (Gemma 3): the sliding ones, which read each step's
    # ``local`` view of the metadata, and their window.
    local_layers: frozenset[int] = frozenset()
    local_window: int | None = None
    # Scores become ``softcap * tanh(s / softcap)`` (Gemma 2).
    softcap: float | None = None
    # A decode row's result may not depend on the other rows (the GPU kernel then never splits
    # a row's context); prefill rows attend as decode rows (``EngineConfig.batch_invariant``).
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.scale is None:
            object.__setattr__(self, "scale", self.head_dim**-0.5)

    @classmethod
    def of_model(
        cls, config: ModelConfig, *, backend: str = "auto", batch_invariant: bool = False
    ) -> AttentionOptions:
        return cls(
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            backend=backend,
            scale=config.scale,
            sliding_window=config.uniform_window,
            local_layers=config.local_layers,
            local_window=config.sliding_window,
            softcap=config.attention_softcap,
            batch_invariant=batch_invariant,
        )

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def window(self, layer: int) -> int | None:
        """The window ``layer`` reads through (None: the whole context)."""
        return self.local_window if layer in self.local_layers else self.sliding_window
