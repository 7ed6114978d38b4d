"""One ``/metrics`` for every replica: each pushes its Prometheus text to a board, and the
ingress serves them all, each sample labelled with its ``replica``, plus the router's own
counters (the router runs in the ingress's process)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import ray
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

NAMESPACE = "etinfer"  # the Ray namespace of the cluster's named actors
BOARD_NAME = "etinfer-metrics"
ROUTER_METRICS = CollectorRegistry()
DECISIONS = Counter(
    "etinfer:router_decisions",
    "Requests routed, by replica and why: backlog (least work ahead), prefix (a cached "
    "opening outweighed a shorter backlog), tie (within the margin of the best, fewer in "
    "flight), fallback (every close one was full).",
    ["replica", "reason"],
    registry=ROUTER_METRICS,
)
LOST_SENDS = Counter(
    "etinfer:ingress_lost_sends",
    "Sends of a request to a replica that died before answering: each is sent again, up to "
    "3 sends in all.",
    registry=ROUTER_METRICS,
)
# A replica that has not pushed for this long is gone (killed, or replaced): its series end.
STALE_AFTER_S = 10.0


@ray.remote(num_cpus=0)
class MetricsBoard:
    def __init__(self) -> None:
        self.texts: dict[str, tuple[float, bytes]] = {}

    def put(self, replica: str, text: bytes) -> None:
        self.texts[replica] = (time.monotonic(), text)

    def snapshot(self) -> dict[str, bytes]:
        now = time.monotonic()
        self.texts = {r: (t, x) for r, (t, x) in self.texts.items() if now - t < STALE_AFTER_S}
        return {replica: text for replica, (_, text) in self.texts.items()}


def board() -> ray.actor.ActorHandle:
    """The board ``launch.start`` created."""
    return ray.get_actor(BOARD_NAME, namespace=NAMESPACE)


class _Labelled(Collector):
    """The replicas' metric families, merged by name, each sample with its replica's label."""

    def __init__(self, texts: dict[str, bytes]) -> None:
        self.texts = texts

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for replica, text in sorted(self.texts.items()):
            for family in text_string_to_metric_families(text.decode()):
                merged = families.get(family.name)
                if merged is None:
                    merged = Metric(family.name, family.documentation, family.type, family.unit)
                    families[family.name] = merged
                merged.samples += [
                    s._replace(labels={**s.labels, "replica": replica}) for s in family.samples
                ]
        yield from families.values()


def merged_exposition(texts: dict[str, bytes], *extra: CollectorRegistry) -> bytes:
    """Prometheus text for all replicas' metrics, labelled, then the ``extra`` registries'."""
    registry = CollectorRegistry()
    registry.register(_Labelled(texts))
    return b"".join(generate_latest(r) for r in (registry, *extra))
