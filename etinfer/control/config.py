"""Which entropy control layers the engine runs, engine-wide, and each one's settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from etinfer.control.block_selection import PruningConfig
from etinfer.control.kv_compression import KVCompressionConfig
from etinfer.control.scheduling import SchedulingConfig
from etinfer.control.sparse_prefill import SparsePrefillConfig
from etinfer.control.switching import SwitchingConfig
from etinfer.validation import check_float

_Layer = TypeVar("_Layer")


@dataclass(frozen=True)
class ControlConfig:
    """Which entropy control layers are on, engine-wide.

    - sampling: requests that choose no temperature controller of their own (and are not greedy)
      sample with ``entropy_target``, by the feedback law.
    - pruning: decode attention keeps only the blocks the entropic selector picks; ``True`` uses
      the default ``PruningConfig``.
    - scheduling: the ``entropy`` scheduling policy replaces ``EngineConfig.scheduling_policy``;
      ``True`` uses the default ``SchedulingConfig``.
    - switching: Entropy Adaptive Decoding between the engine's ``draft_model`` (small) and
      the model (large); ``True`` uses the default ``SwitchingConfig``. Lossy by design, and not
      part of ``full()`` (the paper's three layers).
    - sparse_prefill: long prompts' chunked prefill reads, per segment and KV head, the blocks
      its attention entropy budgets (EntropyInfer); ``True`` uses the default
      ``SparsePrefillConfig``. Lossy, opt-in.
    - kv_compression: after a long prompt's first generated tokens, each (layer, KV head) keeps
      the cached positions its queries attend to most and the rest of the blocks go back to the
      pool (EntropyInfer's latent compression); ``True`` uses the default
      ``KVCompressionConfig``. Lossy, opt-in.
    """

    sampling: bool = False
    pruning: bool | PruningConfig = False
    scheduling: bool | SchedulingConfig = False
    entropy_target: float = 2.0
    switching: bool | SwitchingConfig = False
    sparse_prefill: bool | SparsePrefillConfig = False
    kv_compression: bool | KVCompressionConfig = False

    def __post_init__(self) -> None:
        check_float("entropy_target", self.entropy_target, low=0.0, low_open=True)
        layers = {
            "pruning": PruningConfig,
            "scheduling": SchedulingConfig,
            "switching": SwitchingConfig,
            "sparse_prefill": SparsePrefillConfig,
            "kv_compression": KVCompressionConfig,
        }
        for name, kind in layers.items():
            if not isinstance(getattr(self, name), bool | kind):
                raise ValueError(
                    f"{name} must be a bool or a {kind.__name__}, got {getattr(self, name)!r}"
                )

    @classmethod
    def baseline(cls) -> ControlConfig:
        """Fixed scheduling, dense attention, fixed temperature."""
        return cls()

    @classmethod
    def full(cls) -> ControlConfig:
        """Every control layer on, with its defaults."""
        return cls(sampling=True, pruning=True, scheduling=True)

    @property
    def pruning_config(self) -> PruningConfig | None:
        return _settings(self.pruning, PruningConfig)

    @property
    def switching_config(self) -> SwitchingConfig | None:
        return _settings(self.switching, SwitchingConfig)

    @property
    def scheduling_config(self) -> SchedulingConfig | None:
        return _settings(self.scheduling, SchedulingConfig)

    @property
    def kv_compression_config(self) -> KVCompressionConfig | None:
        return _settings(self.kv_compression, KVCompressionConfig)

    @property
    def sparse_prefill_config(self) -> SparsePrefillConfig | None:
        return _settings(self.sparse_prefill, SparsePrefillConfig)


def _settings(value: bool | _Layer, kind: type[_Layer]) -> _Layer | None:
    """A layer's settings: its defaults where switched on by ``True``, None where off."""
    if value is True:
        return kind()
    return value or None
