"""Host tensors to the step's device without making the host wait."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (built on the host) on ``device``. To CUDA it goes from pinned memory without
    waiting: a copy from pageable memory makes the host wait for the device, and a step should
    wait once, for its sampled tokens (torch's pinned allocator keeps the source until the copy
    is done)."""
    if device.type != "cuda":
        return tensor.to(device)
    # A view whose elements share memory (an expanded block table) cannot be pinned in place.
    return tensor.contiguous().pin_memory().to(device, non_blocking=True)
