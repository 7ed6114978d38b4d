"""Gemma 3's decoder layer (text): the Llama decoder with norms around both halves, query and key
norms, a GELU-tanh gated MLP, and attention that slides on five layers of six.

Where it differs from ``llama.py``'s layer, as transformers' ``Gemma3DecoderLayer`` computes it:
- RMSNorm scales by ``1 + weight`` (the offset is added once, at load: ``Family.norm_offset``);
- the attention and MLP outputs are normed again before each residual add;
- queries and keys are RMS-normed per head before RoPE, and scores are scaled by
  ``query_pre_attn_scalar ** -0.5`` (``ModelConfig.attention_scale``);
- sliding layers take their own RoPE base (``ModelConfig.local_rope_theta``, chosen per layer by
  the model) and window (``ModelConfig.window``, chosen per layer by the attention);
- the embeddings are scaled by sqrt(hidden_size) (``Family.scales_embeddings``).

Gemma 2's layer is this one without the query and key norms (read where a file has them), its
window on every other layer and one RoPE base (the config says so), and its scores and logits
soft-capped (``ModelConfig.attention_softcap``, ``logit_softcap``: attention and the model
apply them, not the layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from etinfer.model.config import ModelConfig
from etinfer.model.family import Family
from etinfer.model.linear import kernel_input_dtype
from etinfer.model.llama import DecoderLayer, WeightReader
from etinfer.model.native_decoder import gated_activation, norm_rows
from etinfer.model.norm import RMSNorm


class Gemma3DecoderLayer(DecoderLayer):
    """The Llama layer's step (``DecoderLayer.__call__``) with Gemma's rotation and MLP half."""

    def __init__(self, config: ModelConfig, read: WeightReader, prefix: str) -> None:
        # The projections, the input norm and the query/key norms are Llama's (with the
        # family's norm offset); "post_attention_layernorm" is Gemma's norm of the attention
        # output, not the norm before the MLP, which has a name of its own.
        super().__init__(config, read, prefix)
        self.post_attention_norm = read.norm(prefix + "post_attention_layernorm.weight")
        self.pre_feedforward_norm = RMSNorm(
            read.norm(prefix + "pre_feedforward_layernorm.weight"),
            self.eps,
            kernel_input_dtype(self.gate_up),
        )
        self.post_feedforward_norm = read.norm(prefix + "post_feedforward_layernorm.weight")

    activation = "gelu_tanh"

    def native_roles(self) -> dict[str, torch.Tensor]:
        return self.head_norm_roles() | {
            "input_norm": self.input_norm.weight,
            "mlp_norm": self.pre_feedforward_norm.weight,
            "attention_out_norm": self.post_attention_norm,
            "mlp_out_norm": self.post_feedforward_norm,
        }

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.native:
            return norm_rows(x, weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def feed_forward(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Both halves' outputs normed again before their residual adds; a GELU-tanh MLP."""
        attended = self._rms(attended.to(x.dtype), self.post_attention_norm)
        x, h = self.pre_feedforward_norm(attended, x)
        if self.native:
            out = self.down(gated_activation(self.gate_up(h), self.activation))
        else:
            gate, up = self.gate_up(h).split(self.intermediate, dim=-1)
            out = self.down(F.gelu(gate, approximate="tanh") * up)
        return x + self._rms(out.to(x.dtype), self.post_feedforward_norm)


GEMMA3 = Family(Gemma3DecoderLayer, norm_offset=1.0, scales_embeddings=True)
