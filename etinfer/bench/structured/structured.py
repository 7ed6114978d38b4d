"""``etinfer bench structured``: what a grammar costs and whether its outputs hold.

In one run, on the twenty schemas of ``schemas.py``:

- compile time of each schema (a fresh compiler, no cache);
- decode tokens/s with every request constrained (without jump-forward, the default, and
  with it) against the same requests unconstrained (each made to generate the same number of
  tokens: ``ignore_eos`` and the constrained run's lengths), at batch 1 and at batch 16, and
  the mask's own cost per token (filling and unpacking it, replayed over the constrained
  outputs);
- through the ``openai`` client against ``etinfer serve``: ``--requests`` chat requests over
  the schemas (half streamed) mixed with free completions, each constrained reply parsed and
  validated with ``jsonschema``.

The run's result holds the compile times, the decode rates with their ratios to free decoding,
the mask's cost and the valid replies (its ``details``: every row).
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from etinfer import LLM, SamplingParams
from etinfer.bench.common.machine import machine
from etinfer.bench.common.results import Figure, add_result_option, recorded
from etinfer.bench.structured.schemas import SCHEMAS, schema_format
from etinfer.model.loader import load_model
from etinfer.options import positive_int
from etinfer.structured.compiler import backend_class
from etinfer.structured.masks import fill_allowed
from etinfer.structured.params import StructuredOutputsParams


def compile_times(llm: LLM) -> list[float]:
    """Each schema compiled once by a backend of its own: engines share compiled grammars, so
    the engine's compiler would time a cache for any schema an engine compiled before."""
    engine = llm.engine
    backend = backend_class(engine.config.structured_backend)(
        engine.tokenizer, engine.model_config.vocab_size
    )
    times = []
    for _, _, schema in SCHEMAS:
        started = time.perf_counter()
        backend.compile(StructuredOutputsParams(json=schema))
        times.append(time.perf_counter() - started)
    return times


def decode_speed(llm: LLM, jump: LLM, batch: int, max_tokens: int) -> dict:
    prompts = [
        llm.tokenizer.encode_chat([{"role": "user", "content": prompt}]) for _, prompt, _ in SCHEMAS
    ]
    constrained = [
        SamplingParams(temperature=0.0, max_tokens=max_tokens, structured={"json": schema})
        for _, _, schema in SCHEMAS
    ]
    for engine in (llm, jump):
        engine.generate(prompts, constrained)  # warm up (and compile every grammar)

    def run(params: list[SamplingParams], engine: LLM = llm) -> tuple[float, list]:
        started, outputs = time.perf_counter(), []
        for i in range(0, len(prompts), batch):
            outputs += engine.generate(prompts[i : i + batch], params[i : i + batch])
        return time.perf_counter() - started, outputs

    seconds_c, outputs = run(constrained)
    seconds_j, _ = run(constrained, jump)
    lengths = [len(o.token_ids) for o in outputs]
    free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    seconds_f, _ = run(free)
    tokens = sum(lengths)
    return {
        "batch": batch,
        "tokens": tokens,
        "constrained_tok_s": tokens / seconds_c,
        "jump_forward_tok_s": tokens / seconds_j,
        "free_tok_s": tokens / seconds_f,
        "ratio": seconds_f / seconds_c,
        "jump_forward_ratio": seconds_f / seconds_j,
        "outputs": outputs,
    }


def mask_cost_per_token(llm: LLM, outputs: list) -> float:
    """Seconds per token to fill and unpack one row's mask, replayed over real outputs."""
    compiler = llm.engine.grammars.compiler
    vocab = llm.engine.model_config.vocab_size
    seconds, tokens = 0.0, 0
    for (_, _, schema), out in zip(SCHEMAS, outputs, strict=True):
        matcher = compiler.compile(StructuredOutputsParams(json=schema)).matcher()
        for token in out.token_ids:
            started = time.perf_counter()
            fill_allowed([matcher], vocab)
            seconds += time.perf_counter() - started
            matcher.accept(token)
            tokens += 1
    return seconds / tokens


def served(requests: int, model: str | None, concurrency: int) -> dict:
    import jsonschema
    import openai

    from etinfer.bench.common.local_server import local_server

    flags = ["--max-num-seqs", "16"] + (["--model", model] if model else [])
    with local_server(flags) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        name = client.models.list().data[0].id

        def constrained(i: int) -> bool:
            schema_name, prompt, schema = SCHEMAS[i % len(SCHEMAS)]
            kwargs = dict(
                model=name,
                messages=[{"role": "user", "content": prompt}],
                temperature=0.7,
                seed=i,
                max_tokens=256,
                response_format=schema_format(schema_name, schema),
            )
            if i % 2:
                text = "".join(
                    c.choices[0].delta.content or ""
                    for c in client.chat.completions.create(stream=True, **kwargs)
                    if c.choices
                )
            else:
                text = client.chat.completions.create(**kwargs).choices[0].message.content
            try:
                jsonschema.validate(json.loads(text), schema)
                return True
            except (ValueError, jsonschema.ValidationError):
                return False

        def free(i: int) -> int:
            reply = client.completions.create(
                model=name, prompt="Once upon a time", max_tokens=32, seed=i, temperature=1.0
            )
            return reply.usage.completion_tokens

        started = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            frees = [pool.submit(free, i) for i in range(requests // 4)]
            valid = list(pool.map(constrained, range(requests)))
            free_tokens = sum(f.result() for f in frees)
        return {
            "requests": requests,
            "valid": sum(valid),
            "free_requests": len(frees),
            "free_tokens": free_tokens,
            "seconds": time.perf_counter() - started,
        }


def figures(times: list[float], rows: list[dict]) -> list[Figure]:
    median = sorted(times)[len(times) // 2]  # as printed: one schema's own time
    found = [
        Figure("compile time", 1000 * median, "ms", {"statistic": "median"}, n=len(times)),
        Figure("compile time", 1000 * max(times), "ms", {"statistic": "max"}, n=len(times)),
    ]
    for row in rows:
        if "batch" not in row:  # through the server
            valid = 100 * row["valid"] / row["requests"]
            found.append(Figure("valid replies", valid, "%", n=row["requests"]))
            continue
        batch, n = row["batch"], row["tokens"]
        for arm, rate, ratio in (
            ("constrained", "constrained_tok_s", "ratio"),
            ("jump-forward", "jump_forward_tok_s", "jump_forward_ratio"),
        ):
            labels = {"arm": arm, "batch": batch}
            found.append(Figure("decode", row[rate], "tok/s", labels, n=n))
            # Free time over constrained time: the constrained rate over the free one.
            found.append(Figure("decode", row[ratio], "x", labels | {"vs": "free"}, n=n))
        found.append(Figure("decode", row["free_tok_s"], "tok/s", {"arm": "free", "batch": batch}))
        found.append(Figure("mask cost", row["mask_ms_per_token"], "ms", {"batch": batch}, n=n))
    return found


def run(args: argparse.Namespace) -> tuple[list[Figure], dict]:
    torch.set_num_threads(args.threads)
    print(json.dumps(machine()))
    loaded = load_model(args.model)
    llm = LLM(loaded, max_num_seqs=16)
    jump = LLM(loaded, max_num_seqs=16, jump_forward=True)
    times = compile_times(llm)
    print(
        f"compile: median {sorted(times)[len(times) // 2] * 1e3:.1f} ms, "
        f"max {max(times) * 1e3:.1f} ms over {len(times)} schemas"
    )
    rows = []
    for batch in args.batches:
        row = decode_speed(llm, jump, batch, args.max_tokens)
        outputs = row.pop("outputs")
        row["mask_ms_per_token"] = mask_cost_per_token(llm, outputs) * 1e3
        rows.append(row)
        print(
            f"batch {batch:>2}: constrained {row['constrained_tok_s']:.1f} tok/s "
            f"(jump-forward {row['jump_forward_tok_s']:.1f}), free {row['free_tok_s']:.1f} tok/s, "
            f"ratio {row['ratio']:.3f} ({row['jump_forward_ratio']:.3f}); "
            f"mask {row['mask_ms_per_token']:.3f} ms/token ({row['tokens']} tokens)"
        )
    if args.requests:
        result = served(args.requests, args.model, args.concurrency)
        print(
            f"server: {result['valid']}/{result['requests']} constrained replies valid, "
            f"beside {result['free_requests']} free requests, in {result['seconds']:.0f} s"
        )
        rows.append(result)
    device = str(llm.engine.config.torch_device())
    report = {"threads": args.threads, "device": device, "compile_s": times, "rows": rows}
    return figures(times, rows), report


def add_command(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("structured", help="grammar-constrained decoding: cost, validity")
    parser.add_argument("--model", help="a .gguf file or folder (default: the embedded model)")
    parser.add_argument("--batches", type=positive_int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=positive_int, default=256)
    parser.add_argument("--requests", type=int, default=200, help="through the server (0: skip)")
    parser.add_argument("--concurrency", type=positive_int, default=16)
    parser.add_argument("--threads", type=positive_int, default=2)
    add_result_option(parser)
    parser.set_defaults(func=recorded("structured", run))
