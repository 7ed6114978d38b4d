"""The routing policy behind Ray Serve's request-router extension point.

Serve calls ``choose_replicas`` for each request the ingress sends through its handle to the
engine replicas, and hands the router each replica's latest ``record_routing_stats``. The
answer ranks the replicas: those where the request would finish soonest (within the policy's
tie margin) in the first rank, where Serve picks by its live count of requests in flight, the
rest after it, so that Serve falls back in that order when a replica refuses (full).
Calls that carry no request (models, health) go to any replica.
"""

from __future__ import annotations

from collections import OrderedDict

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

# Through the module, not its names: Serve pickles this module by value, and a counter's lock
# does not pickle.
from etinfer.cluster import metrics
from etinfer.cluster.routing_policy import Decision, RoutingConfig, RoutingPolicy

MAX_UNROUTED = 4096


def request_body(pending: PendingRequest | None) -> dict | None:
    """The OpenAI request's JSON, for ``EngineReplica.generate(kind, body)`` calls (None for
    any other call: a tokenizer's is routed to any replica and weighs nothing)."""
    if pending is None or pending.metadata.call_method != "generate":
        return None
    if len(pending.args) != 2 or not isinstance(pending.args[1], dict):
        return None
    return pending.args[1]


class BacklogRouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        self.policy = RoutingPolicy(RoutingConfig(**kwargs))
        # Each request's decision until it is routed; bounded, for those cancelled first.
        self.decisions: OrderedDict[str, Decision] = OrderedDict()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        body = request_body(pending_request)
        if body is None or not candidate_replicas:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        for name, replica in by_id.items():
            self.policy.update(name, replica.routing_stats)
        request_id = pending_request.metadata.request_id
        decision = self.policy.choose(list(by_id), body, request_id)
        self.decisions[request_id] = decision
        while len(self.decisions) > MAX_UNROUTED:
            self.decisions.popitem(last=False)
        rest = sorted((n for n in by_id if n not in decision.ties), key=decision.finish_times.get)
        return [[by_id[n] for n in decision.ties], [by_id[n] for n in rest]]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        body = request_body(pending_request)
        if body is None:
            return
        name, request_id = replica_id.unique_id, pending_request.metadata.request_id
        decision = self.decisions.pop(request_id, None)
        if decision is None or name not in decision.ties:
            reason = "fallback"
        else:
            reason = decision.reason if name == decision.replica else "tie"
        metrics.DECISIONS.labels(name, reason).inc()
        self.policy.routed(request_id, name, body)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id.unique_id)
