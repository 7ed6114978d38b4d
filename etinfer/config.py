"""Engine configuration: what to load, where, and how much the scheduler may batch."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from etinfer.compatibility import check_compatible
from etinfer.control.config import ControlConfig
from etinfer.control.drafting import SpeculativeConfig
from etinfer.control.scheduling import SCHEDULING_POLICIES
from etinfer.control.shaping import STEP_SHAPERS
from etinfer.control.stress import StressConfig
from etinfer.model.attention.registry import ATTENTION_BACKENDS
from etinfer.model.quantized import QUANTIZATION_MODES
from etinfer.structured.params import BACKENDS
from etinfer.validation import check_choice, check_float, check_int

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What ``kv_cache_dtype="auto"`` stores: float16, as llama.cpp does by default. It halves the
# bytes decode attention reads a token (the larger share of a step at long contexts), and keeps
# about three decimal digits where keys and values need far fewer (BENCHMARKS.md, "A 16-bit KV
# cache"); F16C (every x86-64-v3 host) widens it for free as the kernel loads it.
AUTO_KV_CACHE_DTYPE = "float16"
# On CUDA ``auto`` is bfloat16 for weights and cache alike, as vLLM and transformers run there:
# tensor cores take it natively, and its float32 range needs no overflow care.
CUDA_AUTO_DTYPE = "bfloat16"
# Where set, what ``device="auto"`` means (the test suite sets it to pick its device).
DEVICE_ENV = "ETINFER_DEVICE"
KV_CACHE_DTYPES = DTYPES | {"int8": torch.int8}
ATTENTION_BACKEND_CHOICES = ("auto", *ATTENTION_BACKENDS.names)


@dataclass
class EngineConfig:
    """Everything the engine needs besides the requests.

    ``max_model_len`` defaults to the model's own context length. ``num_kvcache_blocks`` defaults
    to as many blocks as fit in ``kv_cache_gib`` (keys and values in ``kv_cache_dtype``). On the
    CPU the OS backs the pool lazily, so an unused part costs address space, not memory; on CUDA
    it is reserved.
    """

    model: str | None = field(
        default=None,
        metadata={
            "help": "a .gguf file, a Hugging Face folder or an installed model's name (etinfer "
            "models; default: smollm2-135m-instruct)"
        },
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "of the weights: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, "
            "float16"
        },
    )
    quantization: str = field(
        default="auto",
        metadata={
            "help": "of the weights: auto (gguf where etinfer's block kernels run; else a GGUF "
            "keeps its own: Q4_0/Q4_1 as int4, Q8_0 as int8), gguf (every GGUF block format in "
            "its blocks, on etinfer's kernels with 8-bit activations), gguf-a16 (as gguf, the "
            "activations in two 8-bit parts: closer to float, slower at batches), gguf-a32 (as "
            "gguf, Q4_0/Q4_1 times float32 activations), none (float, dequantized at load), "
            "int8 (per row), int4 (groups of 32); on CUDA auto is none, int4 and int8 run on the "
            "GPU's own kernel"
        },
    )
    device: str = field(
        default="auto",
        metadata={"help": f"auto (${DEVICE_ENV} if set, else cuda when available), cpu, cuda[:N]"},
    )
    max_model_len: int | None = field(
        default=None, metadata={"help": "longest sequence (default: the model's context length)"}
    )
    block_size: int = field(default=16, metadata={"help": "tokens per KV cache block"})
    num_kvcache_blocks: int | None = field(
        default=None,
        metadata={"help": "KV cache blocks in the pool (default: as many as fit in kv_cache_gib)"},
    )
    kv_cache_gib: float = field(
        default=4.0, metadata={"help": "KV pool size in GiB when num_kvcache_blocks is not set"}
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata={
            "help": "of the KV cache: auto (float16 on CPU, bfloat16 on CUDA), float16, "
            "bfloat16, int8 (a scale per token and KV head), float32 (exact against "
            "transformers); attention computes in float32 whatever it stores"
        },
    )
    attention_backend: str = field(
        default="auto",
        metadata={
            "help": "attention's kernels, by name: auto (triton on CUDA, else native where the "
            "C kernel takes the model, else torch), native (the C decode kernel, CPU), torch "
            "(torch operations, any device), triton (the GPU's kernels)"
        },
    )
    max_num_seqs: int = field(default=64, metadata={"help": "sequences one step may run"})
    cuda_graphs: bool = field(
        default=True,
        metadata={
            "help": "on CUDA, replay plain decode steps as CUDA graphs, one per batch-size "
            "bucket (off: every step eager, as vLLM's enforce_eager)"
        },
    )
    # One chunk of prefill per step is bounded by this; on two CPU cores 1,024 tokens take about
    # a third of a second, which is the stall a running stream sees when a long prompt arrives.
    max_num_batched_tokens: int = field(
        default=1024, metadata={"help": "tokens one step may compute (bounds a prefill chunk)"}
    )
    enable_prefix_caching: bool = field(
        default=True, metadata={"help": "reuse the KV blocks of prompts that share a prefix"}
    )
    scheduling_policy: str = field(
        default="fcfs",
        metadata={"help": "by name: fcfs, entropy (the scheduling control layer wins)"},
    )
    step_shaper: str = field(
        default="plain",
        metadata={"help": "how each step is computed, by name: plain (one token a sequence)"},
    )
    batch_invariant: bool = field(
        default=False,
        metadata={
            "help": "prefill attention through decode's row kernel: a token's logits are bit for "
            "bit the same in any prefill chunking, decode step or verification chunk (prefill "
            "is slower; BENCHMARKS.md)"
        },
    )
    seed: int = field(default=0, metadata={"help": "of sampling, for requests without a seed"})
    calibration: str | None = field(
        default=None,
        metadata={
            "help": "a file from `etinfer calibrate`, or auto (the model file's own, fitted "
            "once and cached): rescales the control signal"
        },
    )
    control: ControlConfig = field(
        default_factory=ControlConfig, metadata={"help": "entropy control layers to switch on"}
    )
    draft_model: str | None = field(
        default=None,
        metadata={"help": "the drafter of speculative decoding: self:N (the first N layers)"},
    )
    speculative: SpeculativeConfig | None = field(
        default=None,
        metadata={
            "help": "speculative decoding: none, or METHOD[:TOKENS[:SCHEDULE]] (ngram:4, "
            "ngram:4:fixed; schedules entropy, fixed, heuristic)"
        },
    )
    structured_backend: str = field(
        default="xgrammar",
        metadata={"help": "structured output's grammar library: xgrammar or llguidance"},
    )
    # Off by default: on this CPU engine a step's draft rows and sampling columns cost more than
    # the steps jump-forward saves (BENCHMARKS.md, structured output).
    jump_forward: bool = field(
        default=False,
        metadata={
            "help": "structured output: verify a grammar's forced continuation in one step "
            "(not with control.switching or control.kv_compression)"
        },
    )
    stress: StressConfig | None = field(
        default=None,
        metadata={
            "help": "for robustness studies only: distort the entropy the control layers read, "
            "SCALE[:BIAS] (measured on logits times SCALE, BIAS nats added)"
        },
    )

    def __post_init__(self) -> None:
        check_choice("dtype", self.dtype, ("auto", *DTYPES))
        check_choice("quantization", self.quantization, QUANTIZATION_MODES)
        self.device_type()  # a device torch does not know, named with where it came from
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, low=2)
        check_int("block_size", self.block_size, low=1, high=1024)
        if self.num_kvcache_blocks is not None:
            check_int("num_kvcache_blocks", self.num_kvcache_blocks, low=1)
        check_float("kv_cache_gib", self.kv_cache_gib, low=0.0, low_open=True)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, ("auto", *KV_CACHE_DTYPES))
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKEND_CHOICES)
        check_int("max_num_seqs", self.max_num_seqs, low=1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, low=1)
        check_int("seed", self.seed, low=0, high=2**63 - 1)
        SCHEDULING_POLICIES.check(self.scheduling_policy)
        check_choice("structured_backend", self.structured_backend, BACKENDS)
        STEP_SHAPERS.check(self.step_shaper)
        if not isinstance(self.control, ControlConfig):
            raise ValueError(f"control must be a ControlConfig, got {self.control!r}")
        if self.stress is not None and not isinstance(self.stress, StressConfig):
            raise ValueError(f"stress must be a StressConfig or None, got {self.stress!r}")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError(
                f"speculative must be a SpeculativeConfig or None, got {self.speculative!r}"
            )
        self._check_draft_model()
        if self.control.sparse_prefill_config is not None:
            self.control.sparse_prefill_config.check_block_size(self.block_size)
        check_compatible(self)

    def _check_draft_model(self) -> None:
        method = None if self.speculative is None else self.speculative.method
        if method == "draft" and self.draft_model is None:
            raise ValueError("speculative method 'draft' needs a draft_model ('self:N' or a path)")
        # Switching's catch-up reuses the small model's layers: it must be the model's own.
        own = self.draft_model is not None and self.draft_model.startswith("self:")
        if self.control.switching_config is not None and not own:
            raise ValueError(
                f"control.switching needs draft_model='self:N' (the small model), got "
                f"{self.draft_model!r}"
            )

    @property
    def policy_name(self) -> str:
        """The scheduling policy in force: the control layer's switch wins."""
        return "entropy" if self.control.scheduling_config else self.scheduling_policy

    def resolve_max_model_len(self, model_limit: int) -> int:
        """``max_model_len``, checked against the model's context length (its default)."""
        if self.max_model_len is None:
            return model_limit
        if self.max_model_len > model_limit:
            raise ValueError(
                f"max_model_len must be at most the model's context length {model_limit}, "
                f"got {self.max_model_len}"
            )
        return self.max_model_len

    def resolve_num_blocks(self, kv_bytes_per_token: int) -> int:
        """``num_kvcache_blocks``, or as many blocks as fit in ``kv_cache_gib``."""
        block_bytes = kv_bytes_per_token * self.block_size
        return self.num_kvcache_blocks or max(1, int(self.kv_cache_gib * 2**30) // block_bytes)

    def _named_device(self) -> torch.device:
        """The device asked for, without asking whether it is there."""
        if self.device != "auto":
            try:
                return torch.device(self.device)
            except RuntimeError as e:
                raise ValueError(
                    f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}"
                ) from e
        chosen = os.environ.get(DEVICE_ENV) or ("cuda" if torch.cuda.is_available() else "cpu")
        try:
            return torch.device(chosen)
        except RuntimeError as e:
            raise ValueError(
                f"${DEVICE_ENV} (what device='auto' means) must be 'cpu' or 'cuda[:N]', got "
                f"{chosen!r}"
            ) from e

    def device_type(self) -> str:
        """'cpu' or 'cuda': what the ``auto`` dtypes resolve by."""
        return self._named_device().type

    def torch_device(self) -> torch.device:
        device = self._named_device()
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r}: torch sees no CUDA device on this machine")
        return device

    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        # No CPU here has bf16 arithmetic; float32 is also what is exact against transformers.
        return torch.float32 if self.device_type() == "cpu" else DTYPES[CUDA_AUTO_DTYPE]

    def torch_kv_cache_dtype(self) -> torch.dtype:
        name = self.kv_cache_dtype
        if name == "auto":
            name = AUTO_KV_CACHE_DTYPE if self.device_type() == "cpu" else CUDA_AUTO_DTYPE
        return KV_CACHE_DTYPES[name]
