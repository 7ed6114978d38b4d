"""Rotary position embeddings in Hugging Face's layout (the two halves of each head rotate)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from etinfer.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """The global layers' frequencies, or with ``local`` the sliding layers' (their own base,
    unscaled, as Gemma 3 has them)."""
    dim = config.head_dim
    theta = config.local_rope_theta if local else config.rope_theta
    # Same expression as transformers, so the tables agree bit for bit.
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = None if local else config.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    raise ValueError(f"rope_scaling type {kind!r} is not supported; expected linear or llama3")


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin tables, indexed by position once per step and shared by the layers
    that use them (``local``: the sliding layers' own tables, where their base differs).

    The tables hold half a head: both halves of a head rotate by the same angles, so a row is
    its half twice (the full tables of Gemma 3's 32K positions and two bases took 128 MB)."""

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        device: torch.device,
        dtype: torch.dtype,
        local: bool = False,
    ):
        freqs = torch.outer(
            torch.arange(max_positions, dtype=torch.float32), inverse_frequencies(config, local)
        )
        self.cos = freqs.cos().to(device, dtype)
        self.sin = freqs.sin().to(device, dtype)

    def rows(self, positions: torch.Tensor) -> RotaryRows:
        """The angles of each row's position, shared by the layers that use these tables."""
        return RotaryRows(self.cos[positions], self.sin[positions])

    @staticmethod
    def apply(x: torch.Tensor, rows: RotaryRows) -> torch.Tensor:
        """Rotate x [rows, heads, head_dim]."""
        cos, sin = rows.signed
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


@dataclass
class RotaryRows:
    """A step's rows of the tables: the cos and sin of each row's position, [rows, head_dim / 2]
    (what the native rotation reads)."""

    cos: torch.Tensor
    sin: torch.Tensor

    @functools.cached_property
    def signed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin, shaped [rows, 1, head_dim] to broadcast over heads, built on first
        use. rotate_half(x) = cat(-x2, x1) = roll(x, half) with the first half negated; folding
        the sign into the sine turns rotation into one roll and one fused multiply-add."""
        cos, sin = self.cos, self.sin
        return torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1)
