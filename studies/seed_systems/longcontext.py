"""Long prompts: dense attention against the EntropyInfer layers, side by side in one run.

    python -m studies longcontext --output-dir results/longcontext

For prompts of 2K to 8K tokens, one engine per arm over one loaded model (prefix caching off,
so every arm computes every prefill):

- real text (CPython's ``pydoc_data``) prefilled, then ``--steps`` tokens of the same text fed as
  decode steps (teacher forcing): time to first token, decode tokens/s, KV blocks held, and
  top-1 agreement and KL of every forced step against the dense arm;
- the share of dense prefill time spent in attention (the bound of what sparse prefill can
  save: ``1 - share * skipped``), and the estimate's share of a sparse prefill;
- passkey retrieval at depths 0.25, 0.5 and 0.75 in two haystacks (``bench/common/fidelity.py``),
  the dense arm first: a 135M model may miss a passkey even dense;
- uniform per-head budgets at the entropy rule's mean budget (CritiPrefill-like), at equal work;
- compression voted by the prompt alone (SnapKV-like), ranked by attention alone, and voted by
  the passkey question (a ranking that knows what will be asked);
- the attention entropy per layer, KV head and segment of two different 8K texts: how many heads
  are rigid in each, and how many change type between them.

``--output-dir`` keeps the report (``longcontext.json``, the result's ``details``) and the plot;
the result's figures are ``longcontext_report.figures``'.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from etinfer import options
from etinfer.bench.common.fidelity import (
    FILLER,
    QUESTION,
    corpus_tokens,
    divergences,
    forced_log_probs,
    passkey_accuracy,
    passkey_cases,
)
from etinfer.bench.common.machine import cpu_flags
from etinfer.bench.common.results import Figure, add_result_option, engine_device, recorded
from etinfer.config import EngineConfig
from etinfer.control.config import ControlConfig
from etinfer.control.kv_compression import KVCompressionConfig
from etinfer.control.sparse_prefill import SparsePrefillConfig
from etinfer.engine.observer import StepRecord
from etinfer.llm import LLM
from etinfer.model.loader import load_model
from etinfer.options import positive_int
from etinfer.sampling_params import SamplingParams
from studies import PROGRAM
from studies.seed_systems.longcontext_report import figures, plot_profile, pressure_table, table

DEPTHS = (0.25, 0.5, 0.75)
COMPRESSION = KVCompressionConfig()
ARMS = {
    "dense": ControlConfig(),
    "sparse prefill": ControlConfig(sparse_prefill=True),
    "kv compression": ControlConfig(kv_compression=COMPRESSION),
    "all": ControlConfig(sparse_prefill=True, kv_compression=COMPRESSION),
}


@contextlib.contextmanager
def timed(obj: object, method: str, seconds: list[float]):
    """Add the wall time of every call of ``obj.method`` to ``seconds[0]`` meanwhile."""
    original = getattr(obj, method)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds[0] += time.perf_counter() - start

    setattr(obj, method, wrapper)
    try:
        yield
    finally:
        delattr(obj, method)


def timing_rows(llm: LLM, texts: dict[int, list[int]], steps: int, repeats: int) -> dict:
    """Per length: the best of ``repeats`` teacher-forced runs, with attention and estimate
    time; and the forced pass (log-probs) of the last run."""
    attention = llm.engine.runner.attention
    rows = {}
    for length, text in texts.items():
        best = None
        for _ in range(repeats):
            attend, estimate, compress = [0.0], [0.0], [0.0]
            with contextlib.ExitStack() as stack:
                # The prefill of the backend as the layer calls it: sparse prefill's pieces
                # and estimate where it is on, the dense chunks otherwise.
                stack.enter_context(timed(attention.selecting, "prefill", attend))
                if attention.prefill_selector is not None:
                    selector = attention.prefill_selector
                    stack.enter_context(timed(selector, "select_prefill", estimate))
                if llm.engine.compressor is not None:
                    stack.enter_context(timed(llm.engine.compressor, "compress", compress))
                forced = forced_log_probs(llm, [text], length, steps)
            out = forced.outputs[0]
            ttft = out.metrics.time_to_first_token
            if best is None or ttft < best["ttft_s"]:
                decode_s = out.metrics.finished_time - out.metrics.first_token_time
                profile = out.attention_profile
                best = {
                    "ttft_s": ttft,
                    # Decode steps alone; the one-off compression is its own figure.
                    "decode_tok_s": (len(out.token_ids) - 1) / (decode_s - compress[0]),
                    "compress_ms": 1000 * compress[0],
                    "kv_blocks": out.metrics.kv_blocks,
                    "skipped": out.metrics.prefill_attention_skipped,
                    # Attention includes the estimate, which runs inside it.
                    "attention_share": attend[0] / ttft,
                    "estimate_share": estimate[0] / ttft,
                    "mean_budget": None if profile is None else float(profile.budgets.nanmean()),
                    "forced": forced,
                }
        rows[length] = best
    return rows


def run_arms(
    loaded, arms: dict[str, ControlConfig], texts, args, passkeys: bool, repeats: int
) -> dict[str, dict]:
    results = {}
    for name, control in arms.items():
        llm = LLM(loaded, control=control, enable_prefix_caching=False, max_num_seqs=8)
        llm.generate(["Warm up."], SamplingParams(max_tokens=8))  # first-call costs apart
        results[name] = timing_rows(llm, texts, args.steps, repeats)
        print(f"{name}: timed", flush=True)
        if passkeys and args.passkeys:
            # The question follows N_d + 1 generated tokens, so compression has run when it
            # is read (the same for every arm).
            lead = llm.tokenizer.encode(FILLER * 4)[: COMPRESSION.decode_queries + 1]
            lengths = tuple(n for n in texts if n >= args.passkey_min)
            for haystack in ("corpus", "repeated"):
                cases = [
                    replace(c, question=lead + c.question)
                    for c in passkey_cases(llm.tokenizer, lengths, haystack, args.seed)
                    if c.depth in DEPTHS
                ]
                found = passkey_accuracy(llm, cases)
                for case, ok in zip(cases, found, strict=True):
                    results[name][case.length].setdefault("passkeys", []).append(ok)
            print(f"{name}: passkeys", flush=True)
    return results


def against_dense(results: dict[str, dict]) -> None:
    """Each row's fidelity and time against the dense arm's, in place: fidelity over the
    positions predicted after compression has run (the same positions for every arm)."""
    dense = results["dense"]
    for rows in results.values():
        for length, row in rows.items():
            after = length + COMPRESSION.decode_queries + 1
            kl, agree = divergences(dense[length]["forced"], row["forced"], after)
            row["top1"], row["kl_mean"] = statistics.fmean(agree), statistics.fmean(kl)
            row["ttft_ratio"] = row["ttft_s"] / dense[length]["ttft_s"]
            row["bound"] = 1 - dense[length]["attention_share"] * row["skipped"]
    for rows in results.values():
        for row in rows.values():
            del row["forced"]


def head_types(loaded, config: SparsePrefillConfig, texts: dict[str, list[int]], path: Path):
    """Attention entropy per layer, KV head and segment of each text; rigid heads under the
    seed's threshold and under a looser one, and how many change type between the texts."""
    llm = LLM(loaded, control=ControlConfig(sparse_prefill=config), enable_prefix_caching=False)
    profiles = {
        name: llm.generate([text], SamplingParams(temperature=0, max_tokens=1))[0].attention_profile
        for name, text in texts.items()
    }
    first = next(iter(profiles.values()))
    plot_profile(first, config, path)
    summary = {}
    for threshold in (config.entropy_threshold, 0.5, 1.0):
        rigid = {}
        for name, profile in profiles.items():
            estimated = profile.entropy[1 : -(-len(texts[name]) // config.segment_size)]
            rigid[name] = (estimated < threshold).all(0)  # [layers, kv_heads]
        a, b = rigid.values()
        summary[f"{threshold:g}"] = {
            **{name: float(r.float().mean()) for name, r in rigid.items()},
            "changed": float((a != b).float().mean()),
        }
    return summary


def pressure_run(loaded, control: ControlConfig, corpus: list[int], args) -> dict:
    """``--pressure-requests`` prompts of the longest length, ``--pressure-tokens`` tokens
    each, in a pool that holds four of them dense: output tokens/s over the whole run."""
    limit = loaded.config.max_position_embeddings - args.pressure_tokens
    length = min(max(args.lengths), limit)
    block_size = EngineConfig().block_size
    per_request = -(-(length + args.pressure_tokens) // block_size)
    llm = LLM(
        loaded,
        control=control,
        enable_prefix_caching=False,
        num_kvcache_blocks=4 * per_request,
        max_num_seqs=args.pressure_requests,
    )
    prompts = [
        corpus[i * 3001 % (len(corpus) - length) :][:length] for i in range(args.pressure_requests)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.pressure_tokens, ignore_eos=True)
    running, preempted, prefilling = [], [0], [0.0]

    def observe(step: StepRecord) -> None:
        running.append(len(step.request_ids))
        preempted.append(len(step.preempted))
        if step.num_decode < len(step.request_ids):  # the step carries a prefill chunk
            prefilling.append(step.wall_time)

    llm.engine.add_observer(observe)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        "mean_batch": statistics.fmean(running),
        "preemptions": sum(preempted),
        # Wall time in steps that carry prefill: what compression cannot shorten, so the
        # throughput it can reach at most is tokens / prefill_s.
        "prefill_s": sum(prefilling),
        "kv_blocks_mean": statistics.fmean(o.metrics.kv_blocks for o in outs),
    }


def run(args: argparse.Namespace) -> tuple[list[Figure], dict]:
    # Fidelity is read after compression has run: positions past its N_d + 1 decode steps.
    least = COMPRESSION.decode_queries + 2
    if args.steps < least:
        raise SystemExit(f"error: --steps must be at least {least} (got {args.steps})")
    sparse = SparsePrefillConfig()
    if max(args.lengths) <= sparse.min_context:
        # The head types are read from the longest prompt's attention profile, which a prompt
        # that sparse prefill attends densely throughout does not have.
        raise SystemExit(
            f"error: --lengths must reach past sparse prefill's min_context of "
            f"{sparse.min_context} tokens (the longest given is {max(args.lengths)})"
        )
    options.set_threads(args)
    loaded = load_model(args.model)
    corpus = corpus_tokens(loaded.tokenizer)
    texts = {n: corpus[args.offset : args.offset + n + args.steps] for n in args.lengths}
    arms = {name: ARMS[name] for name in ("dense", *args.arms)}  # dense first: the reference
    results = run_arms(loaded, arms, texts, args, passkeys=True, repeats=args.repeats)
    longest = max(texts)
    # The comparisons run once: their figures are fidelity and passkeys, not time.
    mean_budget = results.get("sparse prefill", {}).get(longest, {}).get("mean_budget")
    if mean_budget is not None and math.isfinite(mean_budget):
        # Uniform per-head budgets at the mean budget the entropy rule chose at the longest
        # length (CritiPrefill-like).
        mean = int(mean_budget)
        uniform = replace(sparse, base_budget=mean, max_budget_factor=1.0)
        extra = {f"sparse prefill, uniform {mean}": ControlConfig(sparse_prefill=uniform)}
        results |= run_arms(loaded, extra, texts, args, passkeys=False, repeats=1)
    if "kv compression" in results:
        # Voted by the prompt alone (SnapKV-like), ranked by attention alone, and voted by the
        # passkey question itself (compression waits until it is read: a ranking that knows
        # the question, the bound of what a question-agnostic one can keep).
        asked = COMPRESSION.decode_queries + 1 + len(loaded.tokenizer.encode(QUESTION))
        extra = {
            "kv compression, N_d = 0": replace(COMPRESSION, decode_queries=0),
            "kv compression, attention only": replace(COMPRESSION, key_novelty=False),
            "kv compression, the question votes": replace(COMPRESSION, decode_queries=asked),
        }
        extra = {name: ControlConfig(kv_compression=c) for name, c in extra.items()}
        results |= run_arms(loaded, extra, texts, args, passkeys=True, repeats=1)
    against_dense(results)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    pressure = {}
    if args.pressure:
        for name in ("dense", "kv compression", "all") if "kv compression" in arms else ():
            pressure[name] = pressure_run(loaded, ARMS[name], corpus, args)
            print(f"{name} under KV pressure: {pressure[name]}", flush=True)
    repeated = loaded.tokenizer.encode(" The grass is green. The sky is blue." * 1000)[:longest]
    heads = head_types(
        loaded,
        sparse,
        {"pydoc text": texts[longest], "repeated filler": repeated},
        out / "attention_entropy.png",
    )
    summary = {"rows": results, "heads": heads, "pressure": pressure}
    (out / "longcontext.json").write_text(json.dumps(summary, indent=1))
    print(f"\n{torch.get_num_threads()} threads, CPU flags: {cpu_flags()}")
    print(table(results))
    print(pressure_table(pressure))
    print(f"\nrigid heads (share) and heads changing type between two texts: {heads}")
    return figures(results, pressure), summary | {"device": engine_device({})}


def add_command(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("longcontext", help="EntropyInfer's layers against dense, 2K-8K")
    parser.add_argument("--model", help="a .gguf file, a folder or an installed model's name")
    parser.add_argument(
        "--lengths", type=positive_int, nargs="+", default=[2048, 4096, 6144, 7168, 8064]
    )
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument(
        "--steps", type=positive_int, default=48, help="forced decode steps per prompt"
    )
    parser.add_argument("--passkey-min", type=int, default=7168, help="shortest passkey prompt")
    parser.add_argument("--no-pressure", dest="pressure", action="store_false")
    parser.add_argument("--pressure-requests", type=positive_int, default=6)
    parser.add_argument("--pressure-tokens", type=positive_int, default=256)
    parser.add_argument("--repeats", type=positive_int, default=2)
    parser.add_argument("--offset", type=int, default=20000, help="where the text starts")
    parser.add_argument("--no-passkeys", dest="passkeys", action="store_false")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="results/longcontext")
    options.add_threads_option(parser, default=2)
    add_result_option(parser)
    parser.set_defaults(func=recorded("longcontext", run, PROGRAM))
