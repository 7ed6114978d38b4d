"""The command line, run as a user runs it: a separate process on the default model."""

import subprocess
import sys

import pytest

from etinfer.cli import main, sparkline


def etinfer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "etinfer.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_streams_text_then_entropy_and_summary():
    result = etinfer(
        "generate", "--temperature", "0", "--max-tokens", "12", "The capital of France is"
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(" Paris")
    assert lines[-2].startswith("entropy (nats, per token) ")
    assert len(lines[-2].split()[-1]) == len(lines[-2].split()[-1]) and "tok/s" in lines[-1]
    assert "mean entropy" in lines[-1] and "time to first token" in lines[-1]


def test_generate_many_prompts_from_a_file(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Name a colour.\n\nName a fruit.\n")
    result = etinfer("generate", "--chat", "--prompts-file", str(prompts), "--max-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("--- [") == 2
    assert "2 requests" in result.stdout.splitlines()[-1]


def test_bad_arguments_exit_with_a_message(capsys):
    assert main(["generate", "--temperature", "-1", "hi"]) == 2
    assert "temperature must be in [0, inf]" in capsys.readouterr().err
    assert main(["generate"]) == 2


@pytest.mark.parametrize(
    ("values", "expected"), [([0.0, 1.0, 2.0], "▁▅█"), ([0.0, 0.0], ""), ([3.0], "█")]
)
def test_sparkline_scales_to_the_ceiling(values, expected):
    assert sparkline(values, max(values)) == expected
