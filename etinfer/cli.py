"""Command line: ``etinfer generate``, ``etinfer serve``, ``etinfer bench``."""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TextIO

from etinfer import options
from etinfer.model.catalog import CATALOG
from etinfer.outputs import RequestOutput
from etinfer.sampling_params import SamplingParams

SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], ceiling: float) -> str:
    """One character per value, scaled to [0, ceiling]."""
    top = len(SPARKS) - 1
    return (
        "".join(SPARKS[min(top, int(v / ceiling * top + 0.5))] for v in values)
        if ceiling > 0
        else ""
    )


def entropy_summary(out: RequestOutput, elapsed: float) -> str:
    h = out.entropies
    n = len(out.token_ids)
    lines = [
        f"entropy (nats, per token) {sparkline(h, max(h, default=0.0))}",
        f"{n} tokens in {elapsed:.2f} s ({n / elapsed:.1f} tok/s), "
        f"time to first token {out.metrics.time_to_first_token:.3f} s, "
        f"mean entropy {statistics.fmean(h):.3f} nats (min {min(h):.3f}, max {max(h):.3f}), "
        f"finish: {out.finish_reason}",
    ]
    return "\n".join(lines)


def generate(args: argparse.Namespace) -> int:
    from etinfer.llm import LLM

    prompts = list(args.prompt)
    if args.prompts_file:
        prompts += [
            line for line in Path(args.prompts_file).read_text().splitlines() if line.strip()
        ]
    if not prompts:
        print("error: give a prompt or --prompts-file", file=sys.stderr)
        return 2
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )
    llm = LLM(args.model, **options.engine_kwargs(args))
    if args.chat:
        prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    if len(prompts) == 1:
        start = time.perf_counter()
        whole = None
        for delta in llm.stream(prompts[0], params, delta=True):
            print(delta.text, end="", flush=True)
            if whole is None:
                whole = RequestOutput.accumulating(delta)
            else:
                whole.merge(delta)
        print("\n" + entropy_summary(whole, time.perf_counter() - start))
        return 0
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    for i, out in enumerate(outs):
        mean_h = statistics.fmean(out.entropies)
        print(f"--- [{i}] {len(out.token_ids)} tokens, mean entropy {mean_h:.3f} nats\n{out.text}")
    total = sum(len(o.token_ids) for o in outs)
    all_h = [h for o in outs for h in o.entropies]
    print(
        f"{len(outs)} requests, {total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tok/s), "
        f"mean entropy {statistics.fmean(all_h):.3f} nats"
    )
    return 0


def serve(args: argparse.Namespace) -> int:
    if args.replicas is not None:
        return serve_replicas(args)
    from etinfer.calibrate import build_engine
    from etinfer.config import EngineConfig
    from etinfer.server import serve as run_server

    show_log(args.log_level.upper())
    engine = build_engine(EngineConfig(model=args.model, **options.engine_kwargs(args)))
    run_server(
        engine,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        api_key=args.api_key,
        model_name=args.served_model_name,
        max_waiting_requests=args.max_waiting_requests,
        max_request_bytes=args.max_request_bytes,
    )
    return 0


def serve_replicas(args: argparse.Namespace) -> int:
    # Ray is imported only here: without --replicas the server does not need it.
    from etinfer.cluster import launch

    threads = args.num_threads or launch.default_threads(args.replicas)
    replica_options = launch.ReplicaOptions(
        replicas=args.replicas,
        num_threads=threads,
        engine_kwargs={"model": args.model, **options.engine_kwargs(args)},
        model_name=args.served_model_name,
        max_waiting_requests=args.max_waiting_requests,
        max_request_bytes=args.max_request_bytes,
        api_key=args.api_key,
        router=args.router,
    )
    launch.serve_replicas(
        replica_options, host=args.host, port=args.port, ray_address=args.ray_address
    )
    return 0


def _add_serve_command(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("serve", help="an OpenAI-compatible HTTP server")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=os.environ.get("ETINFER_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 (default: $ETINFER_API_KEY, else none)",
    )
    parser.add_argument("--served-model-name", help="the model's id in the API")
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=256,
        help="requests queued beyond this are refused with 429",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        help="larger request bodies are refused with 413 before they are parsed (default: room "
        "for one prompt that fills the context at the worst JSON escaping, plus 1 MiB; 5 MiB "
        "for the default model)",
    )
    parser.add_argument("--log-level", default="info")
    cluster = parser.add_argument_group("replicas on Ray Serve (pip install 'etinfer[ray]')")
    cluster.add_argument(
        "--replicas",
        type=int,
        help="engine replicas behind the endpoint (default: one engine in this process, no Ray)",
    )
    cluster.add_argument(
        "--ray-address", help="join this Ray cluster instead of starting a local one"
    )
    cluster.add_argument(
        "--num-threads", type=int, help="torch threads per replica (default: cores / replicas)"
    )
    cluster.add_argument(
        "--router",
        choices=["backlog", "pow2"],
        default="backlog",
        help="backlog: where the request finishes soonest, with prefix affinity; pow2: Ray "
        "Serve's power of two choices",
    )
    options.add_engine_options(parser)
    parser.set_defaults(func=serve)


def list_models(args: argparse.Namespace) -> int:
    """The models known by name, and whether each is installed (or how to install it)."""
    for name, package in CATALOG.items():
        state = "installed" if package.installed else f"not installed: {package.pip}"
        print(f"{name:24} {package.description} ({state})")
    return 0


def build_kernels(args: argparse.Namespace) -> int:
    """Build the native kernels for this CPU now, as the set-up does, so that the first
    request does not wait for the compiler (built once per CPU and source; later calls find
    them in the cache)."""
    from etinfer.model import native_kernels, quant_kernels

    started = time.perf_counter()
    built = {
        "attention and cache": native_kernels.library(),
        "weight blocks": quant_kernels.library(),
    }
    for part, library in built.items():
        print(f"{part}: {'not built (see the log above)' if library is None else library._name}")
    print(f"ready in {time.perf_counter() - started:.1f} s")
    return 0 if all(library is not None for library in built.values()) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="etinfer", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text, streaming, with its entropy")
    gen.add_argument("prompt", nargs="*")
    gen.add_argument("--prompts-file", help="one prompt per line")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.7)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, help="of sampling (the engine's own seed stays 0)")
    options.add_engine_options(gen, exclude=("seed",))
    gen.set_defaults(func=generate)

    _add_serve_command(commands)
    models = commands.add_parser("models", help="the models known by name, and which are installed")
    models.set_defaults(func=list_models)
    kernels = commands.add_parser("kernels", help="build the native kernels for this CPU now")
    kernels.set_defaults(func=build_kernels)

    from etinfer import calibrate
    from etinfer.bench import add_bench_commands

    calibrate.add_command(commands)
    add_bench_commands(commands)
    return parser


def run_command(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """Run the command ``argv`` names; a ValueError (bad input) is one line and exit status 2."""
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record comes (as logging's last resort
    does), so a handler set once follows a stream replaced later."""

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        pass


def show_log(level: str = "INFO") -> None:
    """etinfer's log from ``level`` on (INFO: the engine's start-up line, warnings) on stderr;
    the handler is added once."""
    log = logging.getLogger("etinfer")
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    log.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    show_log()
    return run_command(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
