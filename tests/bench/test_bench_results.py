"""One JSON result per run, in one schema: it reads back as written, refuses another schema
version, goes where ``--result`` says or under ``results/<benchmark>/``, and every command of
``etinfer bench`` and ``python -m studies`` writes one (``etinfer bench step-profile`` end to end
at a toy size)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from etinfer.bench import STUDIES
from etinfer.bench.common.results import (
    SCHEMA,
    Figure,
    Host,
    Result,
    new_result,
    recorded,
    write_result,
)
from etinfer.cli import build_parser, main
from studies.__main__ import build_parser as study_parser

ENGINE_BENCHMARKS = (
    "speed", "step-profile", "kernels", "prefill-attention", "quantization", "kv-cache", "memory",
    "serving", "serving-sweep", "server", "abuse", "structured",
)  # fmt: skip
# Flags a command cannot parse without.
REQUIRED = {"ablation": ["--output", "out"], "stress": ["--output", "out"]}


def a_result() -> Result:
    figures = [
        Figure("decode", 123.4, "tok/s", {"engine": "etinfer", "batch": 16, "held": False}),
        Figure("decode", 1.25, "x", {"engine": "etinfer", "vs": "llama.cpp"}, {"sd": 0.02}, 3),
        Figure("latency", 0.5, "s", {"arm": "full"}, {"min": 0.4, "max": 0.6}, 2),
        Figure("quality", 0.98, "", {"arm": "full"}, {"ci95": [0.95, 1.01]}, 24),
    ]
    details = {"rows": [{"batch": 16, "tok_s": 123.4}], "threads": 2, "device": "cpu"}
    return new_result("speed", figures, details, argv=["bench", "speed"])


def test_a_result_reads_back_as_it_was_written(tmp_path):
    result = a_result()
    assert Result.from_dict(json.loads(result.to_json())) == result
    assert Result.read(write_result(result, tmp_path / "speed.json")) == result
    assert result.schema == SCHEMA and result.provenance is None
    assert result.command == "etinfer bench speed"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", result.date)
    assert result.host.device == "cpu" and result.host.kind in ("AVX-512", "AVX2", "AVX2 (held)")


def test_another_schema_version_is_refused_naming_the_field():
    data = json.loads(a_result().to_json())
    for version in (SCHEMA + 1, None):
        data["schema"] = version
        with pytest.raises(ValueError, match=f"'schema' must be {SCHEMA}, got {version!r}"):
            Result.from_dict(data)


def test_the_host_kind_is_what_a_reader_compares_across():
    host = Host("cpu", "avx2 avx512f", 32.0, 8, None, "2", "cpu", "3.11")
    assert host.kind == "AVX-512"
    assert Host("cpu", "avx2 avx512f", 32.0, 8, "avx2", "2", "cpu", "3.11").kind == "AVX2 (held)"
    assert Host("cpu", "avx2", 32.0, 8, None, "2", "cpu", "3.11").kind == "AVX2"
    assert Host("cpu", "avx2", 32.0, 8, None, "2", "NVIDIA H100", "3.11").kind == "NVIDIA H100"


def test_a_run_goes_under_results_by_default_and_where_result_says(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    figures = [Figure("decode", 10.0, "tok/s")]
    command = recorded("speed", lambda args: (figures, {"threads": 2}))
    assert command(argparse.Namespace(result=None)) == 0
    (written,) = (tmp_path / "results" / "speed").iterdir()
    result = Result.read(written)
    assert written.name == f"{result.date.replace(':', '').replace('-', '')}-{result.commit}.json"
    assert result.figures == figures and result.details == {"threads": 2}
    assert f"result: {Path('results', 'speed', written.name)}" in capsys.readouterr().out
    chosen = tmp_path / "elsewhere" / "run.json"
    assert command(argparse.Namespace(result=str(chosen))) == 0
    assert Result.read(chosen).benchmark == "speed"


def test_every_command_takes_the_result_option_and_records_its_run():
    for name in ENGINE_BENCHMARKS:
        args = build_parser().parse_args(["bench", name, "--result", "r.json"])
        assert args.result == "r.json" and callable(args.func), name
    for name in STUDIES:
        args = study_parser().parse_args([name, "--result", "r.json", *REQUIRED.get(name, [])])
        assert args.result == "r.json" and callable(args.func), name


@pytest.mark.model
def test_step_profile_writes_its_figures_as_a_result(tmp_path):
    path = tmp_path / "profile.json"
    argv = ["bench", "step-profile", "--batch", "2", "--warmup", "3", "--steps", "2"]
    assert main([*argv, "--rows", "3", "--num-kvcache-blocks", "64", "--result", str(path)]) == 0
    result = Result.read(path)
    assert result.benchmark == "step-profile" and result.provenance is None
    assert {f.subject for f in result.figures} == {
        "host time a step",
        "device time a step",
        "kernel launches a step",
        "host-device copies a step",
        "host syncs a step",
        "scalar reads a step",
    }
    assert all(f.labels == {"batch": 2} and f.n == 2 for f in result.figures)
    host_ms = next(f for f in result.figures if f.subject == "host time a step")
    assert host_ms.unit == "ms" and host_ms.value == result.details["per_step"]["host ms a step"]
    assert result.details["device"] == "cpu" or result.host.device != "cpu"
