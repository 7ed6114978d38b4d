"""The weight formats side by side: for each ``quantization`` mode of our engine,
transformers in float32 and llama.cpp on the same GGUF file, the batch-1/4/16 decode rate, the
prefill rate of one 2K-token prompt, load time, resident memory after load, and how closely our
logits follow the float model's on real text (llama.cpp's too, as a reference: its logits on
the same teacher-forced windows against our ``none``). A mode may carry a variant of the engine
(``auto+batch-invariant``, ``auto+no-native``, ``auto+layer-by-layer``), measured in the same
run.

Each engine runs in a process of its own (resident memory and load time are then its alone),
one after the other, and the whole round repeats; the best round of each is kept, which is what
a shared, noisy machine allows. llama.cpp runs through ``llama-cpp-python`` in whatever Python
``--llama-cpp-python`` names (build it in a separate environment: it is not our dependency).

    etinfer bench quantization --llama-cpp-python ../llamacpp-venv/bin/python

The run's result holds every engine's figures (``quantization_figures.py``), its ``details``
every round and the best of them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from etinfer import LLM, SamplingParams
from etinfer.bench.common.child import child_figures, run_child, with_child
from etinfer.bench.common.decode_steps import context_prompts, ours_decode_step_ms
from etinfer.bench.common.fidelity import logit_agreement
from etinfer.bench.common.machine import ISA_ENV, cpu_flags
from etinfer.bench.common.results import Figure, add_result_option, model_labels, recorded
from etinfer.bench.speed.llama_cpp_driver import DECODE_CONTEXT, LLAMA_CPP
from etinfer.bench.speed.quantization_figures import figures
from etinfer.bench.speed.random_shapes import FORMATS, SHAPES, random_gguf
from etinfer.bench.speed.speed import load_transformers_model, transformers_decode_step_ms
from etinfer.calibrate import collect
from etinfer.corpus import corpus_windows
from etinfer.engine.startup import weight_forms
from etinfer.model.catalog import resolve
from etinfer.model.linear import rows_alone
from etinfer.model.quantized import QUANTIZATION_MODES
from etinfer.options import non_negative_int, positive_int

STEPS = 24


# A mode may name a variant of the engine after a "+": batch-invariant (EngineConfig's),
# no-native (every native kernel off, ETINFER_NATIVE=0: their work as torch operations), or
# layer-by-layer (decode steps without the native decoder, ETINFER_NATIVE_DECODER=0).
VARIANTS = ("batch-invariant", "no-native", "layer-by-layer")
# Each environment variant's setting.
VARIANT_ENV = {
    "no-native": {"ETINFER_NATIVE": "0"},
    "layer-by-layer": {"ETINFER_NATIVE_DECODER": "0"},
}
MODE_CHOICES = [*QUANTIZATION_MODES, *(f"{m}+{v}" for m in QUANTIZATION_MODES for v in VARIANTS)]


def measure_ours(
    engine: str,
    model: str | None,
    batches: list[int],
    prompt_len: int,
    fidelity_tokens: int,
    top_tokens_out: str | None = None,
) -> dict:
    import psutil

    mode, _, variant = engine.partition("+")
    start = time.perf_counter()
    llm = LLM(
        model,
        quantization=mode,
        batch_invariant=variant == "batch-invariant",
        max_num_seqs=max(batches),
        max_num_batched_tokens=prompt_len,
        enable_prefix_caching=False,
        num_kvcache_blocks=(max(batches) * 256 + prompt_len) // 16 + 64,
    )
    result = {"load_s": time.perf_counter() - start}
    result["rss_mib"] = psutil.Process().memory_info().rss / 2**20
    result["weights"] = weight_forms(llm.engine.runner.model.weights.forms)  # the start-up line's
    result["decode_tok_s"] = {
        str(b): 1000 * b / ours_decode_step_ms(llm, b, DECODE_CONTEXT, STEPS) for b in batches
    }
    prompt = context_prompts(llm, 1, prompt_len)
    once = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([prompt[0][:256]], once)  # warm-up
    start = time.perf_counter()
    llm.generate(prompt, once)
    result["prefill_tok_s"] = prompt_len / (time.perf_counter() - start)
    if mode != "none" and fidelity_tokens:
        windows = fidelity_windows(llm, fidelity_tokens)
        logits = collect(llm.engine, iter(windows), fidelity_tokens)[0]
        # The windows are prefilled; a decode step computes each row alone (the block kernels'
        # 8-bit activations, where a prefill's many rows may take a float32 GEMM).
        with rows_alone():
            alone = collect(llm.engine, iter(windows), fidelity_tokens)[0]
        if top_tokens_out:  # for agreement with llama.cpp, worked out by the parent
            torch.save(logits.argmax(-1), top_tokens_out)
        del llm
        expected = collect(float_llm(model).engine, iter(windows), fidelity_tokens)[0]
        result |= logit_agreement(logits, expected)
        decoded = logit_agreement(alone, expected)
        result["rows_alone_top1"], result["rows_alone_kl"] = (
            decoded["top1_agreement"],
            decoded["kl_mean"],
        )
    return result


def fidelity_windows(llm: LLM, fidelity_tokens: int) -> list[list[int]]:
    """The teacher-forced text every engine's logits are compared on: 256-token windows."""
    return list(corpus_windows(llm.tokenizer, 256))[: fidelity_tokens // 255 + 1]


def float_llm(model: str | None) -> LLM:
    """The float32 path: weights dequantized at load, a float32 KV cache."""
    return LLM(
        model, quantization="none", dtype="float32", kv_cache_dtype="float32", num_kvcache_blocks=64
    )


def model_path(args: argparse.Namespace) -> str:
    return str(resolve(args.model))


def against_float(
    logits: torch.Tensor, reference: LLM, windows: list[list[int]], fidelity_tokens: int
) -> dict:
    """Top-1 agreement and mean KL of ``logits`` against ``reference`` (``none``) on the same
    windows."""
    expected = collect(reference.engine, iter(windows), fidelity_tokens)[0]
    return logit_agreement(logits, expected)


def llama_cpp_fidelity(args: argparse.Namespace) -> dict:
    """llama.cpp's logits on the same windows against our float path: how far the file's own
    engine, which multiplies 4-bit weights by 8-bit activations, is from float32. Its logits
    computed one token a call (its decode path) are compared with its batched ones too: how far
    llama.cpp is from itself bounds how closely another engine can follow it."""
    import numpy

    reference = float_llm(args.model)
    windows = fidelity_windows(reference, args.fidelity_tokens)
    with tempfile.TemporaryDirectory() as folder:
        windows_path = Path(folder, "windows.json")
        paths = [Path(folder, "batched.npy"), Path(folder, "one_token_a_call.npy")]
        windows_path.write_text(json.dumps(windows))
        command = [args.llama_cpp_python, "-c", LLAMA_CPP, model_path(args)]
        command += [str(args.prompt_len), str(args.threads), "1", "1", str(windows_path)]
        if run_child([*command, *map(str, paths)], "llama.cpp's logits") is None:
            return {}
        batched, one_token = (
            torch.from_numpy(numpy.load(p))[: args.fidelity_tokens] for p in paths
        )
    result = against_float(batched, reference, windows, args.fidelity_tokens)
    itself = logit_agreement(one_token, batched)
    result |= {"self_top1": itself["top1_agreement"], "self_kl": itself["kl_mean"]}
    return result | {"top_tokens": batched.argmax(-1)}


def measure_transformers(model_file: str | None, batches: list[int], prompt_len: int) -> dict:
    import psutil

    start = time.perf_counter()
    model = load_transformers_model(model_file)
    result = {"load_s": time.perf_counter() - start}
    result["rss_mib"] = psutil.Process().memory_info().rss / 2**20
    result["decode_tok_s"] = {
        str(b): 1000 * b / transformers_decode_step_ms(model, b, DECODE_CONTEXT, STEPS)
        for b in batches
    }
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_len))
    with torch.no_grad():
        model(ids[:, :256])
        start = time.perf_counter()
        model(ids, logits_to_keep=1)
    result["prefill_tok_s"] = prompt_len / (time.perf_counter() - start)
    return result


def child(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    if args.child == "transformers":
        return measure_transformers(args.model, args.batches, args.prompt_len)
    return measure_ours(
        args.child,
        args.model,
        args.batches,
        args.prompt_len,
        args.fidelity_tokens,
        args.top_tokens_out,
    )


def run_engine(engine: str, args: argparse.Namespace) -> dict | None:
    if engine == "llama.cpp":
        command = [args.llama_cpp_python, "-c", LLAMA_CPP, model_path(args)]
        command += [str(args.prompt_len), str(args.threads), str(STEPS)]
        command.append(",".join(str(b) for b in args.batches))
    else:
        command = [sys.executable, "-m", "etinfer.cli", "bench", "quantization", "--child", engine]
        command += ["--model", model_path(args)]
        command += ["--threads", str(args.threads), "--prompt-len", str(args.prompt_len)]
        command += ["--fidelity-tokens", str(args.fidelity_tokens), "--batches"]
        command += [str(b) for b in args.batches]
        if args.top_tokens_dir:
            command += ["--top-tokens-out", str(Path(args.top_tokens_dir, f"{engine}.pt"))]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    if args.isa and engine != "llama.cpp":  # llama.cpp's ISA is fixed when it is built
        env |= ISA_ENV[args.isa]
    env |= VARIANT_ENV.get(engine.partition("+")[2], {})
    return child_figures(command, engine, env)


def best(rounds: list[dict]) -> dict:
    """Per figure, the best round: highest rates, lowest load time and memory."""
    result = dict(rounds[0])
    for key in ("load_s", "rss_mib"):
        result[key] = min(r[key] for r in rounds)
    result["prefill_tok_s"] = max(r["prefill_tok_s"] for r in rounds)
    result["decode_tok_s"] = {
        b: max(r["decode_tok_s"][b] for r in rounds) for b in rounds[0]["decode_tok_s"]
    }
    return result


def table(results: dict[str, dict], batches: list[int], prompt_len: int) -> str:
    base = results.get("none")
    heads = [f"decode b={b} tok/s" for b in batches]
    lines = [
        "| engine | " + " | ".join(heads) + f" | prefill {prompt_len} tok/s | load s | RSS MiB "
        "| top-1 vs none | KL vs none | top-1 vs llama.cpp |",
        "|---|" + "---:|" * (len(heads) + 6),
    ]
    for name, r in results.items():
        rates = [r["decode_tok_s"].get(str(b)) for b in batches]
        cells = ["-" if v is None else f"{v:,.1f}" for v in rates]
        if base and name != "none":
            cells = [
                c if v is None else f"{c} ({v / base['decode_tok_s'][str(b)]:.2f}x)"
                for c, v, b in zip(cells, rates, batches, strict=True)
            ]
        agreement = f"{r['top1_agreement']:.2%}" if "top1_agreement" in r else "-"
        kl = f"{r['kl_mean']:.5f}" if "kl_mean" in r else "-"
        versus = f"{r['top1_vs_llama_cpp']:.2%}" if "top1_vs_llama_cpp" in r else "-"
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {r['prefill_tok_s']:,.0f} | "
            f"{r['load_s']:.1f} | {r['rss_mib']:,.0f} | {agreement} | {kl} | {versus} |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> tuple[list[Figure], dict]:
    modes = args.modes or ["none", "int8", "int4", "auto"]
    if args.random_shape:
        # Random weights: agreement with float says nothing of a format, and a shape's float
        # copy (4 bytes a weight) may not fit; transformers would load that copy too.
        args.model = str(random_gguf(args.random_shape, args.random_format, args.random_dir))
        modes = args.modes or ["auto", "gguf"]
        args.skip_transformers = True
        args.fidelity_tokens = 0
    engines = [*modes]
    if not args.skip_transformers:
        engines.append("transformers")
    if args.llama_cpp_python:
        engines.append("llama.cpp")
    rounds: dict[str, list[dict]] = {e: [] for e in engines}
    # Each of our engines leaves its top tokens on the fidelity text here, for llama.cpp's.
    top_tokens = tempfile.TemporaryDirectory()
    args.top_tokens_dir = top_tokens.name if args.llama_cpp_python else None
    for repeat in range(args.repeats):
        for engine in engines:
            result = run_engine(engine, args)
            if result is not None:
                rounds[engine].append(result)
                print(f"round {repeat + 1}, {engine}: {json.dumps(result)}", flush=True)
    results = {e: best(r) for e, r in rounds.items() if r}
    if "llama.cpp" in results and args.fidelity_tokens:
        torch.set_num_threads(args.threads)
        results["llama.cpp"] |= llama_cpp_fidelity(args)
        theirs = results["llama.cpp"].pop("top_tokens", None)
        for engine, result in results.items():
            saved = Path(top_tokens.name, f"{engine}.pt")
            if theirs is not None and saved.is_file():
                ours = torch.load(saved)[: len(theirs)]
                result["top1_vs_llama_cpp"] = (ours == theirs[: len(ours)]).float().mean().item()
    top_tokens.cleanup()
    held = f", ours held to {args.isa}" if args.isa else ""
    print(f"\n{args.threads} threads, torch {torch.__version__}, CPU flags: {cpu_flags()}{held}")
    print(table(results, args.batches, args.prompt_len))
    for engine, r in results.items():
        if "rows_alone_top1" in r:
            print(
                f"{engine}, each row computed alone (a decode step's arithmetic): top-1 "
                f"{r['rows_alone_top1']:.2%}, KL {r['rows_alone_kl']:.5f}"
            )
    if "self_top1" in results.get("llama.cpp", {}):
        r = results["llama.cpp"]
        print(
            f"llama.cpp one token a call against its batched logits: top-1 {r['self_top1']:.2%}, "
            f"KL {r['self_kl']:.5f}"
        )
    setting = {"threads": args.threads, "isa": args.isa, "prompt_len": args.prompt_len}
    found = figures(rounds, results, setting, model_labels(Path(model_path(args))))
    return found, setting | {"rounds": rounds, "best": results}


def add_command(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("quantization", help="weight formats against llama.cpp, side by side")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=MODE_CHOICES,
        metavar="MODE[+VARIANT]",
        help="quantization modes, each optionally with a variant: "
        f"{', '.join(VARIANTS)} (default: none int8 int4 auto; auto gguf with --random-shape)",
    )
    models = parser.add_mutually_exclusive_group()
    models.add_argument("--model", help="a .gguf file or folder (default: the embedded model)")
    parser.add_argument("--batches", type=positive_int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompt-len", type=positive_int, default=2048)
    parser.add_argument(
        "--fidelity-tokens",
        type=non_negative_int,
        default=2048,
        help="tokens of text each mode's logits are compared with float32's on (0: none)",
    )
    models.add_argument(
        "--random-shape",
        choices=list(SHAPES),
        help="a random-weight GGUF of this model's shape (the default model's tokenizer), "
        "written once under --random-dir, instead of --model: decode beyond the cache",
    )
    parser.add_argument("--random-format", choices=FORMATS, default="Q4_0")
    parser.add_argument(
        "--random-dir", type=Path, default=Path.home() / ".cache/etinfer/random-shapes"
    )
    parser.add_argument("--repeats", type=positive_int, default=2)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--isa", choices=sorted(ISA_ENV), help="hold our engines to this ISA")
    parser.add_argument("--llama-cpp-python", help="a Python with llama-cpp-python installed")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--top-tokens-out", help=argparse.SUPPRESS)
    add_result_option(parser)
    parser.set_defaults(func=with_child(child, recorded("quantization", run)))
