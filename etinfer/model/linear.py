"""Dense layers with weights laid out for the fastest kernel the device has."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# oneDNN picks its blocked weight layout from a batch-size hint. Measured on a 2-core AVX2 machine,
# a hint of 16 is the fastest of 1, 16 for every batch from 1 to 2,048 rows.
_ONEDNN_BATCH_HINT = 16


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear:
    """``y = x W^T + b`` for ``x`` of shape [rows, in].

    On the CPU in float32 the weight is prepacked once into oneDNN's blocked layout (the path
    PyTorch's own compiler takes with frozen weights): a decode step's weight matmuls then take
    about half the time of ``F.linear`` on the plain [out, in] weight, at batch 1 and at batch 16
    alike. Anywhere else the plain weight and ``F.linear`` are used.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = weight.device.type == "cpu" and weight.dtype == torch.float32
        self.packed = self.packed and _onednn_available()
        if self.packed:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, _ONEDNN_BATCH_HINT)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
