"""Perplexity on shipped human text, by etinfer in each weight mode, by transformers (float32,
the reference) and by llama.cpp where it runs, on the same token windows.

    etinfer bench perplexity [--modes auto none] [--llama-cpp-python PY]

The text is the corpus every installation carries (``etinfer.corpus``: CPython's Python
Language Reference topics), cut into ``--windows`` windows of ``--window`` tokens. Each window
is scored teacher-forced from its first token: every later token's log-probability given the
tokens before it in the window (etinfer through ``prompt_logprobs``, the prefill's own rows).
The perplexity is exp of the mean negative log-likelihood over all scored tokens, as
llama.cpp's ``perplexity`` tool and transformers' recipe compute it (here without a stride:
windows do not overlap, so a window's first tokens see little context, the same for every
engine). On float32 weights (``none``) etinfer's figure equals transformers' to float32's
rounding; the quantized modes show what their arithmetic costs in perplexity.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch

from etinfer.bench.common.child import child_figures
from etinfer.bench.common.machine import cpu_flags
from etinfer.bench.common.results import Figure, add_result_option, model_labels, recorded
from etinfer.corpus import CORPUS, corpus_windows
from etinfer.model.catalog import resolve
from etinfer.model.loader import LoadedModel, load_model
from etinfer.options import positive_int

# llama.cpp's side, run by the Python --llama-cpp-python names: each window evaluated with
# every row's logits kept, the windows' negative log-likelihoods printed as one JSON line.
LLAMA_CPP_NLL = """
import json, sys, numpy
from llama_cpp import Llama
path, windows_path, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
windows = json.load(open(windows_path))
size = max(map(len, windows))
llm = Llama(model_path=path, n_ctx=size, n_batch=size, n_ubatch=size, n_threads=threads,
            n_threads_batch=threads, logits_all=True, verbose=False)
nll = []
for window in windows:
    llm.reset(); llm.eval(window)
    scores = numpy.array(llm.scores[: len(window) - 1], dtype=numpy.float64)
    top = scores.max(-1, keepdims=True)
    log_z = (top + numpy.log(numpy.exp(scores - top).sum(-1, keepdims=True)))[:, 0]
    nll.append(float((log_z - scores[numpy.arange(len(window) - 1), window[1:]]).sum()))
print(json.dumps({"nll": nll}))
"""


def windows_of(loaded: LoadedModel, window: int, count: int) -> list[list[int]]:
    windows = list(corpus_windows(loaded.tokenizer, window))[:count]
    if len(windows) < count:
        raise SystemExit(f"error: the corpus holds {len(windows)} windows of {window} tokens")
    return windows


def etinfer_nll(loaded: LoadedModel, mode: str, windows: list[list[int]]) -> list[float]:
    """Each window's summed negative log-likelihood, from the prefill's prompt logprobs."""
    from etinfer import LLM, SamplingParams

    floats = {"dtype": "float32", "kv_cache_dtype": "float32"} if mode == "none" else {}
    size = max(map(len, windows))
    llm = LLM(loaded, quantization=mode, max_model_len=size + 1, **floats)
    outs = llm.generate(windows, SamplingParams(max_tokens=1, prompt_logprobs=0))
    return [
        -sum(
            entry[token].logprob
            for token, entry in zip(w[1:], out.prompt_logprobs[1:], strict=True)
        )
        for w, out in zip(windows, outs, strict=True)
    ]


def transformers_nll(reference, windows: list[list[int]]) -> list[float]:
    """The same from transformers' model (``reference``)."""
    found = []
    with torch.no_grad():
        for window in windows:
            scores = reference(torch.tensor([window])).logits[0, :-1].double().log_softmax(-1)
            found.append(-scores.gather(1, torch.tensor(window[1:])[:, None]).sum().item())
    return found


def llama_cpp_nll(python: str, model: str | None, windows, threads: int) -> list[float] | None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "windows.json")
        path.write_text(json.dumps(windows))
        command = [python, "-c", LLAMA_CPP_NLL, str(resolve(model)), str(path), str(threads)]
        found = child_figures(command, "llama.cpp")
    return None if found is None else found["nll"]


def perplexity(nll: list[float], windows: list[list[int]]) -> float:
    return math.exp(sum(nll) / sum(len(w) - 1 for w in windows))


def run(args: argparse.Namespace) -> tuple[list[Figure], dict]:
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    windows = windows_of(loaded, args.window, args.windows)
    scored: dict[str, list[float]] = {}
    for mode in args.modes:
        scored[f"etinfer {mode}"] = etinfer_nll(loaded, mode, windows)
    if args.transformers:
        from etinfer.bench.speed.speed import load_transformers_model

        reference = load_transformers_model(args.model)
        scored["transformers float32"] = transformers_nll(reference, windows)
    if args.llama_cpp_python:
        found = llama_cpp_nll(args.llama_cpp_python, args.model, windows, args.threads)
        if found is not None:
            scored["llama.cpp"] = found
    figures_by_engine = {name: perplexity(nll, windows) for name, nll in scored.items()}
    reference = figures_by_engine.get("transformers float32")
    tokens = sum(len(w) - 1 for w in windows)
    print(
        f"\n{len(windows)} windows of {args.window} tokens ({tokens} scored) of {CORPUS}, "
        f"{args.threads} threads, CPU flags: {cpu_flags()}"
    )
    print("| engine | perplexity | over transformers float32 |\n|---|---:|---:|")
    for name, value in figures_by_engine.items():
        ratio = f"{value / reference:.5f}x" if reference else "-"
        print(f"| {name} | {value:.4f} | {ratio} |")
    labels = model_labels(resolve(args.model)) | {"window": args.window, "tokens": tokens}
    figures = [
        Figure("perplexity", value, "", labels | {"engine": name})
        for name, value in figures_by_engine.items()
    ]
    if reference:
        figures += [
            Figure("perplexity", value / reference, "x", labels | {"engine": name, "vs": "hf"})
            for name, value in figures_by_engine.items()
            if name != "transformers float32"
        ]
    report = {"corpus": CORPUS, "windows": len(windows), "perplexity": figures_by_engine}
    return figures, report


def add_command(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser(
        "perplexity", help="perplexity on shipped human text, beside transformers and llama.cpp"
    )
    parser.add_argument("--model", help="a .gguf file, a folder or an installed model's name")
    parser.add_argument("--modes", nargs="+", default=["auto", "none"], help="weight modes")
    parser.add_argument("--window", type=positive_int, default=512, help="tokens a window")
    parser.add_argument("--windows", type=positive_int, default=8)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument(
        "--transformers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="score with transformers' float32 model too (the reference)",
    )
    parser.add_argument("--llama-cpp-python", help="a Python with llama-cpp-python installed")
    add_result_option(parser)
    parser.set_defaults(func=recorded("perplexity", run))
