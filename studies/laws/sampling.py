"""Samplers side by side on the real model: entropy tracking, text quality, estimator cost and
fidelity, and entropy/temperature traces.

    python -m studies sampling --output-dir results/sampling

Every sampler runs on the same chat prompts (generated from topics and instruction forms, see
``bench/common/prompts.py``) with the same seed, up to ``--max-tokens`` tokens or EOS.

- **Entropy columns** read the distribution each token was drawn from (``tempered_entropies``).
  The tracking error is their mean distance from 2 nats, the entropy controllers' target.
- **Quality columns** are those of ``bench/common/quality.py``.
- **Estimator overhead** is measured on real logits against the engine's own decode step at the
  same batch size.
- **Estimator fidelity** compares each estimator with the exact entropy on real logits of the
  fixed-temperature generations, teacher-forced. It also compares the temperature that the
  feedback law would pick from each estimate.

``--output-dir`` keeps every generation (``generations.jsonl``), the tables (``sampling.md``),
the traces' plot and the report (``sampling.json``, the result's ``details``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from etinfer import options
from etinfer.bench.common.decode_steps import ours_decode_step_ms
from etinfer.bench.common.prompts import instructions
from etinfer.bench.common.results import Figure, add_result_option, recorded
from etinfer.bench.common.timing import median_ms
from etinfer.control.entropy import TemperedEntropy, entropy, softmax_entropy, topk_bounds
from etinfer.control.temperature import feedback_step, solve_log_temperature
from etinfer.llm import LLM
from etinfer.options import positive_int
from etinfer.outputs import RequestOutput
from etinfer.sampling_params import DEFAULT_ENTROPY_GAIN, SamplingParams
from studies import PROGRAM
from studies.common.plots import pyplot
from studies.common.quality import summarize
from studies.laws.sampling_report import figures, markdown

TARGET = 2.0
SAMPLERS: dict[str, dict] = {
    "fixed T=1.0": dict(temperature=1.0),
    "fixed T=0.7": dict(temperature=0.7),
    "min-p 0.1": dict(temperature=1.0, min_p=0.1),
    "mirostat v2 (tau 5 bits)": dict(temperature=1.0, mirostat_tau=5.0, mirostat_eta=0.1),
    "EDT (theta 1, N 0.8)": dict(temperature=1.0, edt_theta=1.0, edt_base=0.8),
    "lagged law (paper), H*=2": dict(
        temperature=1.0, entropy_target=TARGET, entropy_control="lagged"
    ),
    "feedback, H*=2": dict(temperature=1.0, entropy_target=TARGET),
    "exact, H*=2": dict(temperature=1.0, entropy_target=TARGET, entropy_control="exact"),
}
ESTIMATOR_KS = (16, 64, 256)


def run_samplers(
    llm: LLM, prompts: list[list[int]], max_tokens: int, seed: int, record: Path
) -> dict[str, list[RequestOutput]]:
    """Generate with every sampler; each one's generations are appended to ``record`` (JSON
    lines) as soon as it finishes, so a long run leaves its data behind whatever follows."""
    fields = ("token_ids", "entropies", "tempered_entropies", "temperatures")
    results = {}
    with record.open("w") as file:
        for name, settings in SAMPLERS.items():
            start = time.perf_counter()
            params = SamplingParams(max_tokens=max_tokens, seed=seed, **settings)
            results[name] = llm.generate(prompts, params)
            tokens = sum(len(o.token_ids) for o in results[name])
            elapsed = time.perf_counter() - start
            print(f"  {name:28s} {tokens:7d} tokens in {elapsed:6.1f} s", flush=True)
            for o in results[name]:
                file.write(
                    json.dumps({"sampler": name} | {f: getattr(o, f) for f in fields}) + "\n"
                )
            file.flush()
    return results


def sampler_row(outs: list[RequestOutput], max_tokens: int) -> dict:
    tempered = [h for o in outs for h in o.tempered_entropies]
    return {
        "tokens": len(tempered),
        "entropy_mean": statistics.fmean(tempered),
        "entropy_sd": statistics.pstdev(tempered),
        "tracking_mae": statistics.fmean(abs(h - TARGET) for h in tempered),
        "model_entropy_mean": statistics.fmean(h for o in outs for h in o.entropies),
        "temperature_mean": statistics.fmean(t for o in outs for t in o.temperatures),
        "collapse_rate": statistics.fmean(o.collapse_rate for o in outs),
        **summarize(
            [o.token_ids for o in outs],
            hit_max_tokens=[
                o.finish_reason == "length" and len(o.token_ids) == max_tokens for o in outs
            ],
        ),
    }


def generated_logits(llm: LLM, outs: list[RequestOutput], positions: int) -> torch.Tensor:
    """Real logits at generated positions, teacher-forced, up to ``positions`` rows."""
    rows, have = [], 0
    for out in outs:
        if have >= positions:
            break
        logits = llm.engine.score(out.prompt_token_ids + out.token_ids)
        rows.append(logits[len(out.prompt_token_ids) - 1 : -1])
        have += rows[-1].shape[0]
    return torch.cat(rows)[:positions]


def estimator_overhead(llm: LLM, logits: torch.Tensor, batches: tuple[int, ...]) -> list[dict]:
    """Per batch size: what measuring entropy adds to a decode step, on real logits.

    The baselines are what a sampler does without entropy: argmax for greedy rows, one softmax
    for sampled rows. Over those, the exact entropy costs a softmax and a dot product (greedy)
    or only the dot product (sampled: the softmax is there already); the top-k estimators cost a
    top-k selection. The two laws are timed as the sampler runs them.
    """
    rows = []
    for batch in batches:
        z = logits[:batch].contiguous()
        probs = z.softmax(-1)
        lse = z.logsumexp(-1)
        ones = torch.ones(batch)
        # The exact law starts from the previous position's solution, as in the engine.
        solve = partial(
            solve_log_temperature, target=ones * TARGET, u_min=ones * -2.3, u_max=ones * 0.4
        )
        previous = solve(TemperedEntropy(logits[1 : batch + 1]), u_start=ones * 0.0)
        argmax_ms = median_ms(lambda z=z: z.max(-1))
        costs = {
            "exact, greedy rows (softmax + dot over argmax)": median_ms(
                lambda z=z: softmax_entropy(z)
            )
            - argmax_ms,
            "exact, sampled rows (dot over the softmax)": median_ms(
                lambda p=probs, z=z: torch.linalg.vecdot(p, z)
            ),
            **{
                f"top-k + tail bounds, k={k}": median_ms(
                    lambda k=k, z=z, lse=lse: topk_bounds(z, k, lse)
                )
                for k in ESTIMATOR_KS
            },
            "feedback law (one estimate at the carried T)": median_ms(
                lambda z=z: softmax_entropy(z / 0.8)
            ),
            "exact law (warm-started solve)": median_ms(
                lambda z=z, u=previous, solve=solve: solve(TemperedEntropy(z), u_start=u)
            ),
        }
        step_ms = ours_decode_step_ms(llm, batch, context=128, steps=8)
        for name, ms in costs.items():
            rows.append(
                {
                    "batch": batch,
                    "estimator": name,
                    "ms": ms,
                    "step_ms": step_ms,
                    "share": ms / step_ms,
                }
            )
    return rows


def estimator_fidelity(logits: torch.Tensor) -> list[dict]:
    """Each estimator against the exact entropy, and the feedback decision taken from it."""
    exact = entropy(logits.log_softmax(-1))
    n = exact.shape[0]
    ones = torch.ones(n)

    def decision(measured: torch.Tensor) -> torch.Tensor:  # one feedback step from T = 1
        return feedback_step(
            torch.zeros(n),
            measured,
            ones * TARGET,
            ones * DEFAULT_ENTROPY_GAIN,
            ones * -2.3,
            ones * 0.4,
            ones * 0.5,
        )

    reference = decision(exact)
    rows = []
    for k in ESTIMATOR_KS:
        bounds = topk_bounds(logits, k)
        for name, estimate in (
            ("top-k", bounds.topk),
            ("tail (midpoint)", bounds.midpoint),
            ("upper bound", bounds.upper),
        ):
            error = estimate - exact
            chosen = decision(estimate)
            rows.append(
                {
                    "k": k,
                    "estimator": name,
                    "correlation": torch.corrcoef(torch.stack([estimate, exact]))[0, 1].item(),
                    "mean_abs_error": error.abs().mean().item(),
                    "max_abs_error": error.abs().max().item(),
                    "bracket_holds": (
                        (bounds.lower <= exact + 1e-4) & (exact <= bounds.upper + 1e-4)
                    )
                    .float()
                    .mean()
                    .item(),
                    "temperature_differs_1pct": ((chosen - reference).abs() > 0.01)
                    .float()
                    .mean()
                    .item(),
                    "temperature_mean_abs_log_diff": (chosen - reference).abs().mean().item(),
                }
            )
    return rows


def plot_traces(results: dict[str, list[RequestOutput]], index: int, path: Path) -> None:
    """One row per sampler (entropy sampled from, and temperature), on shared axes: overlaid,
    eight jagged traces hide one another."""
    plt = pyplot()

    fig, axes = plt.subplots(
        len(results), 2, figsize=(12, 1.3 * len(results) + 1), sharex=True, sharey="col"
    )
    for (name, outs), (left, right) in zip(results.items(), axes, strict=True):
        out = outs[index]
        left.plot(out.tempered_entropies, linewidth=0.8)
        left.axhline(TARGET, color="black", linestyle="--", linewidth=0.6)
        right.plot(out.temperatures, linewidth=0.8, color="tab:red")
        left.set_ylabel(name, rotation=0, ha="right", va="center", fontsize=8)
    axes[0, 0].set_title("entropy sampled from (nats); dashed: target 2")
    axes[0, 1].set_title("temperature")
    for ax in axes[-1]:
        ax.set_xlabel("generated token")
    fig.suptitle(f"One prompt under each sampler (prompt {index})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace, llm: LLM | None = None) -> tuple[list[Figure], dict]:
    llm = llm or LLM(args.model, **options.engine_kwargs(args))
    prompts = [
        llm.tokenizer.encode_chat([{"role": "user", "content": p}])
        for p in instructions(args.num_prompts)
    ]
    print(
        f"{len(prompts)} prompts x up to {args.max_tokens} tokens, {len(SAMPLERS)} samplers",
        flush=True,
    )
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = run_samplers(llm, prompts, args.max_tokens, args.seed, out_dir / "generations.jsonl")
    logits = generated_logits(llm, results["fixed T=1.0"], args.fidelity_positions)
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "num_prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "samplers": {name: sampler_row(outs, args.max_tokens) for name, outs in results.items()},
        "overhead": estimator_overhead(llm, logits, tuple(args.overhead_batches)),
        "fidelity": estimator_fidelity(logits),
    }
    (out_dir / "sampling.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    (out_dir / "sampling.md").write_text(table + "\n")
    plot_traces(results, args.trace_prompt, out_dir / "sampling_traces.png")
    print(table)
    return figures(report), report | {"device": str(llm.engine.config.torch_device())}


def add_command(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser(
        "sampling", help="samplers side by side: entropy, quality, estimators"
    )
    # The samplers are per request (the control layers stay off); --seed seeds the sampling.
    options.add_engine_options(
        parser, exclude=("control", "seed"), defaults={"max_num_batched_tokens": 2048}
    )
    parser.add_argument("--num-prompts", type=positive_int, default=224)
    parser.add_argument("--max-tokens", type=positive_int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fidelity-positions", type=positive_int, default=2048)
    parser.add_argument("--overhead-batches", type=positive_int, nargs="+", default=[1, 32])
    parser.add_argument("--trace-prompt", type=int, default=0)
    parser.add_argument("--output-dir", default="results/sampling")
    add_result_option(parser)
    parser.set_defaults(func=recorded("sampling", run, PROGRAM))
