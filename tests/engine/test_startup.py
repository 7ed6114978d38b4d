"""The engine's start-up line names how its weights multiply, its cache and its CPU."""

import logging
import subprocess
import sys

import pytest

from etinfer import LLM
from etinfer.model import quant_kernels


@pytest.mark.skipif(not quant_kernels.available(), reason="etinfer's block kernels are not built")
def test_the_start_up_line_names_each_weight_form_and_the_cache(caplog):
    with caplog.at_level(logging.INFO, logger="etinfer"):
        LLM(quantization="gguf", num_kvcache_blocks=24)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("etinfer:"))
    assert "SmolLM2-135M-Instruct.Q4_1.gguf, 30 layers on cpu (" in line
    # 30 layers of four matrices in Q4_1, and the head (the tied embedding) in Q8_0
    assert "120 x Q4_1 blocks on etinfer's kernels (8-bit activations)" in line
    assert "1 x Q8_0 blocks on etinfer's kernels (8-bit activations)" in line
    assert line.endswith("24 blocks of 16 tokens; decode steps in one native call")


def test_the_start_up_line_says_when_decode_steps_go_layer_by_layer(caplog):
    with caplog.at_level(logging.INFO, logger="etinfer"):
        LLM(quantization="none", num_kvcache_blocks=24)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("etinfer:"))
    assert line.endswith("24 blocks of 16 tokens; decode steps layer by layer")


def test_the_command_line_shows_the_start_up_line():
    done = subprocess.run(
        [sys.executable, "-m", "etinfer", "generate", "Hi", "--max-tokens", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "etinfer: SmolLM2-135M-Instruct.Q4_1.gguf, 30 layers on cpu" in done.stderr
