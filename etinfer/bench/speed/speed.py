"""Engine speed against transformers, side by side in one run.

1. Throughput: the same prompts, greedy, a fixed number of output tokens (EOS ignored), at
   several batch sizes; tokens per second of our engine and of transformers ``generate``
   (batched with left padding), prefill included.
2. Decode step time against context length: sequences holding L tokens of context each decode
   one token per step; median step time. Ours runs real prefills of distinct texts first. For
   transformers a ``DynamicCache`` is filled with random keys and values of the same length
   (a decode step's time does not depend on what the cache holds; this saves minutes of its
   prefill per point).
3. Prefill: one prompt of L tokens to its first token, tokens per second (``--prefill-contexts``).

Transformers runs on the engine's device in the engine's weight dtype (float32 on the CPU,
bfloat16 on CUDA), from the same file or folder.

    etinfer bench speed --batch-sizes 1 16 --contexts 2048 8000

The run's result holds each figure of both engines and our ratio to transformers (its
``details``: the rows as printed).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from etinfer import options
from etinfer.bench.common.decode_steps import context_prompts, decode_budget, ours_decode_step_ms
from etinfer.bench.common.prompts import TOPICS
from etinfer.bench.common.results import Figure, add_result_option, model_labels, recorded
from etinfer.bench.common.timing import synchronized_clock
from etinfer.llm import LLM
from etinfer.model.catalog import resolve
from etinfer.options import positive_int
from etinfer.sampling_params import SamplingParams


def prompts(n: int) -> list[str]:
    return [f"Write a detailed essay about {TOPICS[i % len(TOPICS)]}." for i in range(n)]


@dataclass
class ThroughputRow:
    batch: int
    output_len: int
    ours_tok_s: float
    transformers_tok_s: float | None

    @property
    def ratio(self) -> float | None:
        return (
            None if self.transformers_tok_s is None else self.ours_tok_s / self.transformers_tok_s
        )


@dataclass
class StepRow:
    batch: int
    context: int
    ours_ms: float
    transformers_ms: float | None

    @property
    def ratio(self) -> float | None:
        return None if self.transformers_ms is None else self.ours_ms / self.transformers_ms


@dataclass
class PrefillRow:
    context: int
    ours_tok_s: float
    transformers_tok_s: float | None

    @property
    def ratio(self) -> float | None:
        if self.transformers_tok_s is None:
            return None
        return self.ours_tok_s / self.transformers_tok_s


def ours_throughput(llm: LLM, batch: int, output_len: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts(batch), SamplingParams(temperature=0, max_tokens=2))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts(batch), params)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / elapsed


def transformers_throughput(model, tokenizer, batch: int, output_len: int) -> float:
    encoded = [tokenizer.encode(p) for p in prompts(batch)]
    width = max(map(len, encoded))
    ids = torch.tensor([[0] * (width - len(e)) + e for e in encoded], device=model.device)
    mask = torch.tensor(
        [[0] * (width - len(e)) + [1] * len(e) for e in encoded], device=model.device
    )
    kwargs = dict(attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, **kwargs)  # warm-up
        start = synchronized_clock(model.device)
        model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
    return batch * output_len / (synchronized_clock(model.device) - start)


def ours_prefill_tok_s(llm: LLM, context: int) -> float:
    """One prompt of ``context`` tokens to its first token (the engine's chunked prefill)."""
    prompt, other = context_prompts(llm, 2, context)
    params = SamplingParams(temperature=0, max_tokens=1)
    # A warm-up on other text, a chunk longer where the context allows, so that the timed
    # prefill's second kind of chunk (one after a prefix) is not the first of its kind either.
    llm.generate([other[: llm.engine.config.max_num_batched_tokens + 64]], params)
    start = time.perf_counter()
    llm.generate([prompt], params)
    return context / (time.perf_counter() - start)


def transformers_prefill_tok_s(model, llm: LLM, context: int) -> float:
    ids = torch.tensor([context_prompts(llm, 1, context)[0]], device=model.device)
    with torch.no_grad():
        model(ids[:, :64], logits_to_keep=1)  # warm-up
        start = synchronized_clock(model.device)
        model(ids, logits_to_keep=1)
    return context / (synchronized_clock(model.device) - start)


def transformers_decode_step_ms(model, batch: int, context: int, steps: int) -> float:
    from transformers import DynamicCache

    config = model.config
    heads = config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = DynamicCache(config=config)
    device, dtype = model.device, model.dtype
    for layer in range(config.num_hidden_layers):
        shape = (batch, heads, context, dim)
        keys, values = (torch.randn(shape, device=device, dtype=dtype) for _ in "kv")
        cache.update(keys, values, layer)
    ids = torch.randint(0, config.vocab_size, (batch, 1), device=device)
    times = []
    with torch.no_grad():
        for i in range(steps + 1):
            position = torch.full((batch, 1), context + i, device=device)
            start = synchronized_clock(device)
            model(
                ids, past_key_values=cache, use_cache=True, position_ids=position, logits_to_keep=1
            )
            times.append(synchronized_clock(device) - start)
    return statistics.median(times[1:]) * 1000


def load_transformers_model(
    model: str | None = None, device: torch.device | None = None, dtype: torch.dtype = torch.float32
):
    """transformers' model of a GGUF file or folder (default: the embedded model), read by its
    own loader, on ``device`` in ``dtype``."""
    from transformers import AutoModelForCausalLM

    path = resolve(model)
    if path.is_dir():
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        reference = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=dtype
        )
    return reference.to(device or torch.device("cpu")).eval()


def row_figures(row: ThroughputRow | StepRow | PrefillRow, model: dict) -> list[Figure]:
    """Both engines' figure of a row, and ours over transformers' (``model``: its labels)."""
    if isinstance(row, ThroughputRow):
        subject, unit, ours, theirs = "throughput", "tok/s", row.ours_tok_s, row.transformers_tok_s
        labels = {"batch": row.batch, "tokens": row.output_len}
    elif isinstance(row, StepRow):
        subject, unit, ours, theirs = "decode step", "ms", row.ours_ms, row.transformers_ms
        labels = {"batch": row.batch, "context": row.context}
    else:
        subject, unit, ours, theirs = "prefill", "tok/s", row.ours_tok_s, row.transformers_tok_s
        labels = {"context": row.context}
    labels |= model
    found = [Figure(subject, ours, unit, {"engine": "etinfer"} | labels)]
    if theirs is not None:
        found.append(Figure(subject, theirs, unit, {"engine": "transformers"} | labels))
        versus = {"engine": "etinfer", "vs": "transformers"} | labels
        found.append(Figure(subject, row.ratio, "x", versus))
    return found


def run(args: argparse.Namespace) -> tuple[list[Figure], dict]:
    torch.manual_seed(0)
    chunk = args.max_num_batched_tokens
    batch, context = max(args.context_batches), max(args.contexts)
    longest = context + decode_budget(batch, context, args.steps, chunk)
    llm = LLM(
        args.model,
        max_num_seqs=max(args.batch_sizes + args.context_batches),
        num_kvcache_blocks=batch * (longest // args.block_size + 1) + 64,
        **options.engine_kwargs(args),
    )
    config = llm.engine.config
    reference = None
    if not args.skip_transformers:
        reference = load_transformers_model(
            config.model, config.torch_device(), config.torch_dtype()
        )
    throughput = []
    for batch in args.batch_sizes:
        ours = ours_throughput(llm, batch, args.output_len)
        theirs = (
            None
            if reference is None
            else transformers_throughput(reference, llm.tokenizer, batch, args.output_len)
        )
        throughput.append(ThroughputRow(batch, args.output_len, ours, theirs))
        print_row(throughput[-1])
    step_rows = []
    for batch in args.context_batches:
        for context in args.contexts:
            ours = ours_decode_step_ms(llm, batch, context, args.steps)
            theirs = (
                None
                if reference is None
                else transformers_decode_step_ms(reference, batch, context, args.steps)
            )
            step_rows.append(StepRow(batch, context, ours, theirs))
            print_row(step_rows[-1])
    prefill_rows = []
    for context in args.prefill_contexts:
        ours = ours_prefill_tok_s(llm, context)
        theirs = None if reference is None else transformers_prefill_tok_s(reference, llm, context)
        prefill_rows.append(PrefillRow(context, ours, theirs))
        print_row(prefill_rows[-1])
    report = {
        "device": str(config.torch_device()),
        "threads": torch.get_num_threads(),
        "throughput": [asdict(r) | {"ratio": r.ratio} for r in throughput],
        "decode_step": [asdict(r) | {"ratio": r.ratio} for r in step_rows],
        "prefill": [asdict(r) | {"ratio": r.ratio} for r in prefill_rows],
    }
    rows = [*throughput, *step_rows, *prefill_rows]
    model = model_labels(resolve(args.model))
    return [f for row in rows for f in row_figures(row, model)], report


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_row(row: ThroughputRow | StepRow | PrefillRow) -> None:
    if isinstance(row, PrefillRow):
        print(
            f"prefill     context {row.context:5d}: ours {row.ours_tok_s:9.1f} tok/s, "
            f"transformers {_fmt(row.transformers_tok_s, '9.1f')} tok/s, "
            f"ratio {_fmt(row.ratio, '.2f')}x",
            flush=True,
        )
    elif isinstance(row, ThroughputRow):
        print(
            f"throughput  batch {row.batch:3d}: ours {row.ours_tok_s:7.1f} tok/s, "
            f"transformers {_fmt(row.transformers_tok_s, '7.1f')} tok/s, "
            f"ratio {_fmt(row.ratio, '.2f')}x",
            flush=True,
        )
    else:
        print(
            f"decode step batch {row.batch:3d} context {row.context:5d}: "
            f"ours {row.ours_ms:7.1f} ms, transformers {_fmt(row.transformers_ms, '7.1f')} ms, "
            f"ratio {_fmt(row.ratio, '.2f')}x",
            flush=True,
        )


def add_command(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("speed", help="throughput and decode step time against transformers")
    options.add_engine_options(
        parser,
        # Sized for the largest batch and context asked.
        exclude=("control", "max_num_seqs", "num_kvcache_blocks", "kv_cache_gib"),
        # The same prompts run repeatedly: measure compute, not the prefix cache.
        defaults={"max_num_batched_tokens": 2048, "enable_prefix_caching": False},
    )
    parser.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--output-len", type=positive_int, default=128)
    parser.add_argument(
        "--contexts", type=positive_int, nargs="+", default=[512, 1024, 2048, 4096, 8000]
    )
    parser.add_argument("--context-batches", type=positive_int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=positive_int, default=8)
    parser.add_argument("--prefill-contexts", type=int, nargs="*", default=[])
    parser.add_argument("--skip-transformers", action="store_true")
    add_result_option(parser)
    parser.set_defaults(func=recorded("speed", run))
