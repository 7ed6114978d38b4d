"""Attention backends picked by name: the same tokens from each, auto's choice per device, and
refusals that say why. (The ``triton`` backend's engine test runs in Triton's interpreter with
the GPU tests: tests/gpu/test_gpu_paged_prefill.py.)"""

import dataclasses

import pytest
import torch

from etinfer import LLM, ControlConfig, SamplingParams
from etinfer.config import EngineConfig
from etinfer.control.block_selection import PruningConfig
from etinfer.model import gpu, native_kernels
from etinfer.model.attention.native_backend import NativeBackend
from etinfer.model.attention.options import AttentionOptions
from etinfer.model.attention.pruned_decode import PrunedDecode
from etinfer.model.attention.registry import auto_backend, create_backend
from etinfer.model.attention.sparse_prefill import SparsePrefill
from etinfer.model.attention.torch_backend import TorchBackend

CPU = torch.device("cpu")
OPTIONS = AttentionOptions(num_heads=4, num_kv_heads=2, head_dim=16)
needs_native = pytest.mark.skipif(not native_kernels.available(), reason="no native kernels")
# Pruning from the first decode step on, down to two blocks of the prompts' five or six.
EAGER = PruningConfig(
    scorer="bound", min_context=0, dense_layers=0, min_blocks=2, recent_blocks=1, max_shrink=1
)
PRUNING = {
    "dense": ControlConfig(),
    "pruned": ControlConfig(pruning=EAGER),
    "mass": ControlConfig(pruning=dataclasses.replace(EAGER, scorer="mass")),
    # One mask for several layers: their pattern is built once and shared.
    "reused": ControlConfig(
        pruning=dataclasses.replace(EAGER, scorer="reused-mass", selection_layers=(0,))
    ),
}


@needs_native
@pytest.mark.parametrize("control", PRUNING.values(), ids=PRUNING.keys())
def test_the_native_and_torch_backends_give_the_same_tokens(tiny_model, control):
    """Each picked by name on the CPU, dense and under pruning (whose selection each backend
    reads as its mask, and whose mass scorer reads each backend's weights)."""
    prompts = [[(13 * i + 7 * j) % 1000 for i in range(70 + 9 * j)] for j in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = {}
    for name in ("native", "torch"):
        llm = LLM(tiny_model, attention_backend=name, control=control, device="cpu")
        assert type(llm.engine.runner.attention.backend).__name__.lower() == f"{name}backend"
        generated = llm.generate(prompts, params)
        outputs[name] = [out.token_ids for out in generated]
        if control.pruning_config is not None:  # some blocks were left out
            assert min(min(out.blocks_kept) for out in generated) < 1.0
    assert outputs["native"] == outputs["torch"]


def test_an_unknown_backend_is_refused_with_the_known_names():
    with pytest.raises(ValueError, match="'auto', 'native', 'torch', 'triton', got 'flash'"):
        EngineConfig(attention_backend="flash")


def test_a_backend_that_cannot_run_here_is_refused_with_why(tiny_model, monkeypatch):
    native = AttentionOptions(num_heads=4, num_kv_heads=2, head_dim=16, backend="native")
    with pytest.raises(ValueError, match="runs on the CPU, not on cuda"):
        create_backend(native, torch.device("cuda"))
    if native_kernels.available():
        capped = dataclasses.replace(native, softcap=30.0)
        with pytest.raises(ValueError, match=r"'native' cannot run this model here: .*soft cap"):
            create_backend(capped, CPU)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="'triton' cannot run this model here"):
        LLM(tiny_model, attention_backend="triton", device="cpu")


def test_auto_keeps_each_devices_choice():
    """The GPU's kernels on CUDA with Triton; the C kernel on the CPU where it takes the heads
    and plain scores; the torch operations elsewhere."""
    cuda = torch.device("cuda")
    assert auto_backend(OPTIONS, cuda) == ("triton" if gpu.available() else "torch")
    assert auto_backend(OPTIONS, CPU) == ("native" if native_kernels.available() else "torch")
    capped = AttentionOptions(num_heads=4, num_kv_heads=2, head_dim=16, softcap=30.0)
    odd_heads = AttentionOptions(num_heads=4, num_kv_heads=2, head_dim=20)
    assert auto_backend(capped, CPU) == auto_backend(odd_heads, CPU) == "torch"
    assert isinstance(create_backend(capped, CPU), TorchBackend)


@needs_native
def test_a_dense_engine_runs_its_backend_bare(tiny_model):
    """Only the layers that narrow attention wrap it: a dense engine's decode and prefill run
    no selector code."""
    dense = LLM(tiny_model, device="cpu").engine.runner.attention
    assert isinstance(dense.backend, NativeBackend) and dense.selecting is dense.backend
    pruned = LLM(tiny_model, device="cpu", control=ControlConfig(pruning=True))
    selecting = pruned.engine.runner.attention.selecting
    assert isinstance(selecting, PrunedDecode) and isinstance(selecting.inner, NativeBackend)
    sparse = LLM(tiny_model, device="cpu", control=ControlConfig(sparse_prefill=True))
    selecting = sparse.engine.runner.attention.selecting
    assert isinstance(selecting, SparsePrefill) and isinstance(selecting.inner, NativeBackend)
