"""``etinfer serve --replicas N``: engine replicas on Ray Serve behind one OpenAI endpoint."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray import serve
from ray.serve.config import HTTPOptions, RequestRouterConfig

from etinfer.cluster.ingress import OpenAIIngress
from etinfer.cluster.metrics import BOARD_NAME, NAMESPACE, MetricsBoard
from etinfer.cluster.replica import EngineReplica

APP_NAME = "etinfer"
ROUTERS = ("backlog", "pow2")
# How often Serve asks each replica for its routing stats; the router adds what it sent since.
ROUTING_STATS_PERIOD_S = 0.5
# What a stream still open at shutdown gets before it is cut (the single server's figure).
GRACE_S = 5.0


@dataclass(frozen=True)
class ReplicaOptions:
    replicas: int
    num_threads: int
    engine_kwargs: dict
    model_name: str | None = None
    max_waiting_requests: int = 256
    max_request_bytes: int | None = None
    api_key: str | None = None
    router: str = "backlog"  # "pow2": Serve's own power-of-two-choices router

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")


def default_threads(replicas: int) -> int:
    """The machine's cores divided among the replicas."""
    return max(1, (os.cpu_count() or 1) // replicas)


def build_app(options: ReplicaOptions) -> serve.Application:
    """The engine deployment and the ingress in front of it, ready for ``serve.run``."""
    # Room for every request a replica's engine may hold: beyond it Serve queues them at the
    # ingress, and the replica's own 429 keeps its meaning.
    ongoing = options.max_waiting_requests + int(options.engine_kwargs.get("max_num_seqs", 256))
    router = None
    if options.router == "backlog":
        router = RequestRouterConfig(
            request_router_class="etinfer.cluster.router:BacklogRouter",
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        )
    engines = serve.deployment(
        EngineReplica,
        name="EngineReplica",
        num_replicas=options.replicas,
        max_ongoing_requests=ongoing,
        ray_actor_options={
            "num_cpus": options.num_threads,
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(options.num_threads)}},
        },
        health_check_period_s=2.0,
        graceful_shutdown_timeout_s=GRACE_S,
        **({"request_router_config": router} if router else {}),
    ).bind(
        options.engine_kwargs,
        options.model_name,
        options.max_waiting_requests,
        options.num_threads,
    )
    ingress = serve.deployment(
        serve.ingress()(OpenAIIngress),
        name="OpenAIIngress",
        max_ongoing_requests=ongoing * options.replicas,
        ray_actor_options={"num_cpus": 0},
        graceful_shutdown_timeout_s=GRACE_S,
    )
    return ingress.bind(engines, options.api_key, options.max_request_bytes)


def start(
    options: ReplicaOptions,
    *,
    host: str,
    port: int,
    ray_address: str | None,
    on_signal: Callable[..., None] | None = None,
) -> ray.actor.ActorHandle:
    """Start (or join, with ``ray_address``) a Ray cluster and deploy; returns when serving.
    The metrics board lives as long as the handle returned. ``on_signal`` takes SIGTERM and
    SIGINT from the moment Ray is up (``ray.init`` installs a handler that exits at once)."""
    if ray_address is None:
        # Serve's proxy drains for 30 s at shutdown by default; streams get our grace instead.
        os.environ.setdefault("RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S", str(GRACE_S))
        ray.init(namespace=NAMESPACE, include_dashboard=False)
    else:  # settings of the cluster itself are not ours to give
        ray.init(address=ray_address, namespace=NAMESPACE)
    if on_signal is not None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
    board = MetricsBoard.options(name=BOARD_NAME, get_if_exists=True).remote()
    serve.start(http_options=HTTPOptions(host=host, port=port))
    serve.run(build_app(options), name=APP_NAME, route_prefix="/")
    return board


def stop(joined: bool) -> None:
    """Remove the deployment. A cluster this process started goes with Serve; in one it
    joined, only this application goes, and the cluster and its other applications stay."""
    if joined:
        serve.delete(APP_NAME)
    else:
        serve.shutdown()
    ray.shutdown()


def serve_replicas(
    options: ReplicaOptions, *, host: str, port: int, ray_address: str | None
) -> None:
    """Serve until SIGTERM or SIGINT, then stop everything; a signal during start-up stops
    it as soon as the deployment is up."""
    done = threading.Event()
    board = start(
        options, host=host, port=port, ray_address=ray_address, on_signal=lambda *_: done.set()
    )
    if not done.is_set():
        print(f"etinfer: {options.replicas} replicas serving on http://{host}:{port}", flush=True)
        done.wait()
    stop(joined=ray_address is not None)
    del board
