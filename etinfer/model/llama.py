"""The Llama-family forward pass (Llama, SmolLM, Mistral, Qwen2) over a paged KV cache, and the
machinery other families share with it (weights read by name, the model around the layers):
a family differs in its decoder layer and a few details (``family.py``; Gemma 3 in
``gemma3.py``).

Inference only: plain tensors, no autograd, no nn.Module machinery on the hot path. The batch is
flat: every row is one token of some sequence, so prefill chunks and decode tokens of different
sequences go through each weight matmul together.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
import torch.nn.functional as F

from etinfer.model import native_kernels, quant_kernels
from etinfer.model.attention.layer import PagedAttention
from etinfer.model.attention.metadata import AttentionMetadata
from etinfer.model.config import ModelConfig
from etinfer.model.family import Family
from etinfer.model.gpu.weight_only import WeightOnlyLinear
from etinfer.model.head_scores import Scores, fused_head, head_scores
from etinfer.model.kv_cache import KVCache
from etinfer.model.linear import BlockLinear, kernel_input_dtype, make_head, make_linear
from etinfer.model.loader import LoadedModel
from etinfer.model.native_decoder import (
    NativeDecoders,
    elementwise_native,
    gated_activation,
    norm_heads,
    rotate_heads,
)
from etinfer.model.norm import RMSNorm
from etinfer.model.quantized import (
    BLOCK_MODES,
    Format,
    GGUFBlocks,
    Weight,
    as_float,
    form_of,
    resolve_auto,
    stack_rows,
    weight_format,
)
from etinfer.model.rotary import RotaryEmbedding, RotaryRows
from etinfer.model.softcap import softcap

logger = logging.getLogger("etinfer.model")


class WeightReader:
    """Reads the model's weights by name, in the format ``quantization`` gives each matrix, and
    keeps note of what was read and of what a user should be told (``notes``)."""

    def __init__(
        self,
        weights: dict[str, Weight],
        quantization: str,
        device: torch.device,
        dtype: torch.dtype,
        norm_offset: float = 0.0,
    ) -> None:
        """``norm_offset``: the family's, added to every RMSNorm weight (``norm``)."""
        if device.type != "cpu" and quantization in BLOCK_MODES:
            raise ValueError(
                f"quantization={quantization!r} runs on etinfer's CPU block kernels; on {device} "
                "use 'auto' or 'none' (float weights) or 'int4' or 'int8' (the GPU's kernels)"
            )
        self.weights, self.device, self.dtype = weights, device, dtype
        self.norm_offset = norm_offset
        self.quantization = resolve_auto(quantization, weights, device)
        self.notes: list[str] = []
        blocks = any(isinstance(w, GGUFBlocks) for w in weights.values())
        if quantization == "auto" and self.quantization == "none" and blocks:
            self.notes.append(f"GGUF blocks dequantized to float: no integer kernels on {device}")
        if quantization in BLOCK_MODES and blocks and not quant_kernels.available():
            self.notes.append(
                f"quantization={quantization!r}: etinfer's block kernels are not available here "
                "(they need x86-64-v3, a C compiler and ETINFER_NATIVE not 0); the weights run "
                "as in 'auto'"
            )
        self.used: set[str] = set()
        self.dequantized: list[str] = []
        self.forms: Counter[str] = Counter()  # how the matrices multiply, counted

    def raw(self, name: str) -> Weight:
        if name not in self.weights:
            raise ValueError(f"the model's weights lack {name}")
        self.used.add(name)
        return self.weights[name]

    def vector(self, name: str) -> torch.Tensor:
        """A bias: always float, in the engine's dtype."""
        return as_float(self.raw(name)).to(self.device, self.dtype)

    def norm(self, name: str) -> torch.Tensor:
        """An RMSNorm weight, the family's offset added in float32 first (Gemma's norms scale by
        1 + weight, computed so in float32), then in the engine's dtype."""
        return (as_float(self.raw(name)).float() + self.norm_offset).to(self.device, self.dtype)

    def matrix(self, *names: str, lookup: bool = False) -> Format:
        """The weights of ``names`` stacked by output rows, in their format; a ``lookup`` (an
        embedding only read by rows) is not counted among the forms that multiply."""
        weight, dequantized = weight_format(
            stack_rows([self.raw(n) for n in names]), self.quantization, "+".join(names)
        )
        if dequantized:
            self.dequantized.append(dequantized)
        if not lookup:
            self.forms[form_of(weight)] += 1
        if isinstance(weight, torch.Tensor):
            return weight.to(self.device, self.dtype)
        return weight if self.device.type == "cpu" else weight.to(self.device)


class DecoderLayer:
    def __init__(self, config: ModelConfig, read: WeightReader, prefix: str) -> None:
        qkv_bias = None
        if config.attention_bias:
            qkv_bias = torch.cat([read.vector(f"{prefix}self_attn.{p}_proj.bias") for p in "qkv"])
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        self.qkv = make_linear(read.matrix(*(f"{attn}{p}_proj.weight" for p in "qkv")), qkv_bias)
        self.o = make_linear(read.matrix(attn + "o_proj.weight"))
        self.gate_up = make_linear(read.matrix(mlp + "gate_proj.weight", mlp + "up_proj.weight"))
        self.down = make_linear(read.matrix(mlp + "down_proj.weight"))
        eps = self.eps = config.rms_norm_eps
        # Query and key RMS norms per head, before RoPE, where the model has them (Qwen 3).
        self.q_norm = self.k_norm = None
        if attn + "q_norm.weight" in read.weights:
            self.q_norm = read.norm(attn + "q_norm.weight")
            self.k_norm = read.norm(attn + "k_norm.weight")
        self.input_norm = RMSNorm(
            read.norm(prefix + "input_layernorm.weight"), eps, kernel_input_dtype(self.qkv)
        )
        self.post_attention_norm = RMSNorm(
            read.norm(prefix + "post_attention_layernorm.weight"),
            eps,
            kernel_input_dtype(self.gate_up),
        )
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.intermediate = config.intermediate_size
        # Rotation, per-head norms and the gated activation in C where the projections run on
        # the block kernels (the norms are native there too); then a decode step may run the
        # whole layer in C (``native_decoder.py``), which computes exactly this layer's stages.
        self.native = self.input_norm.native and elementwise_native(
            self.qkv, self.o, self.gate_up, self.down, width=self.intermediate
        )

    activation = "silu"

    def native_roles(self) -> dict[str, torch.Tensor]:
        """The layer's norm weights by their role in the native decoder's layer."""
        roles = {"input_norm": self.input_norm.weight, "mlp_norm": self.post_attention_norm.weight}
        return roles | self.head_norm_roles()

    def head_norm_roles(self) -> dict[str, torch.Tensor]:
        """The query and key norms, where the model has them."""
        return {} if self.q_norm is None else {"q_norm": self.q_norm, "k_norm": self.k_norm}

    def __call__(
        self,
        index: int,
        x: torch.Tensor,
        angles: RotaryRows,
        attention: PagedAttention,
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        rows = x.shape[0]
        _, h = self.input_norm(x)
        # As heads: [rows, q heads + k heads + v heads, head_dim], views taken in few calls.
        qkv = self.qkv(h).to(x.dtype).view(rows, -1, self.head_dim)
        q, k, v = self.rotate(qkv, angles)
        attended = attention(index, q, k, v, cache, meta).to(x.dtype)
        return self.feed_forward(x, self.o(attended))

    def rotate(
        self, qkv: torch.Tensor, angles: RotaryRows
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The queries and keys rotated (RMS-normed per head first, where the model norms them),
        and the values, of the projected heads (``qkv``, the projection's own output)."""
        heads = (self.num_heads, self.num_kv_heads, self.num_kv_heads)
        qk_heads = self.num_heads + self.num_kv_heads
        if self.native:  # in place, on the projection's own output
            if self.q_norm is not None:
                norm_heads(qkv, slice(self.num_heads), self.q_norm, self.eps)
                norm_heads(qkv, slice(self.num_heads, qk_heads), self.k_norm, self.eps)
            rotate_heads(qkv, qk_heads, angles)
            return qkv.split(heads, dim=1)
        if self.q_norm is not None:
            q, k, v = qkv.split(heads, dim=1)
            q = F.rms_norm(q, (self.head_dim,), self.q_norm, self.eps)
            k = F.rms_norm(k, (self.head_dim,), self.k_norm, self.eps)
            return RotaryEmbedding.apply(q, angles), RotaryEmbedding.apply(k, angles), v
        q, k = RotaryEmbedding.apply(qkv[:, :qk_heads], angles).split(heads[:2], dim=1)
        return q, k, qkv[:, qk_heads:]

    def feed_forward(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The residual stream after the attention's output ``attended`` and the MLP."""
        x, h = self.post_attention_norm(x, attended)
        if self.native:
            return x + self.down(gated_activation(self.gate_up(h), self.activation))
        gate, up = self.gate_up(h).split(self.intermediate, dim=-1)
        return x + self.down(F.silu(gate) * up)


class LlamaWeights:
    """The model's weights prepared for their kernels (packed, interleaved, dequantized as the
    quantization mode says), read-only once built.

    Engines over the same weights share one (``prepared``): each prepared copy of the default
    model takes 0.3 s to build in 4 bits and 0.6 s in float32, and hundreds of MiB; benchmarks
    and tests build dozens of engines over one model, each with its own cache and settings.
    """

    def __init__(
        self,
        config: ModelConfig,
        family: Family,
        weights: dict[str, Weight],
        quantization: str,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        read = WeightReader(weights, quantization, device, dtype, family.norm_offset)
        tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        self.embed = read.matrix("model.embed_tokens.weight", lookup=not tied)
        self.layers = [
            family.layer(config, read, f"model.layers.{i}.") for i in range(config.num_layers)
        ]
        self.norm = read.norm("model.norm.weight")
        self.lm_head = make_head(self.embed if tied else read.matrix("lm_head.weight"))
        head_weight = getattr(self.lm_head, "weight", None)
        if tied and isinstance(head_weight, WeightOnlyLinear | BlockLinear):
            self.embed = head_weight  # the tied rows read from the head's own copy
        unexpected = sorted(set(weights) - read.used - {"lm_head.weight"})
        if unexpected:
            raise ValueError(f"unexpected weights in the model: {', '.join(unexpected[:5])}")
        if read.dequantized:
            read.notes.append("weights run as float: " + "; ".join(read.dequantized))
        self.notes = read.notes
        self.forms = read.forms


def prepared(
    model: LoadedModel, family: Family, quantization: str, device: torch.device, dtype: torch.dtype
) -> LlamaWeights:
    """``model``'s weights prepared for ``quantization`` on ``device``, shared with any engine
    over the same model that has them already. The kernels' availability is part of the key: it
    decides each layer's form."""
    kernels = (native_kernels.available(), quant_kernels.available())
    key = (quantization, str(device), dtype, kernels)
    found = model.prepared.get(key)
    if found is None:
        found = LlamaWeights(model.config, family, model.weights, quantization, device, dtype)
        model.add_prepared(key, found)
        model.release_file_pages()
    for note in found.notes:  # told for every engine that runs them so
        logger.warning(note)
    return found


class LlamaModel:
    def __init__(
        self,
        model: LoadedModel,
        family: Family,
        attention: PagedAttention,
        max_positions: int,
        device: torch.device,
        dtype: torch.dtype,
        quantization: str = "auto",
    ) -> None:
        """``model``'s weights are read, not changed: engines share them, and their prepared
        form (``prepared``)."""
        self.config = config = model.config
        self.dtype = dtype
        self.weights = prepared(model, family, quantization, device, dtype)
        self.embed, self.layers = self.weights.embed, self.weights.layers
        self.norm, self.lm_head = self.weights.norm, self.weights.lm_head
        # One table of each RoPE the layers use: the sliding layers' own where their base differs.
        self.ropes = [RotaryEmbedding(config, max_positions, device, dtype)]
        self.layer_rope = [0] * config.num_layers
        if config.local_rope_theta is not None:
            self.ropes.append(RotaryEmbedding(config, max_positions, device, dtype, local=True))
            self.layer_rope = [int(config.window(i) is not None) for i in range(config.num_layers)]
        self.embed_scale = None
        if family.scales_embeddings:
            self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=dtype, device=device)
        self.attention = attention
        self.decoders = NativeDecoders(config, self.layers, attention)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, torch.Tensor):
            x = F.embedding(input_ids, self.embed)
        else:
            x = self.embed.dequantize(input_ids).to(self.dtype)
        return x if self.embed_scale is None else x * self.embed_scale

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """Final hidden states [rows, hidden] of a flat batch of tokens, after the final norm;
        with ``num_layers``, the residual stream after that many layers (an early exit)."""
        x = self.embed_tokens(input_ids)
        x = self.run_layers(x, positions, cache, meta, range(num_layers or len(self.layers)))
        return x if num_layers is not None else self.final_norm(x)

    def run_layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
        layers: range,
    ) -> torch.Tensor:
        angles = [rope.rows(positions) for rope in self.ropes]
        decoder = self.decoders.for_step(cache, meta)
        if decoder is not None:
            for run, pattern in self.attention.segments(cache, meta, layers):
                x = decoder(x, angles, meta, run, pattern)
        else:
            for index in layers:
                layer = self.layers[index]
                x = layer(index, x, angles[self.layer_rope[index]], self.attention, cache, meta)
        cache.update_sketch(slice(layers.start, layers.stop), meta.slot_mapping)
        return x

    def decode_path(self, cache: KVCache) -> str:
        """How decode-only steps over ``cache`` run, in words."""
        return self.decoders.path(cache)

    def final_norm(self, x: torch.Tensor, weight: bool = True) -> torch.Tensor:
        """The final RMS norm; without its ``weight``, the bare normalisation."""
        norm = self.norm if weight else None
        return F.rms_norm(x, (x.shape[-1],), norm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.logit_softcap
        return logits if cap is None else softcap(logits, cap)

    def score_tokens(
        self, hidden: torch.Tensor, targets: torch.Tensor, count: int
    ) -> Scores | None:
        """Each row of ``hidden`` scored against the token ``targets`` names, with its top
        ``count``, without the logits written out (``head_scores``); None where the head has
        no such form (the caller scores ``compute_logits``' rows)."""
        head = fused_head(self.lm_head)
        if head is None or self.config.logit_softcap is not None:
            return None
        return head_scores(head, hidden, targets, count)


LLAMA = Family(DecoderLayer)
