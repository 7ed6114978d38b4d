"""The feedback law under estimation error, on frozen real logits (the paper's Appendix A).

    python -m studies iss --output-dir results/iss

Next-token log-probabilities of real text (teacher-forced decode steps over CPython's
``pydoc_data``) are frozen; on each, the feedback law runs from T = 1 towards the target with
the entropy it reads perturbed: by the top-k estimator or the tail midpoint (errors we can
bracket), or by synthetic noise bounded by ``eps`` (a constant bias, the worst case, or uniform
noise drawn each step). The settled error ``|u - u*|`` (the largest over the last quarter of
the iterations; ``u*`` solves ``H(u*) = H*`` exactly) is compared with the appendix's bound
``eps / V(u*)``, ``V`` the varentropy (the slope ``dH/du``) and ``eps`` the largest reading
error over those iterations (the noise bound for synthetic noise). The appendix assumes
``gain * V <= 1`` and a slope that holds over the error: rows where ``gain * V > 1`` (the
error alternates in sign; past 2 the linearised law diverges and only the rate limit bounds it)
or ``V < 0.1`` are reported apart, and rows whose target lies outside the temperature bounds
(``u*`` pinned to a bound) are left out: no law reaches them.

The run's result holds, per reading and regime, the share of rows where the bound holds and the
median settled error over the bound (its ``details``: the report, also ``iss.json`` beside the
plot in ``--output-dir``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch

from etinfer import options
from etinfer.bench.common.fidelity import corpus_tokens, forced_log_probs
from etinfer.bench.common.results import Figure, add_result_option, engine_device, recorded
from etinfer.control.entropy import TemperedEntropy, estimate_entropy
from etinfer.control.temperature import feedback_step, solve_log_temperature
from etinfer.options import positive_int
from etinfer.sampling_params import SamplingParams
from studies import PROGRAM
from studies.common.plots import pyplot

FLAT = 0.1  # varentropy below which the local slope says little over the error


def frozen_rows(args: argparse.Namespace) -> torch.Tensor:
    """Next-token log-probabilities of real text, one row per decode step."""
    from etinfer.llm import LLM

    llm = LLM(args.model, **options.engine_kwargs(args))
    corpus = corpus_tokens(llm.tokenizer)
    stride = len(corpus) // args.texts
    texts = [corpus[i * stride : i * stride + args.context + args.steps] for i in range(args.texts)]
    forced = forced_log_probs(llm, texts, args.context, args.steps)
    return torch.stack(list(forced.log_probs.values()))


def readings(kind: str, eps: float, k: int):
    """How the law reads the entropy at ``u``: the exact value ``h`` plus an error."""
    generator = torch.Generator().manual_seed(0)

    def read(rows: torch.Tensor, u: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        if kind in ("topk", "tail"):
            return estimate_entropy(rows / u.exp()[:, None], kind, k)
        if kind == "bias":
            return h + eps
        noise = torch.rand(h.shape, generator=generator) * 2 - 1
        return h + eps * noise

    return read


def settle(rows: torch.Tensor, read, params: SamplingParams, iterations: int) -> dict:
    """Run the law on every row; the settled error, the reading's error, where it settles."""
    curve = TemperedEntropy(rows)
    n = rows.shape[0]
    full = lambda v: torch.full((n,), float(v))  # noqa: E731
    target, gain = full(params.entropy_target), full(params.entropy_gain)
    u_min, u_max = full(math.log(params.temperature_min)), full(math.log(params.temperature_max))
    step_limit = full(params.temperature_rate_limit)
    u_star = solve_log_temperature(curve, target, u_min, u_max, full(0.0), iterations=64)
    h_star, v_star = curve(u_star)
    reachable = (h_star - target).abs() < 1e-3
    u = full(0.0)
    settled, eps = torch.zeros(n), torch.zeros(n)
    for i in range(iterations):
        h, _ = curve(u)
        reading = read(rows, u, h)
        if i >= iterations * 3 // 4:
            eps = torch.maximum(eps, (reading - h).abs())
        u = feedback_step(u, reading, target, gain, u_min, u_max, step_limit)
        if i >= iterations * 3 // 4:
            settled = torch.maximum(settled, (u - u_star).abs())
    return {
        "settled": settled,
        "eps": eps,
        "varentropy": v_star,
        "reachable": reachable,
        "gain": params.entropy_gain,
    }


def verdict(result: dict) -> dict:
    """Where ``settled <= eps / V`` holds, and how loose it is, by the appendix's regime."""
    v, settled, eps = result["varentropy"], result["settled"], result["eps"]
    bound = eps / v.clamp(min=1e-9)
    ok = result["reachable"] & (eps > 0)
    gv = result["gain"] * v
    regimes = {
        "in the appendix's regime": ok & (v >= FLAT) & (gv <= 1),
        "1 < gain * V <= 2 (contracts, alternating)": ok & (gv > 1) & (gv <= 2),
        "gain * V > 2 (unstable but for the rate limit)": ok & (gv > 2),
        f"flat (V < {FLAT})": ok & (v < FLAT),
    }
    out = {"rows": int(ok.sum()), "unreachable": int((~result["reachable"]).sum())}
    for name, mask in regimes.items():
        if not bool(mask.any()):
            out[name] = {"rows": 0}
            continue
        ratio = (settled[mask] / bound[mask]).tolist()
        out[name] = {
            "rows": int(mask.sum()),
            "holds": statistics.fmean(r <= 1.0 + 1e-3 for r in ratio),
            "ratio_median": statistics.median(ratio),
            "ratio_max": max(ratio),
            "eps_median": statistics.median(eps[mask].tolist()),
        }
    return out


def plot(results: dict[str, dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 5))
    for name, result in results.items():
        ok = result["reachable"] & (result["eps"] > 0)
        bound = (result["eps"] / result["varentropy"].clamp(min=1e-9))[ok]
        ax.scatter(bound, result["settled"][ok].clamp(min=1e-6), s=6, alpha=0.5, label=name)
    ax.axline((1e-3, 1e-3), slope=1, color="black", linestyle="--", linewidth=1, label="bound")
    ax.set(xscale="log", yscale="log", xlabel="eps / V(u*)  (the appendix's bound)")
    ax.set(ylabel="settled |u - u*|", title="Feedback law under estimation error, per frozen step")
    ax.legend(fontsize=7, markerscale=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def figures(kinds: dict[str, dict]) -> list[Figure]:
    found = []
    for name, regimes in kinds.items():
        for regime, r in regimes.items():
            if not isinstance(r, dict) or not r["rows"]:  # the counts, or an empty regime
                continue
            labels = {"arm": name, "regime": regime}
            found.append(Figure("bound holds", 100 * r["holds"], "%", labels, n=r["rows"]))
            error = labels | {"vs": "bound"}
            found.append(Figure("settled error", r["ratio_median"], "x", error, n=r["rows"]))
            found.append(Figure("settled error max", r["ratio_max"], "x", error, n=r["rows"]))
    return found


def run(args: argparse.Namespace) -> tuple[list[Figure], dict]:
    options.set_threads(args)
    rows = frozen_rows(args)
    params = SamplingParams(entropy_target=args.target)
    kinds = [("topk", 0.0), ("tail", 0.0)]
    kinds += [(kind, eps) for kind in ("bias", "uniform") for eps in args.eps]
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results, report = {}, {"rows": rows.shape[0], "target": args.target, "kinds": {}}
    for kind, eps in kinds:
        name = kind if kind in ("topk", "tail") else f"{kind} {eps}"
        results[name] = settle(rows, readings(kind, eps, args.topk), params, args.iterations)
        report["kinds"][name] = verdict(results[name])
        print(name, json.dumps(report["kinds"][name]), flush=True)
    plot(results, out_dir / "iss_bound.png")
    (out_dir / "iss.json").write_text(json.dumps(report, indent=2))
    device = engine_device(options.engine_kwargs(args))
    return figures(report["kinds"]), report | {"device": device}


def add_command(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser("iss", help="the feedback law's error bound under estimation error")
    options.add_engine_options(parser, only=("model", "quantization", "max_model_len"))
    options.add_threads_option(parser)
    parser.add_argument("--texts", type=positive_int, default=3)
    parser.add_argument("--context", type=positive_int, default=256)
    parser.add_argument("--steps", type=positive_int, default=128, help="frozen steps per text")
    parser.add_argument("--target", type=float, default=2.0, help="entropy target, nats")
    parser.add_argument("--iterations", type=positive_int, default=400)
    parser.add_argument("--topk", type=positive_int, default=64)
    parser.add_argument("--eps", type=float, nargs="+", default=[0.05, 0.2, 0.5])
    parser.add_argument("--output-dir", default="results/iss")
    add_result_option(parser)
    parser.set_defaults(func=recorded("iss", run, PROGRAM))
