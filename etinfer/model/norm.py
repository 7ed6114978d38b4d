"""The RMS norms before a layer's attention and MLP, with the residual add that precedes one."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from etinfer.model import native_kernels


class RMSNorm:
    """``x + residual`` and ``rms_norm(x + residual) * weight``.

    Where the norm feeds an integer kernel (``kernel_dtype``: bfloat16 for torch's, float32 for
    the block kernels), the add, the norm and the conversion run as one native pass: at batch 1
    each of the three torch operations costs more to dispatch than to compute. Before float
    weights (``kernel_dtype`` None) the torch operations run, which keeps the float path token
    for token what transformers computes.
    """

    def __init__(self, weight: torch.Tensor, eps: float, kernel_dtype: torch.dtype | None) -> None:
        self.weight, self.eps, self.dtype = weight, eps, kernel_dtype
        self.native = (
            kernel_dtype is not None
            and weight.device.type == "cpu"
            and weight.dtype == torch.float32
            and weight.numel() % 8 == 0
            and native_kernels.available()
        )

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream after the add, and its norm."""
        takes = residual is None or residual.dtype in (torch.bfloat16, torch.float32)
        if self.native and x.dtype == torch.float32 and takes:
            return native_kernels.residual_rms_norm(x, residual, self.weight, self.eps, self.dtype)
        if residual is not None:
            x = x + residual
        return x, F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
