"""What the commands and benchmarks share: engine options generated from ``EngineConfig``, the
percentile helper, and the in-process request driver (its clocks on random weights, what it
runs on the real model)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from etinfer import LLM, ControlConfig, SamplingParams, options
from etinfer.bench.common.driver import Request, RequestRecord, drive_engine
from etinfer.bench.common.stats import percentile, summary
from etinfer.bench.speed.quantization_figures import fidelity_figures
from etinfer.config import EngineConfig
from tests.conftest import cpu_only


def parse(argv: list[str], **choices) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    options.add_engine_options(parser, **choices)
    return parser.parse_args(argv)


def test_every_engine_field_is_a_flag_with_its_default():
    parser = argparse.ArgumentParser()
    options.add_engine_options(parser)
    text, args, default = parser.format_help(), parser.parse_args([]), EngineConfig()
    for field in dataclasses.fields(EngineConfig):
        assert "--" + field.name.replace("_", "-") in text
        if field.name not in ("control", "model"):
            assert getattr(args, field.name) == getattr(default, field.name), field.name
    assert args.control == "baseline"
    assert EngineConfig(model=args.model, **options.engine_kwargs(args)) == default


def test_a_command_line_builds_the_engine_config_it_says():
    argv = "--model m.gguf --dtype bfloat16 --max-model-len 512 --num-kvcache-blocks 9 "
    argv += "--kv-cache-gib 0.5 --no-enable-prefix-caching --control full --seed 3"
    args = parse(argv.split())
    assert EngineConfig(model=args.model, **options.engine_kwargs(args)) == EngineConfig(
        model="m.gguf",
        dtype="bfloat16",
        max_model_len=512,
        num_kvcache_blocks=9,
        kv_cache_gib=0.5,
        enable_prefix_caching=False,
        control=ControlConfig.full(),
        seed=3,
    )
    # The flags another command is given say the same.
    again = parse(options.engine_flags(args))
    assert options.engine_kwargs(again) == options.engine_kwargs(args)


def test_a_command_picks_its_options_defaults_and_aliases():
    args = parse(
        ["--kv-blocks", "7"],
        exclude=("seed", "control"),
        defaults={"max_num_seqs": 16},
        aliases={"num_kvcache_blocks": "--kv-blocks"},
    )
    kwargs = options.engine_kwargs(args)
    assert kwargs["num_kvcache_blocks"] == 7 and kwargs["max_num_seqs"] == 16
    assert "seed" not in kwargs and "control" not in kwargs and "model" not in kwargs
    only = parse(["--block-size", "32"], only=("block_size", "max_num_seqs"))
    assert options.engine_kwargs(only) == {"block_size": 32, "max_num_seqs": 64}
    with pytest.raises(SystemExit):
        parse(["--seed", "1"], exclude=("seed",))


def test_percentiles_interpolate_linearly_as_numpy_does():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile(list(range(1, 11)), 99) == pytest.approx(9.91)  # 9 + 0.91 of the gap
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 99) is None
    assert summary([1.0, 2.0, 3.0], 1000) == pytest.approx(
        {"mean": 2000.0, "median": 2000.0, "p99": 2980.0}
    )
    assert summary([]) == {"mean": None, "median": None, "p99": None}


def test_a_record_knows_its_time_per_output_token():
    assert RequestRecord(output_tokens=11, ttft=1.0, e2e=2.0).tpot == pytest.approx(0.1)
    assert RequestRecord(output_tokens=1, ttft=1.0, e2e=2.0).tpot is None
    assert not RequestRecord(error="refused").ok


def params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_the_cpu_clock_advances_by_step_cpu_time_and_skips_idle_gaps(tiny_model):
    engine = LLM(tiny_model, max_num_seqs=4, max_model_len=64).engine
    requests = [
        Request(0.0, [5, 6, 7], params(4)),
        Request(0.0, list(range(1, 100)), params(4)),  # longer than max_model_len: refused
        Request(1000.0, [8, 9], params(3)),
    ]
    steps = []
    with engine.observing(steps.append):
        run = drive_engine(engine, requests, "cpu")
    assert run.cpu == pytest.approx(sum(s.cpu_time for s in steps))
    assert run.outputs[1] is None and "max_model_len" in run.records[1].error
    assert [r.ok for r in run.records] == [True, False, True]
    assert [len(o.token_ids) for o in (run.outputs[0], run.outputs[2])] == [4, 3]
    late = run.records[2]
    assert late.queue_time == 0.0 and 0 < late.ttft <= late.e2e  # idle until it came
    assert run.makespan == pytest.approx(1000.0 + late.e2e)
    assert run.wall < 100


@pytest.mark.parametrize("clock", ["cpu", "wall"])
def test_a_closed_loop_keeps_that_many_requests_running(tiny_model, clock):
    """Arrival times are ignored: a request arrives when one of the two before it ends."""
    engine = LLM(tiny_model, max_num_seqs=8).engine
    requests = [Request(1000.0 * i, [5 + i, 6], params(3 + i % 3)) for i in range(7)]
    steps = []
    with engine.observing(steps.append):
        run = drive_engine(engine, requests, clock, concurrency=2)
    assert all(r.ok for r in run.records) and max(len(s.num_tokens) for s in steps) == 2
    assert run.makespan < 100  # not the 6,000 s the arrival times would have taken
    assert all(r.queue_time < 0.5 for r in run.records)  # each scheduled as it arrived
    with pytest.raises(ValueError, match="concurrency"):
        drive_engine(engine, requests, clock, concurrency=0)


def test_the_wall_clock_tells_the_engine_the_nominal_arrival(tiny_model):
    engine = LLM(tiny_model, max_num_seqs=4).engine
    run = drive_engine(engine, [Request(0.0, [5, 6], params(3)), Request(0.2, [7], params(3))])
    late, metrics = run.records[1], run.outputs[1].metrics
    assert run.makespan >= 0.2 + late.e2e
    # The engine's own figures count from the same arrival, to a step's end.
    assert late.e2e == pytest.approx(metrics.total_time, abs=0.05)
    assert late.ttft == pytest.approx(metrics.time_to_first_token, abs=0.05)


def test_the_driver_runs_forced_tokens_and_chat_text_on_the_real_model(make_llm):
    llm = make_llm(max_num_seqs=4)
    forced = llm.tokenizer.encode(" The answer is")
    chat = Request(0.0, "Name a colour.", params(6))
    run = drive_engine(llm.engine, [Request(0.0, [1, 504, 3458], params(8), forced), chat])
    assert run.outputs[0].token_ids[: len(forced)] == forced
    assert len(run.outputs[0].token_ids) == 8
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": "Name a colour."}])
    assert run.outputs[1].prompt_token_ids == prompt
    alone = drive_engine(llm.engine, [chat], "cpu").outputs[0]
    assert alone.token_ids == llm.generate([prompt], params(6))[0].token_ids


def test_the_kernel_candidates_compute_the_same_product():
    """Every candidate of `bench kernels` multiplies the same shapes; the float ones agree."""
    import torch

    from etinfer.bench.speed.kernels import candidates, step_shapes

    assert step_shapes(None)[0] == (960, 576, 30) and step_shapes(None)[-1] == (49152, 576, 1)
    torch.manual_seed(0)
    outputs = {name: fn() for name, fn in candidates(64, 96, 3).items()}
    assert all(out.shape == (3, 64) for out in outputs.values())
    torch.testing.assert_close(outputs["f32 oneDNN packed"], outputs["f32 F.linear"])


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="reads Linux's /proc")
@cpu_only  # the resident memory of the CPU's weight formats
@pytest.mark.model
def test_the_memory_bench_reports_each_mode_against_file_and_cache(capsys, tmp_path):
    """`etinfer bench memory` end to end on the default file, one mode in its own process: the
    resident set grows from load to steady state, over at least the file and the written pool,
    and none of the file's pages stays resident beside the prepared weights."""
    from etinfer.bench.common.results import Result
    from etinfer.cli import main

    argv = ["bench", "memory", "--modes", "gguf", "--steady-tokens", "16"]
    assert main([*argv, "--result", str(tmp_path / "memory.json")]) == 0
    out = capsys.readouterr().out
    figures = json.loads(out.split("gguf: ", 1)[1].splitlines()[0])
    after, budget = figures["after"], figures["file_mib"] + figures["kv_mib"]
    assert figures["kv_mib"] > 0 and figures["file_mib"] > 90
    assert budget < after["loaded"] <= after["steady"] < 2 * budget
    assert figures["file_pages_mib"] == 0
    assert "| gguf |" in out
    result = Result.read(tmp_path / "memory.json")
    assert result.details["modes"]["gguf"] == figures
    steady = [f for f in result.figures if f.labels.get("point") == "steady"]
    assert {f.unit for f in steady} == {"MiB", "x"}
    assert all(f.labels["mode"] == "gguf" and f.labels["model_mib"] > 90 for f in steady)


@pytest.mark.parametrize(
    ("argv", "field", "limit"),
    [
        (["--steps", "2"], "--steps", "at least 18"),
        (["--lengths", "512", "1024"], "--lengths", "min_context of 1024"),
    ],
)
def test_the_longcontext_bench_refuses_what_it_cannot_measure(argv, field, limit):
    """Before any model is read: too few forced steps to read fidelity after compression, and
    prompts too short for sparse prefill's attention profile, the head types' input (they
    crashed the run at its end)."""
    from studies.__main__ import build_parser
    from studies.seed_systems import longcontext

    args = build_parser().parse_args(["longcontext", "--output-dir", "unused", *argv])
    with pytest.raises(SystemExit) as refused:
        longcontext.run(args)
    assert field in str(refused.value) and limit in str(refused.value)


@pytest.mark.parametrize(
    ("command", "flag"),
    [
        ("speed", "--steps"),  # an empty median at the end of the run
        ("step-profile", "--steps"),  # a division by zero
        ("kv-cache", "--fidelity-texts"),  # an empty median
        ("pruning", "--batches"),
        ("ablation", "--repeats"),
        ("longcontext", "--lengths"),
    ],
)
def test_a_zero_count_is_refused_naming_its_flag(command, flag, capsys):
    from etinfer.bench import STUDIES
    from etinfer.cli import build_parser
    from studies.__main__ import build_parser as study_parser

    argv = [command, flag, "0"]
    with pytest.raises(SystemExit) as refused:
        if command in STUDIES:
            study_parser().parse_args(argv)
        else:
            build_parser().parse_args(["bench", *argv])
    assert refused.value.code == 2
    assert f"argument {flag}: must be at least 1, got 0" in capsys.readouterr().err
    assert options.positive_int("3") == 3


def test_agreement_is_reported_for_the_prefill_and_for_rows_computed_alone():
    """A prefill's many rows may take a float32 GEMM, a decode step computes each row alone:
    the quantization benchmark reports top-1 and KL against float32 for both."""
    result = {"top1_agreement": 1.0, "kl_mean": 1e-4}
    result |= {"rows_alone_top1": 0.94, "rows_alone_kl": 0.01}
    figures = fidelity_figures(result, {"engine": "e"})
    found = {(f.subject, f.labels.get("path")): f.value for f in figures}
    assert found[("top-1 agreement", None)] == 100.0
    assert found[("top-1 agreement", "rows alone")] == 94.0
    assert found[("kl", "rows alone")] == 0.01
