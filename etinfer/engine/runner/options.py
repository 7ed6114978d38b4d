"""How a model runner is built: the engine's settings for one model, read once from the
``EngineConfig`` and the model's config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from etinfer.config import EngineConfig
from etinfer.control.sparse_prefill import SparsePrefillConfig
from etinfer.control.stress import StressConfig
from etinfer.model.attention.options import AttentionOptions
from etinfer.model.config import ModelConfig


@dataclass(frozen=True, kw_only=True)
class RunnerOptions:
    attention: AttentionOptions
    max_model_len: int
    num_blocks: int  # of the KV pool
    block_size: int
    device: torch.device
    dtype: torch.dtype  # of the weights' activations
    kv_cache_dtype: torch.dtype = torch.float32
    quantization: str = "auto"
    seed: int = 0  # of the sampler's generator
    calibration_temperature: float = 1.0
    stress: StressConfig | None = None
    sparse_prefill: SparsePrefillConfig | None = None
    # Replay plain decode steps of up to ``max_num_seqs`` rows as CUDA graphs, where the device
    # is CUDA and no layer changes a decode step's shape.
    cuda_graphs: bool = False
    max_num_seqs: int = 256

    @classmethod
    def of(
        cls,
        config: EngineConfig,
        model: ModelConfig,
        *,
        max_model_len: int,
        num_blocks: int,
        calibration_temperature: float = 1.0,
    ) -> RunnerOptions:
        """The engine's runner of ``model``: every setting ``config`` makes."""
        return cls(
            attention=AttentionOptions.of_model(
                model, backend=config.attention_backend, batch_invariant=config.batch_invariant
            ),
            max_model_len=max_model_len,
            num_blocks=num_blocks,
            block_size=config.block_size,
            device=config.torch_device(),
            dtype=config.torch_dtype(),
            kv_cache_dtype=config.torch_kv_cache_dtype(),
            quantization=config.quantization,
            seed=config.seed,
            calibration_temperature=calibration_temperature,
            stress=config.stress,
            sparse_prefill=config.control.sparse_prefill_config,
            cuda_graphs=config.cuda_graphs,
            max_num_seqs=config.max_num_seqs,
        )

    def without_layers(self) -> RunnerOptions:
        """These options for a plain forward pass: no stress, no sparse prefill, every step
        eager (a draft model's runner)."""
        return dataclasses.replace(self, stress=None, sparse_prefill=None, cuda_graphs=False)
