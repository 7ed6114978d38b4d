"""``etinfer bench perplexity``: etinfer's perplexity on the shipped text, from prompt
logprobs, equals transformers' on float32 weights, and the command writes its result."""

import json

import pytest

from etinfer.bench.quality.perplexity import (
    etinfer_nll,
    perplexity,
    transformers_nll,
    windows_of,
)
from etinfer.cli import main


def test_float32_perplexity_equals_transformers(loaded_model, hf_reference):
    windows = windows_of(loaded_model, 96, 3)
    assert len(windows) == 3 and all(len(w) == 96 for w in windows)
    ours = etinfer_nll(loaded_model, "none", windows)
    theirs = transformers_nll(hf_reference, windows)
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert 1 < perplexity(ours, windows) < 100


def test_the_command_records_every_engine(tmp_path, capsys):
    result = tmp_path / "perplexity.json"
    argv = ["bench", "perplexity", "--windows", "1", "--window", "48", "--modes", "auto", "none"]
    assert main([*argv, "--no-transformers", "--result", str(result)]) == 0
    figures = json.loads(result.read_text())["figures"]
    engines = {f["labels"]["engine"] for f in figures}
    assert engines == {"etinfer auto", "etinfer none"}
    assert all(1 < f["value"] < 1000 for f in figures)
    assert "| etinfer none |" in capsys.readouterr().out
