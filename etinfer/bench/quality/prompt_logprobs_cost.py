"""What prompt log-probabilities cost a prefill, against the output head's own arithmetic over the
prompt's rows: the least any engine can spend to score a prompt.

    etinfer bench prompt-logprobs [--model gemma-3-270m] [--prompt-len 1024]

One prompt of ``--prompt-len`` tokens of the shipped text, prefilled in one step: without
``prompt_logprobs``, with 1 (what lm-evaluation-harness asks) and with 5, interleaved over
``--repeats`` rounds (medians); and the engine's output head alone over as many rows, in the
chunks the scoring takes them. The figure to read is the extra time over the head's: 1.0x
would be scoring for the price of the head.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from etinfer.bench.common.machine import cpu_flags
from etinfer.bench.common.results import Figure, add_result_option, model_labels, recorded
from etinfer.corpus import corpus_windows
from etinfer.engine.sampling.prompt_logprobs import ROWS_AT_ONCE
from etinfer.model.catalog import resolve
from etinfer.model.loader import load_model
from etinfer.options import positive_int

COUNTS = (None, 1, 5)


def run(args: argparse.Namespace) -> tuple[list[Figure], dict]:
    from etinfer import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    prompt = next(corpus_windows(loaded.tokenizer, args.prompt_len))
    size = args.prompt_len
    llm = LLM(
        loaded, max_model_len=size + 8, max_num_batched_tokens=size, enable_prefix_caching=False
    )
    model = llm.engine.runner.model
    rows = torch.randn(size, model.config.hidden_size)

    def prefill(count: int | None) -> float:
        params = SamplingParams(max_tokens=1, prompt_logprobs=count)
        start = time.perf_counter()
        llm.generate([prompt], params)
        return time.perf_counter() - start

    def head() -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            for at in range(0, size, ROWS_AT_ONCE):
                model.compute_logits(rows[at : at + ROWS_AT_ONCE])
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"head": []} | {str(c): [] for c in COUNTS}
    prefill(1)  # warm: kernels built, buffers sized
    head()
    for _ in range(args.repeats):
        for count in COUNTS:
            times[str(count)].append(prefill(count))
        times["head"].append(head())
    median = {name: statistics.median(values) for name, values in times.items()}
    plain, head_s = median["None"], median["head"]
    labels = model_labels(resolve(args.model)) | {"prompt": size}
    figures = [Figure("prefill", plain * 1000, "ms", labels | {"prompt_logprobs": "off"})]
    figures.append(Figure("output head over the prompt", head_s * 1000, "ms", labels))
    print(f"\n{size}-token prompt, {args.threads} threads, CPU flags: {cpu_flags()}")
    print(
        f"prefill alone {plain * 1000:.1f} ms; "
        f"the output head over {size} rows {head_s * 1000:.1f} ms"
    )
    print("| prompt_logprobs | prefill (ms) | over prefill alone | extra over the head |")
    print("|---:|---:|---:|---:|")
    for count in COUNTS[1:]:
        spent = median[str(count)]
        extra = (spent - plain) / head_s
        print(f"| {count} | {spent * 1000:.1f} | {spent / plain:.3f}x | {extra:.3f}x |")
        with_count = labels | {"prompt_logprobs": count}
        figures.append(Figure("prefill", spent * 1000, "ms", with_count))
        figures.append(Figure("prefill", spent / plain, "x", with_count | {"vs": "off"}))
        figures.append(Figure("prompt logprobs extra", extra, "x", with_count | {"vs": "head"}))
    report = {"threads": args.threads, "repeats": args.repeats, "median_s": median}
    return figures, report


def add_command(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser(
        "prompt-logprobs", help="prompt log-probabilities' cost against the output head's"
    )
    parser.add_argument("--model", help="a .gguf file, a folder or an installed model's name")
    parser.add_argument("--prompt-len", type=positive_int, default=1024)
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--threads", type=positive_int, default=2)
    add_result_option(parser)
    parser.set_defaults(func=recorded("prompt-logprobs", run))
