"""Speed of two checkouts of etinfer, alternated: does a change that should not touch speed keep it?

    python benchmarks/ab_speed.py BEFORE_TREE AFTER_TREE --rounds 6

Each round runs one child per tree, in alternating order (so a drift of the machine falls on both),
with that tree on ``PYTHONPATH``: the default model and engine, greedy decode of 64 tokens at
batch 1 and 16 and one prefill of about 1,500 tokens. It prints one table of medians, ranges and
the after/before ratio. Prompts come from Python's own ``pydoc_data`` (nothing downloaded).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def child() -> None:
    import pydoc_data.topics

    from etinfer import LLM, SamplingParams

    llm = LLM(max_num_seqs=16)
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    topics = pydoc_data.topics.topics
    prompts = [topics[name][:200] for name in sorted(topics)[:16]]
    long_prompt = "\n\n".join(topics[name] for name in sorted(topics)[:8])[:6000]
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    figures = {}
    for batch in (1, 16):
        start = time.perf_counter()
        outs = llm.generate(prompts[:batch], greedy)
        tokens = sum(len(out.token_ids) for out in outs)
        figures[f"decode b{batch} tok/s"] = tokens / (time.perf_counter() - start)
    start = time.perf_counter()
    out = llm.generate([long_prompt], SamplingParams(temperature=0, max_tokens=1))[0]
    figures["prefill tok/s"] = len(out.prompt_token_ids) / (time.perf_counter() - start)
    print(json.dumps(figures))


def run(tree: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=tree, OMP_WAIT_POLICY="PASSIVE")
    command = [sys.executable, os.path.abspath(__file__), "--child"]
    done = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trees", nargs="*", metavar="TREE", help="before and after")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child()
    if len(args.trees) != 2:
        parser.error(f"trees: give two, BEFORE and AFTER; got {len(args.trees)}")
    if args.rounds < 1:
        parser.error(f"--rounds: at least 1, got {args.rounds}")
    runs: dict[str, list[dict[str, float]]] = {tree: [] for tree in args.trees}
    for number in range(args.rounds):
        for tree in args.trees if number % 2 == 0 else reversed(args.trees):
            runs[tree].append(run(tree))
    before, after = (runs[tree] for tree in args.trees)
    print("| figure | before: median (range) | after: median (range) | after / before |")
    print("|---|---:|---:|---:|")
    for key in before[0]:
        b, a = [r[key] for r in before], [r[key] for r in after]
        ratio = statistics.median(a) / statistics.median(b)
        print(
            f"| {key} | {statistics.median(b):.1f} ({min(b):.1f}-{max(b):.1f}) "
            f"| {statistics.median(a):.1f} ({min(a):.1f}-{max(a):.1f}) | {ratio:.3f} |"
        )


if __name__ == "__main__":
    main()
