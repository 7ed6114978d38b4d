"""The command line, run as a user runs it: a separate process on the default model."""

import subprocess
import sys
from pathlib import Path

import pytest

from etinfer import ControlConfig, options
from etinfer.cli import build_parser, main, sparkline
from etinfer.config import EngineConfig
from studies.__main__ import build_parser as study_parser


def etinfer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "etinfer.cli", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.model
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


@pytest.mark.model
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


def test_commands_share_the_engine_options():
    parser = build_parser()
    serve = parser.parse_args(
        ["serve", "--control", "full", "--max-num-seqs", "8", "--no-enable-prefix-caching"]
    )
    assert EngineConfig(model=serve.model, **options.engine_kwargs(serve)) == EngineConfig(
        control=ControlConfig.full(), max_num_seqs=8, enable_prefix_caching=False
    )
    generate = parser.parse_args(["generate", "--seed", "5", "--dtype", "float16", "hi"])
    assert generate.seed == 5 and "seed" not in options.engine_kwargs(generate)  # sampling's
    assert options.engine_kwargs(generate)["dtype"] == "float16"
    assert parser.parse_args(["bench", "serving"]).max_num_seqs == 16
    ablation = study_parser().parse_args(["ablation", "--output", "out", "--kv-blocks", "7"])
    assert ablation.num_kvcache_blocks == 7 and ablation.threads == 1


@pytest.mark.model
def test_step_profile_reports_a_decode_steps_work(capsys):
    from etinfer.bench.speed import step_profile

    args = build_parser().parse_args(
        ["bench", "step-profile", "--batch", "2", "--warmup", "3", "--steps", "2", "--rows", "3"]
    )
    args.num_kvcache_blocks = 64
    _, report = step_profile.run(args)
    figures = report["per_step"]
    assert figures["host ms a step"] > 0
    # Kernels are launched on a GPU only; on the CPU the operators run where they are called.
    on_cuda = EngineConfig(**options.engine_kwargs(args)).device_type() == "cuda"
    assert (figures["kernel launches a step"] > 0) == on_cuda
    # The CPU has no device to wait for; a step on CUDA waits once at least (its tokens).
    assert (figures["host syncs a step"] > 0) == on_cuda
    assert "batch 2, 2 decode steps" in capsys.readouterr().out


def test_models_are_listed_and_taken_by_name(capsys):
    assert main(["models"]) == 0
    listing = capsys.readouterr().out
    assert "smollm2-135m-instruct" in listing and "gemma-3-270m" in listing
    assert main(["generate", "--model", "no-such-model", "hi"]) == 2
    error = capsys.readouterr().err
    assert "'no-such-model' is neither a file or folder nor a model name" in error
    assert "smollm2-135m-instruct" in error  # the names, and which are installed


def test_a_model_not_installed_says_how_to_install_it(monkeypatch):
    from etinfer.model import catalog
    from etinfer.model.loader import load_model

    missing = catalog.ModelPackage(
        "tiny-missing", "a model", "no_such_package_xyz", "pip install no-such-package", Path
    )
    monkeypatch.setitem(catalog.CATALOG, "tiny-missing", missing)
    with pytest.raises(ValueError, match=r"'tiny-missing' is not installed: run `pip install no-"):
        load_model("tiny-missing")


def test_a_study_asked_of_etinfer_bench_says_where_it_went(capsys):
    """The paper's studies left the runtime package: ``etinfer bench ablation`` names the command
    that runs it now, and ``python -m etinfer`` is the ``etinfer`` script."""
    assert main(["bench", "ablation", "--quick", "--output", "x"]) == 2
    assert "python -m studies ablation" in capsys.readouterr().err
    done = subprocess.run(
        [sys.executable, "-m", "etinfer", "models"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "smollm2-135m-instruct" in done.stdout
