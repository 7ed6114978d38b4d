"""Speculative decoding against plain decoding, side by side in one run.

Two workloads, both chat-templated: ``chat`` (the instructions of ``bench/common/prompts.py``) and
``copy`` (rewrite a passage of Python's own reference documentation, ``pydoc_data``, shipped with
the standard library, word for word: summarising or editing text repeats long runs of it). Each
drafting setting runs every batch size on its own engine over the same weights; the rounds
alternate settings. A setting's rate is its best round; its ratio to the plain engine is the
median over rounds of the two rates measured in the same round, with their range (a shared
machine moves plain decoding by a tenth between rounds, and a ratio of two bests carries both
rounds' luck). Greedy decoding, so every setting produces the same tokens and only the time
differs (the tests check the equality).

    python -m studies speculative --batches 1 4 16

The run's result holds each setting's output tokens/s per workload and batch, its ratio to the
plain engine's (the plain engine with the paper's layers, for settings with them) and its
acceptance (its ``details``: every row, and whether its tokens equal the plain engine's).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from statistics import median

from etinfer import LLM, ControlConfig, SamplingParams, SpeculativeConfig, options
from etinfer.bench.common.machine import cpu_flags
from etinfer.bench.common.prompts import instructions
from etinfer.bench.common.results import Figure, add_result_option, engine_device, recorded
from etinfer.corpus import topics
from etinfer.model.loader import load_model
from etinfer.options import positive_int
from studies import PROGRAM

DRAFT = SpeculativeConfig(method="draft")
# Engine settings by name; "paper's layers" rows compare with the plain engine with those layers.
SETTINGS: dict[str, dict] = {
    "plain": {},
    "ngram fixed": {"speculative": SpeculativeConfig(adaptive=False)},
    "ngram heuristic": {"speculative": SpeculativeConfig(adaptive="heuristic")},
    "ngram entropy (default)": {"speculative": SpeculativeConfig()},
    "ngram entropy, cost not weighed": {"speculative": SpeculativeConfig(weigh_cost=False)},
    "plain, paper's layers": {"control": ControlConfig.full()},
    "ngram, paper's layers": {"speculative": SpeculativeConfig(), "control": ControlConfig.full()},
    **{
        f"self:{n}{name}": {"draft_model": f"self:{n}", "speculative": config}
        for n in (8, 10, 22, 26)
        for name, config in (
            (" entropy", DRAFT),
            (" fixed", replace(DRAFT, adaptive=False)),
            (" no adapter", replace(DRAFT, exit_adapter=False)),
            (" entropy, cost not weighed", replace(DRAFT, weigh_cost=False)),
        )
    },
}


def passages(n: int, chars: int = 700) -> list[str]:
    """``n`` passages of about ``chars`` characters, whole paragraphs, in a fixed order."""
    texts = []
    for topic in topics():
        text = ""
        for paragraph in topic.split("\n\n")[1:]:
            if len(text) + len(paragraph) > chars:
                break
            text += paragraph + "\n\n"
        if len(text) > chars // 2:
            texts.append(text.strip())
    return [texts[i % len(texts)] for i in range(n)]


def workload(llm: LLM, kind: str, n: int) -> list[list[int]]:
    if kind == "chat":
        asks = instructions(n)
    else:
        asks = [f"Rewrite this text word for word:\n\n{text}" for text in passages(n)]
    return [llm.tokenizer.encode_chat([{"role": "user", "content": ask}]) for ask in asks]


def generate_timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    """The rate, the acceptance, and the tokens asked of the drafter per 100 generated (what
    drafting cost, whatever it proposed: the same count at any speed of the host)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    speculator = llm.engine.speculator
    asked_before = 0 if speculator is None else speculator.tokens_asked
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    drafted = sum(o.num_draft_tokens for o in outs)
    generated = sum(len(o.token_ids) for o in outs)
    asked = None if speculator is None else speculator.tokens_asked - asked_before
    return {
        "tok_s": generated / wall,
        "acceptance": sum(o.num_accepted_tokens for o in outs) / drafted if drafted else None,
        "asked": None if asked is None else 100 * asked / generated,
        "tokens": [o.token_ids for o in outs],
    }


def run(args: argparse.Namespace) -> tuple[list[Figure], dict]:
    options.set_threads(args)
    loaded = load_model()
    names = [name for name in SETTINGS if name in args.settings]
    engines = {}
    for name in names:
        engines[name] = LLM(loaded, max_num_seqs=max(args.batches), **SETTINGS[name])
    results: dict[tuple[str, str, int], dict] = {}
    rounds: list[dict[tuple[str, str, int], float]] = []
    asked: list[dict[tuple[str, str, int], float]] = []  # per round, where a drafter runs
    for _ in range(args.repeats):
        rounds.append({})
        asked.append({})
        for kind in args.workloads:
            for batch in args.batches:
                for name in names:
                    llm = engines[name]
                    prompts = workload(llm, kind, batch)
                    llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm
                    result = generate_timed(llm, prompts, args.max_tokens)
                    key = (kind, name, batch)
                    rounds[-1][key] = result["tok_s"]
                    if result["asked"] is not None:
                        asked[-1][key] = result["asked"]
                    if key not in results or result["tok_s"] > results[key]["tok_s"]:
                        results[key] = result
                    print(f"{kind} b={batch} {name}: {result['tok_s']:.1f} tok/s", flush=True)
    print(f"\n{args.threads} threads, CPU flags: {cpu_flags()}, {args.max_tokens} tokens, greedy")
    print(table(results, args.workloads, names, args.batches))
    rows = []
    for (kind, name, batch), r in results.items():
        base = results.get((kind, reference(name), batch))
        same = None if base is None else r["tokens"] == base["tokens"]
        row = {"workload": kind, "setting": name, "batch": batch, "tok_s": r["tok_s"]}
        rows.append(row | {"acceptance": r["acceptance"], "same_tokens": same})
    details = {"device": engine_device({}), "rows": rows}
    details["rounds"] = [
        [
            {"workload": k, "setting": n, "batch": b, "tok_s": v, "asked": a.get((k, n, b))}
            for (k, n, b), v in r.items()
        ]
        for r, a in zip(rounds, asked, strict=True)
    ]
    return figures(results, rounds) + asked_figures(asked), details


def reference(name: str) -> str:
    """The setting a setting's speed is compared with: the plain engine, with the paper's
    layers where the setting has them."""
    return "plain, paper's layers" if "paper" in name else "plain"


def figures(results: dict, rounds: list[dict[tuple[str, str, int], float]]) -> list[Figure]:
    """Each setting's best rate, its ratio to its reference (the median of the rounds' ratios,
    their range as the spread) and its acceptance."""
    found = []
    for (kind, name, batch), r in results.items():
        labels = {"workload": kind, "arm": name, "batch": batch}
        found.append(Figure("throughput", r["tok_s"], "tok/s", labels, n=len(rounds)))
        base = (kind, reference(name), batch)
        if base in results and name != reference(name):
            ratios = [tok_s[kind, name, batch] / tok_s[base] for tok_s in rounds]
            spread = {"min": min(ratios), "max": max(ratios)}
            versus = labels | {"vs": reference(name)}
            found.append(Figure("throughput", median(ratios), "x", versus, spread, len(ratios)))
        if r["acceptance"] is not None:
            found.append(Figure("acceptance", 100 * r["acceptance"], "%", labels))
    return found


def asked_figures(asked: list[dict[tuple[str, str, int], float]]) -> list[Figure]:
    """Per drafting setting, the tokens asked of its drafter per 100 generated: the median
    over rounds, their range the spread, and the first round's (an engine learns there what
    its drafter earns)."""
    found = []
    for key in asked[0] if asked else ():
        kind, name, batch = key
        values = [a[key] for a in asked]
        labels = {"workload": kind, "arm": name, "batch": batch}
        spread = {"min": min(values), "max": max(values)}
        found.append(Figure("drafter tokens asked", median(values), "per 100", labels, spread))
        first = labels | {"round": "first"}
        found.append(Figure("drafter tokens asked", values[0], "per 100", first))
    return found


def table(results: dict, workloads: list[str], names: list[str], batches: list[int]) -> str:
    lines = [
        "| workload | setting | " + " | ".join(f"b={b} tok/s" for b in batches) + " | acceptance |",
        "|---|---|" + "---:|" * (len(batches) + 1),
    ]
    for kind in workloads:
        for name in names:
            base = reference(name)
            cells = []
            for b in batches:
                r, ref = results[(kind, name, b)], results.get((kind, base, b))
                cell = f"{r['tok_s']:.1f}"
                if ref is not None and name != base:
                    cell += f" ({r['tok_s'] / ref['tok_s']:.2f}x)"
                    if "paper" not in name and r["tokens"] != ref["tokens"]:
                        cell += " DIFFERS"
                cells.append(cell)
            rates = [results[(kind, name, b)]["acceptance"] for b in batches]
            accepted = " / ".join("-" if a is None else f"{a:.0%}" for a in rates)
            lines.append(f"| {kind} | {name} | " + " | ".join(cells) + f" | {accepted} |")
    return "\n".join(lines)


def add_command(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("speculative", help="speculative decoding against plain decoding")
    parser.add_argument("--batches", type=positive_int, nargs="+", default=[1, 4, 16])
    parser.add_argument(
        "--workloads", nargs="+", choices=["chat", "copy"], default=["copy", "chat"]
    )
    parser.add_argument(
        "--settings",
        nargs="+",
        choices=list(SETTINGS),
        default=[name for name in SETTINGS if not name.startswith("self:")],
    )
    parser.add_argument("--max-tokens", type=positive_int, default=128)
    parser.add_argument("--repeats", type=positive_int, default=2)
    options.add_threads_option(parser, default=2)
    add_result_option(parser)
    parser.set_defaults(func=recorded("speculative", run, PROGRAM))
