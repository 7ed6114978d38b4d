"""The attention backends by name, and which one an engine runs
(``EngineConfig.attention_backend``).

``auto`` picks once, when the engine is built: the GPU's kernels on CUDA with Triton; the C
kernel on the CPU where it is built and takes the model's heads and scores (no soft cap); the
torch operations elsewhere. A backend asked for by name is checked to run on the device.
"""

from __future__ import annotations

import torch

from etinfer.control.registry import Registry
from etinfer.model import gpu
from etinfer.model.attention.backend import AttentionBackend
from etinfer.model.attention.native_backend import NativeBackend
from etinfer.model.attention.options import AttentionOptions
from etinfer.model.attention.torch_backend import TorchBackend
from etinfer.model.attention.triton_backend import TritonBackend

ATTENTION_BACKENDS: Registry[AttentionBackend] = Registry("attention backend")
ATTENTION_BACKENDS.register("native")(NativeBackend)
ATTENTION_BACKENDS.register("torch")(TorchBackend)
ATTENTION_BACKENDS.register("triton")(TritonBackend)


def create_backend(options: AttentionOptions, device: torch.device) -> AttentionBackend:
    """The backend ``options`` names (or ``auto``'s choice) for layers on ``device``."""
    name = options.backend
    if name == "auto":
        return ATTENTION_BACKENDS.create(auto_backend(options, device), options=options)
    backend = ATTENTION_BACKENDS.create(name, options=options)
    refusal = backend.refusal(device)
    if refusal is not None:
        raise ValueError(f"attention_backend={name!r} cannot run this model here: {refusal}")
    return backend


def auto_backend(options: AttentionOptions, device: torch.device) -> str:
    """The fastest backend that runs on ``device`` for these layers."""
    if gpu.serves(device):
        return "triton"
    if NativeBackend(options).refusal(device) is None:
        return "native"
    return "torch"
