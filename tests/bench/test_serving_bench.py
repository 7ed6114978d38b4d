"""The serving workload generator, trace replay, metrics, the server driver (against a stub
server) and one end-to-end run of ``etinfer bench serving`` on the real model."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import numpy as np
import pytest

from etinfer.bench.common import workload
from etinfer.bench.common.driver import Request, RequestRecord, drive_server
from etinfer.bench.common.results import Result
from etinfer.bench.common.serving_metrics import METRICS, summarize
from etinfer.bench.common.workload import TextPrompts, WorkloadRequest
from etinfer.bench.serving import serving
from etinfer.bench.serving.serving_sweep import saturated_capacity
from etinfer.control.scheduling import SchedulingConfig
from etinfer.sampling_params import SamplingParams


def lengths(requests, field):
    return np.array([getattr(r, field) for r in requests])


def test_same_seed_same_workload_other_seed_another():
    a = workload.generate("mixed", 50, 2.0, seed=3)
    assert a == workload.generate("mixed", 50, 2.0, seed=3)
    assert a != workload.generate("mixed", 50, 2.0, seed=4)


def test_lengths_match_the_sharegpt_quantiles():
    requests = workload.generate("sharegpt", 20_000, 1.0, seed=0)
    prompts, outputs = lengths(requests, "prompt_tokens"), lengths(requests, "output_tokens")
    for values, anchors in ((prompts, (33, 345, 906)), (outputs, (292, 630, 945))):
        measured = np.percentile(values, (50, 90, 99))
        np.testing.assert_allclose(measured, anchors, rtol=0.06)


def test_poisson_gaps_have_the_rate_and_burstiness_shapes_them():
    poisson = np.diff(lengths(workload.generate("sharegpt", 20_000, 4.0, seed=1), "arrival_s"))
    assert poisson.mean() == pytest.approx(0.25, rel=0.03)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)  # exponential
    smooth = workload.generate("sharegpt", 20_000, 4.0, seed=1, burstiness=4.0)
    gaps = np.diff(lengths(smooth, "arrival_s"))
    assert gaps.std() / gaps.mean() == pytest.approx(0.5, rel=0.05)  # gamma, shape 4
    assert lengths(workload.generate("sharegpt", 5, float("inf"), seed=1), "arrival_s").max() == 0


def test_long_and_mixed_workloads_and_length_controls():
    long = lengths(workload.generate("long", 2000, 1.0, seed=2), "prompt_tokens")
    assert long.min() >= 1024 and long.max() <= 6144
    mixed = lengths(workload.generate("mixed", 5000, 1.0, seed=2), "prompt_tokens")
    assert np.mean(mixed >= 1024) == pytest.approx(workload.LONG_SHARE, abs=0.03)
    capped = workload.generate(
        "sharegpt", 2000, 1.0, seed=2, length_scale=0.5, max_prompt_tokens=64, max_output_tokens=8
    )
    assert lengths(capped, "prompt_tokens").max() == 64
    assert set(lengths(capped, "output_tokens")) <= set(range(1, 9))
    with pytest.raises(ValueError, match="workload must be one of"):
        workload.generate("chat", 5, 1.0, seed=0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rate": 0.0}, r"request_rate must be in \(0, inf\], got 0"),  # was a ZeroDivisionError
        ({"rate": -math.inf}, "request_rate must be a finite number"),
        ({"rate": math.nan}, "request_rate must be a finite number"),
        ({"num_requests": 0}, r"num_requests must be in \[1, inf\], got 0"),
        ({"burstiness": 0.0}, r"burstiness must be in \(0, inf\]"),
        ({"length_scale": -1.0}, r"length_scale must be in \(0, inf\]"),
        ({"max_output_tokens": 0}, r"max_output_tokens must be in \[1, inf\]"),
    ],
)
def test_a_workload_out_of_range_is_refused_naming_the_field(change, message):
    arguments = {"kind": "sharegpt", "num_requests": 5, "rate": 1.0, "seed": 0} | change
    with pytest.raises(ValueError, match=message):
        workload.generate(**arguments)


def test_trace_round_trips_and_is_sorted_on_read(tmp_path):
    requests = workload.generate("sharegpt", 20, 3.0, seed=5)
    path = tmp_path / "trace.csv"
    workload.write_trace(path, requests)
    replayed = workload.read_trace(path)
    assert [r.prompt_tokens for r in replayed] == [r.prompt_tokens for r in requests]
    np.testing.assert_allclose(lengths(replayed, "arrival_s"), lengths(requests, "arrival_s"))
    path.write_text("prompt_tokens,arrival_s,output_tokens\n12,2.5,7\n30,0.5,9\n")
    assert workload.read_trace(path) == [WorkloadRequest(0.5, 30, 9), WorkloadRequest(2.5, 12, 7)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("arrival_s,prompt_tokens\n0,5\n", "lacks the column"),
        ("arrival_s,prompt_tokens,output_tokens\n0,five,3\n", "line 2"),
        ("arrival_s,prompt_tokens,output_tokens\n0,5,0\n", "line 2: need"),
    ],
)
def test_bad_traces_are_refused_with_the_line(tmp_path, text, message):
    path = tmp_path / "trace.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        workload.read_trace(path)


def test_text_prompts_are_real_text_of_exact_lengths(loaded_model):
    texts = TextPrompts(loaded_model.tokenizer)
    prompts = texts.take([5, 300, 17], seed=1)
    assert [len(p) for p in prompts] == [5, 300, 17]
    assert prompts == texts.take([5, 300, 17], seed=1)
    assert prompts != texts.take([5, 300, 17], seed=2)
    assert " the " in loaded_model.tokenizer.decode(prompts[1])


def test_summary_figures():
    records = [
        RequestRecord(output_tokens=11, ttft=1.0, e2e=2.0, queue_time=0.5),
        RequestRecord(output_tokens=11, ttft=3.0, e2e=5.0, queue_time=2.5),
        RequestRecord(error="refused"),
    ]
    s = summarize(records, 10.0, preemptions=2, recomputed_tokens=40)
    assert set(METRICS) <= set(s)
    assert (s["num_requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["request_throughput"] == pytest.approx(0.2)
    assert s["output_throughput"] == pytest.approx(2.2)
    assert s["ttft_mean"] == pytest.approx(2.0) and s["e2e_p50"] == pytest.approx(3.5)
    assert s["tpot_mean"] == pytest.approx((0.1 + 0.2) / 2)
    assert s["max_queue_time"] == 2.5
    # Output rates 5.5 and 2.2 tokens/s: Jain's index (a+b)^2 / (2 (a^2+b^2)).
    assert s["jain_fairness"] == pytest.approx(7.7**2 / (2 * (5.5**2 + 2.2**2)))


def test_capacity_counts_completions_while_saturated():
    # Everything arrived at 0; the last admission was at 4 s, by when 3 had finished.
    records = [
        {"queue_time": 0.0, "e2e": 1.0},
        {"queue_time": 0.0, "e2e": 3.0},
        {"queue_time": 1.0, "e2e": 4.0},
        {"queue_time": 4.0, "e2e": 9.0},
    ]
    assert saturated_capacity({"requests": records}) == pytest.approx(3 / 4)


def test_scheduling_overrides_reach_the_entropy_policy_only():
    parser = argparse.ArgumentParser()
    kinds = parser.add_subparsers()
    serving.add_command(kinds)
    args = parser.parse_args(
        ["serving", "--policy", "entropy", "--scheduling-config", '{"alpha": 0}']
    )
    config = serving.engine_kwargs(args)["control"].scheduling_config
    assert config.alpha == 0.0 and config.gamma == SchedulingConfig().gamma
    args = parser.parse_args(["serving", "--scheduling-config", '{"alpha": 0}'])
    with pytest.raises(ValueError, match="applies to --policy entropy only"):
        serving.engine_kwargs(args)


class StubServer(BaseHTTPRequestHandler):
    """Streams one chunk of text per requested token, then usage, as an OpenAI server does, for
    completions and chat completions."""

    bodies: ClassVar[dict[str, dict]] = {}

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies[self.path] = body
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chat = self.path.endswith("/chat/completions")
        choice = {"index": 0, **({"delta": {"content": "x"}} if chat else {"text": "x"})}
        n = body["max_tokens"]
        for chunk in [{"choices": [choice]}] * n + [{"choices": [], "usage": _usage(n)}]:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args) -> None:
        pass


def _usage(n: int) -> dict:
    return {"completion_tokens": n, "prompt_tokens": 1, "total_tokens": n + 1}


def test_server_driver_streams_completions_and_chat_from_a_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    requests = [
        Request(0.0, [1, 2, 3], params),
        Request(0.05, "Hello.", SamplingParams(temperature=0, max_tokens=6, top_k=5)),
    ]
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        records, duration = drive_server(url, requests, model="m")
        with pytest.raises(ValueError, match="forced tokens"):
            drive_server(url, [Request(0.0, [1], params, forced=[2])], model="m")
    finally:
        server.shutdown()
    assert [r.output_tokens for r in records] == [4, 6]
    assert all(r.ok and 0 < r.ttft <= r.e2e for r in records)
    assert [len(r.itl) for r in records] == [3, 5]
    assert duration >= 0.05
    completion, chat = (
        StubServer.bodies["/v1/completions"],
        StubServer.bodies["/v1/chat/completions"],
    )
    assert completion["prompt"] == [1, 2, 3] and completion["ignore_eos"] is True
    assert completion["temperature"] == 1.0 and completion["max_tokens"] == 4
    assert completion["stream"] and completion["stream_options"] == {"include_usage": True}
    assert chat["messages"] == [{"role": "user", "content": "Hello."}]
    assert chat["temperature"] == 0 and chat["top_k"] == 5 and "ignore_eos" not in chat


@pytest.mark.model
def test_bench_serving_end_to_end(tmp_path):
    """A few tiny requests on the real model through the command line, all at once under KV
    pressure (8 blocks of 16 tokens for 6 requests of up to 56 tokens), so that even with its
    admission reserve the policy has to preempt. The requests' records go to ``--output``, the
    figures to the run's result."""
    output, recorded = tmp_path / "requests.json", tmp_path / "result.json"
    # Passive OpenMP threads: on a machine whose cores other work shares, spinning threads wait
    # on each other and a step takes seconds instead of tens of milliseconds.
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    result = subprocess.run(
        [sys.executable, "-m", "etinfer.cli", "bench", "serving", "--policy", "entropy",
         "--num-requests", "6", "--request-rate", "inf", "--seed", "1",
         "--max-output-tokens", "40", "--max-prompt-tokens", "16",
         "--num-kvcache-blocks", "8", "--output", str(output), "--result", str(recorded)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    figures = json.loads(output.read_text())
    assert set(METRICS) <= set(figures)
    assert figures["completed"] == 6 and figures["failed"] == 0
    assert figures["preemptions"] > 0 and figures["recomputed_tokens"] > 0
    assert 0 < figures["ttft_p50"] <= figures["e2e_p50"]
    assert len(figures["requests"]) == 6
    assert "| e2e_mean |" in result.stdout
    run = Result.read(recorded)
    assert run.benchmark == "serving" and run.details["completed"] == 6
    assert "requests" not in run.details  # the records stay in --output
    throughput = [f for f in run.figures if f.subject == "throughput" and f.unit == "req/s"]
    assert [f.labels for f in throughput] == [{"arm": "entropy"}]
