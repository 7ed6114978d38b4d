"""What the KV cache's element type costs and what it saves, against float32, in one run.

    etinfer bench kv-cache --dtypes float32 float16 bfloat16 int8 --context 8192 --batches 1 8

**Cost.** Teacher-forced next-token distributions over windows of human-written text (CPython's
``pydoc_data.topics``, the calibration corpus): ``--fidelity-context`` tokens prefilled, the next
``--fidelity-steps`` forced as decode steps, each engine's log-probabilities compared with the
float32 cache's: mean and largest KL(p_float32 || p_dtype) and top-1 agreement. These engines
have float weights (``--fidelity-quantization``): the 4-bit paths round their activations (to
bfloat16 or 8 bits), so that any perturbation, a float16 cache's or a float32 one's last bit,
moves a few roundings and their logits by that path's own noise (KL about 5e-4 with the default
weights, whatever the cache), which would hide the cache's. Then passkeys at about ``--context``
tokens, at five depths (``fidelity.py``), with the weights users run, in the repeated haystack
(``--haystack``): in the corpus one the default model finds none at 8K, whatever the cache.

**Savings.** The median decode step with every sequence decoding at ``--context`` tokens of
distinct text, at each batch size (the largest first, so that the smaller ones find their
prompts in the prefix cache), and the cache's bytes per token.

Every engine is the default one but for its cache (weights in ``--quantization``), built one
after another in this process: ratios are side by side in one run. The run's result holds each
type's KL, top-1 agreement, passkeys found and step time with its ratio to float32's (its
``details``: the rows as printed).
"""

from __future__ import annotations

import argparse
import gc

import torch

from etinfer import LLM
from etinfer.bench.common.decode_steps import ours_decode_step_ms
from etinfer.bench.common.fidelity import (
    corpus_tokens,
    divergences,
    forced_log_probs,
    passkey_accuracy,
    passkey_cases,
)
from etinfer.bench.common.machine import cpu_flags
from etinfer.bench.common.results import Figure, add_result_option, model_labels, recorded
from etinfer.config import KV_CACHE_DTYPES
from etinfer.model.kv_cache import kv_bytes_per_token
from etinfer.model.loader import LoadedModel, load_model
from etinfer.options import positive_int


def fidelity_texts(llm: LLM, count: int, length: int) -> list[list[int]]:
    """``count`` disjoint windows of ``length`` corpus tokens."""
    tokens = corpus_tokens(llm.tokenizer)
    if len(tokens) < count * length:
        raise ValueError(f"the corpus holds {len(tokens)} tokens, under {count} x {length}")
    return [tokens[i * length : (i + 1) * length] for i in range(count)]


def measure(loaded: LoadedModel, dtype: str, args: argparse.Namespace) -> dict:
    """One cache type's forced pass, passkeys and decode steps."""

    def engine(quantization: str) -> LLM:
        return LLM(
            loaded,
            kv_cache_dtype=dtype,
            quantization=quantization,
            max_num_seqs=max(args.batches),
            kv_cache_gib=args.kv_cache_gib,
        )

    llm = engine(args.fidelity_quantization)
    texts = fidelity_texts(llm, args.fidelity_texts, args.fidelity_context + args.fidelity_steps)
    forced = forced_log_probs(llm, texts, args.fidelity_context, args.fidelity_steps)
    del llm
    gc.collect()
    llm = engine(args.quantization)
    cases = passkey_cases(llm.tokenizer, (args.context,), args.haystack)
    found = passkey_accuracy(llm, cases)
    steps = {
        batch: ours_decode_step_ms(llm, batch, args.context, args.steps)
        for batch in sorted(args.batches, reverse=True)
    }
    return {"forced": forced, "passkeys": found, "step_ms": steps}


def compare(runs: dict[str, dict], model_config) -> dict[str, dict]:
    """Each dtype's figures, its distributions and step times against float32's."""
    reference = runs["float32"]
    rows = {}
    for name, run in runs.items():
        kl, agree = divergences(reference["forced"], run["forced"])
        rows[name] = {
            "bytes_per_token": kv_bytes_per_token(model_config, KV_CACHE_DTYPES[name]),
            "positions": len(kl),
            "kl_mean": sum(kl) / len(kl),
            "kl_max": max(kl),
            "top1_agreement": sum(agree) / len(agree),
            "passkeys_found": sum(run["passkeys"]),
            "passkeys": len(run["passkeys"]),
            "step_ms": run["step_ms"],
            "step_ratio": {b: ms / reference["step_ms"][b] for b, ms in run["step_ms"].items()},
        }
    return rows


def table(rows: dict[str, dict], args: argparse.Namespace) -> str:
    batches = sorted(args.batches)
    head = "| cache | bytes/token | top-1 vs float32 | KL mean | KL max | passkeys |"
    head += "".join(f" step b{b} (ms) | vs float32 |" for b in batches)
    lines = [head, "|" + "---|" * (6 + 2 * len(batches))]
    for name, row in rows.items():
        line = (
            f"| {name} | {row['bytes_per_token']:,} | {row['top1_agreement']:.2%} | "
            f"{row['kl_mean']:.2e} | {row['kl_max']:.2e} | "
            f"{row['passkeys_found']}/{row['passkeys']} |"
        )
        line += "".join(
            f" {row['step_ms'][b]:.1f} | {row['step_ratio'][b]:.2f}x |" for b in batches
        )
        lines.append(line)
    return "\n".join(lines)


def figures(rows: dict[str, dict], args: argparse.Namespace, model: dict) -> list[Figure]:
    """Each type's figures, and those against float32 for the others; ``mode`` says which
    weights computed them (float ones for fidelity)."""
    found = []
    for name, row in rows.items():
        labels = {"kv_cache_dtype": name, "mode": args.quantization} | model
        found += [
            Figure("passkeys found", row["passkeys_found"], "count", labels, n=row["passkeys"]),
            Figure("kv bytes per token", row["bytes_per_token"], "", labels),
        ]
        reference = name == "float32"
        for batch, ms in row["step_ms"].items():
            step = labels | {"batch": batch, "context": args.context}
            found.append(Figure("decode step", ms, "ms", step, n=args.steps))
            if not reference:
                ratio = row["step_ratio"][batch]
                found.append(Figure("decode step", ratio, "x", step | {"vs": "float32"}))
        if reference:
            continue
        fidelity = labels | {"mode": args.fidelity_quantization, "vs": "float32"}
        positions = row["positions"]
        found += [
            Figure("kl", row["kl_mean"], "nats", fidelity, n=positions),
            Figure("kl max", row["kl_max"], "nats", fidelity, n=positions),
            Figure("top-1 agreement", 100 * row["top1_agreement"], "%", fidelity, n=positions),
        ]
    return found


def run(args: argparse.Namespace) -> tuple[list[Figure], dict]:
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    runs = {}
    for name in ["float32", *(d for d in args.dtypes if d != "float32")]:
        runs[name] = measure(loaded, name, args)
        print(f"{name}: {runs[name]['step_ms']}", flush=True)
        gc.collect()
    rows = compare(runs, loaded.config)
    print(
        f"\n{args.threads} threads; weights {args.fidelity_quantization} (fidelity), "
        f"{args.quantization} (passkeys, steps); CPU flags: {cpu_flags()}"
    )
    print(table(rows, args))
    report = {
        "threads": args.threads,
        "quantization": args.quantization,
        "fidelity_quantization": args.fidelity_quantization,
        "rows": rows,
    }
    return figures(rows, args, model_labels(loaded.path)), report


def add_command(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("kv-cache", help="the KV cache's element types against float32")
    parser.add_argument("--model", help="a .gguf file or folder (default: the embedded model)")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=sorted(KV_CACHE_DTYPES),
        default=["float32", "float16", "bfloat16", "int8"],
    )
    parser.add_argument("--quantization", default="auto", help="weights (passkeys, steps)")
    parser.add_argument("--fidelity-quantization", default="none", help="weights (fidelity)")
    parser.add_argument(
        "--context", type=positive_int, default=8000, help="passkeys' and steps' tokens"
    )
    parser.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8])
    parser.add_argument(
        "--haystack",
        choices=["repeated", "corpus"],
        default="repeated",
        help="the passkeys' filler (the default model finds corpus ones at 8K with no cache)",
    )
    parser.add_argument(
        "--steps", type=positive_int, default=16, help="decode steps timed per batch"
    )
    parser.add_argument("--fidelity-texts", type=positive_int, default=4)
    parser.add_argument("--fidelity-context", type=positive_int, default=2048)
    parser.add_argument("--fidelity-steps", type=positive_int, default=256)
    parser.add_argument("--kv-cache-gib", type=float, default=4.0)
    parser.add_argument("--threads", type=positive_int, default=2)
    add_result_option(parser)
    parser.set_defaults(func=recorded("kv-cache", run))
