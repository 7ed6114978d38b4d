"""Engine configuration: what to load, where, and how much the scheduler may batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from etinfer.control.block_selection import PruningConfig
from etinfer.control.scheduling import SCHEDULING_POLICIES, SchedulingConfig
from etinfer.validation import check_choice, check_float, check_int

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ControlConfig:
    """Which entropy control layers are on, engine-wide.

    - sampling: requests that choose no temperature controller of their own (and are not greedy)
      sample with ``entropy_target``, by the feedback law.
    - pruning: decode attention keeps only the blocks the entropic selector picks; ``True`` uses
      the default ``PruningConfig``.
    - scheduling: the ``entropy`` scheduling policy replaces ``EngineConfig.scheduling_policy``;
      ``True`` uses the default ``SchedulingConfig``.
    """

    sampling: bool = False
    pruning: bool | PruningConfig = False
    scheduling: bool | SchedulingConfig = False
    entropy_target: float = 2.0

    def __post_init__(self) -> None:
        check_float("entropy_target", self.entropy_target, low=0.0, low_open=True)
        if not isinstance(self.scheduling, bool | SchedulingConfig):
            raise ValueError(
                f"scheduling must be a bool or a SchedulingConfig, got {self.scheduling!r}"
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
        if self.pruning is True:
            return PruningConfig()
        return self.pruning or None

    @property
    def scheduling_config(self) -> SchedulingConfig | None:
        if self.scheduling is True:
            return SchedulingConfig()
        return self.scheduling or None


@dataclass
class EngineConfig:
    """Everything the engine needs besides the requests.

    ``max_model_len`` defaults to the model's own context length. ``num_kvcache_blocks`` defaults
    to as many blocks as fit in ``kv_cache_gib`` (float32 keys and values). On the CPU the OS backs
    the pool lazily, so an unused part costs address space, not memory; on CUDA it is reserved.
    """

    model: str | None = None  # path to a .gguf file or a Hugging Face folder; None: the default
    dtype: str = "auto"  # of the weights; "auto" is float32 (the checked path, CPU and CUDA)
    device: str = "auto"  # cuda when available, else cpu
    max_model_len: int | None = None
    block_size: int = 16
    num_kvcache_blocks: int | None = None
    kv_cache_gib: float = 4.0
    max_num_seqs: int = 64
    # One chunk of prefill per step is bounded by this; on two CPU cores 1,024 tokens take about
    # a third of a second, which is the stall a running stream sees when a long prompt arrives.
    max_num_batched_tokens: int = 1024
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    seed: int = 0
    calibration: str | None = None  # a file from `etinfer calibrate`: rescales the control signal
    control: ControlConfig = field(default_factory=ControlConfig)

    def __post_init__(self) -> None:
        check_choice("dtype", self.dtype, ("auto", *DTYPES))
        if self.device != "auto":
            try:
                torch.device(self.device)
            except RuntimeError as e:
                raise ValueError(
                    f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}"
                ) from e
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, low=2)
        check_int("block_size", self.block_size, low=1, high=1024)
        if self.num_kvcache_blocks is not None:
            check_int("num_kvcache_blocks", self.num_kvcache_blocks, low=1)
        check_float("kv_cache_gib", self.kv_cache_gib, low=0.0, low_open=True)
        check_int("max_num_seqs", self.max_num_seqs, low=1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, low=1)
        check_int("seed", self.seed, low=0, high=2**63 - 1)
        SCHEDULING_POLICIES.check(self.scheduling_policy)
        if not isinstance(self.control, ControlConfig):
            raise ValueError(f"control must be a ControlConfig, got {self.control!r}")

    @property
    def policy_name(self) -> str:
        """The scheduling policy in force: the control layer's switch wins."""
        return "entropy" if self.control.scheduling_config else self.scheduling_policy

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        return torch.float32 if self.dtype == "auto" else DTYPES[self.dtype]
