"""The ``native`` backend: decode in one call of the C kernel (``native_kernels.py``: scores,
softmax and the weighted sum of values, each row alone, over the cache as stored), prefill
through SDPA. The CPU's choice wherever the kernel takes the model's heads."""

from __future__ import annotations

import torch

from etinfer.model import native_kernels
from etinfer.model.attention.pattern import DecodePattern
from etinfer.model.attention.pattern_decode import PatternDecode
from etinfer.model.kv_cache import KVCache


class NativeBackend(PatternDecode):
    def refusal(self, device: torch.device) -> str | None:
        options = self.options
        if device.type != "cpu":
            return f"its C kernel runs on the CPU, not on {device}"
        if not native_kernels.available():
            return "the native library is off (ETINFER_NATIVE=0) or could not be built"
        if not native_kernels.takes(options.head_dim, options.group):
            return (
                f"its C kernel does not take head_dim {options.head_dim} with "
                f"{options.group} query heads per KV head"
            )
        if options.softcap is not None:
            return "its C kernel computes plain scores, without the model's soft cap"
        return None

    def attend(
        self, layer: int, q: torch.Tensor, cache: KVCache, pattern: DecodePattern
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return native_kernels.decode_attention(
            q,
            cache.key_rows[layer],  # row kv_head * num_slots + slot
            cache.value_rows[layer],
            pattern.crow,
            pattern.cols,
            pattern.outside,
            self.options.group,
            self.options.scale,
            *cache.scales(layer),
        )
