"""What ``auto`` means for a model: by device, and on the CPU whether the block kernels run."""

import pytest
import torch
from gguf import GGMLQuantizationType

from etinfer.model import quant_kernels
from etinfer.model.quantized import GGUFBlocks, resolve_auto

CPU = torch.device("cpu")


def blocks_of(nbytes: int) -> dict[str, GGUFBlocks]:
    """One Q4_0 matrix of about ``nbytes`` (18-byte blocks of 32 weights)."""
    rows = max(1, nbytes // (18 * 64))
    data = torch.zeros(rows, 18 * 64, dtype=torch.uint8)
    return {"w": GGUFBlocks(GGMLQuantizationType.Q4_0, data, 32 * 64)}


def test_other_modes_are_themselves_and_auto_on_a_gpu_is_float():
    small = blocks_of(2**20)
    assert resolve_auto("int8", small, CPU) == "int8"
    assert resolve_auto("auto", small, torch.device("cuda")) == "none"


@pytest.mark.skipif(not quant_kernels.available(), reason="etinfer's block kernels are not built")
def test_auto_takes_the_block_kernels_for_blocks_of_any_size():
    assert resolve_auto("auto", blocks_of(2**20), CPU) == "gguf"
    assert resolve_auto("auto", blocks_of(2**28), CPU) == "gguf"
    assert resolve_auto("auto", {"w": torch.zeros(4, 4)}, CPU) == "auto"  # float weights
