"""The data-parallel routing policy as a Ray Serve request router for the engine deployment.

Selected in the Serve config of the engine deployment:

    request_router_config:
      request_router_class: pagedserve.cluster.serve.router:PrefixAffinityRouter
      request_router_kwargs: {affinity_blocks: 4, imbalance_factor: 2.0, kv_weight: 4.0}
      request_routing_stats_period_s: 1

Each engine replica reports its load and a bounded set of the prompt-prefix hashes it served as
routing stats (`engine_host.EngineHost.record_routing_stats`); Serve delivers them to
every router. For a `generate(request_id, prompt_token_ids, ...)` call the router runs
`routing_policy.RoutingPolicy` over the live replicas: load = requests this router has in flight on
the replica (or Serve's cached queue length, whichever is larger) + the replica's waiting + running
+ kv_weight * KV usage; the longest prompt prefix this router sent somewhere, or a replica reports
holding, wins within the imbalance bound. It answers Serve with two ranks: the choice, then the rest
(Serve moves on to the rest only when the choice refuses the request because its queue is full).

A PD consumer's calls to a producer engine (`kv_rank_endpoints`, `kv_read`, `kv_release`, each naming
the replica it is for in its `replica` keyword: cluster/pd/ray_transport.py) skip the policy: they go to
that replica, or, when it is gone, to any other, which refuses them at once (`EngineHost._check_pinned`).

Every router instance in a process registers itself (`router_registry`), so that the ingress can build
/metrics from the replicas' routing stats and the routing decisions without an RPC.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedserve.cluster.serve.router_registry import register
from pagedserve.cluster.serve.routing_policy import RoutingParams, RoutingPolicy, engine_load, short_hash

logger = logging.getLogger(__name__)


def prompt_of(pending_request: PendingRequest | None) -> Sequence[int] | None:
    """The prompt token ids of an engine `generate(request_id, prompt_token_ids, ...)` call, else None."""
    if pending_request is None or pending_request.metadata.call_method != "generate":
        return None
    args, kwargs = pending_request.args, pending_request.kwargs
    ids = args[1] if len(args) > 1 else kwargs.get("prompt_token_ids")
    return ids if isinstance(ids, (list, tuple)) else None


# Engine host methods whose calls name the one replica they are for.
PINNED_METHODS = frozenset({"kv_rank_endpoints", "kv_read", "kv_release"})


def pinned_replica(pending_request: PendingRequest | None) -> str | None:
    """The replica id a pinned call names, else None."""
    if pending_request is None or pending_request.metadata.call_method not in PINNED_METHODS:
        return None
    replica = pending_request.kwargs.get("replica")
    return replica if isinstance(replica, str) else None


class PrefixAffinityRouter(RequestRouter):
    """Power of two choices by load with bounded prefix affinity, over Serve's engine replicas."""

    def initialize_state(
        self,
        affinity_blocks: int = 4,
        imbalance_factor: float = 2.0,
        kv_weight: float = 4.0,
        max_affinity_entries: int = 65536,
        seed: int | None = None,
        imbalance_slack: float = 2.0,
    ) -> None:
        self.policy: RoutingPolicy[ReplicaID] = RoutingPolicy(
            RoutingParams(affinity_blocks, imbalance_factor, kv_weight, max_affinity_entries, imbalance_slack), seed=seed)
        self.in_flight: dict[ReplicaID, int] = {}
        self.num_routed: dict[ReplicaID, int] = {}
        self._held: dict[ReplicaID, tuple[int, frozenset[str]]] = {}  # replica -> (id(stats list), hashes)
        register(self._deployment_id.app_name, self._deployment_id.name, self)
        self._ray_counter = _ray_decision_counter()

    # ------------------------------------------------------------------ the choice

    def replica_load(self, replica: RunningReplica) -> float:
        cached = self._replica_queue_len_cache.get(replica.replica_id) or 0
        in_flight = max(self.in_flight.get(replica.replica_id, 0), cached)
        return engine_load(in_flight, replica.routing_stats, self.policy.params.kv_weight)

    def _holds(self, replica: RunningReplica) -> frozenset[str]:
        reported = (replica.routing_stats or {}).get("prefix_hashes") or ()
        cached = self._held.get(replica.replica_id)
        if cached is None or cached[0] != id(reported):
            cached = (id(reported), frozenset(reported))
            self._held[replica.replica_id] = cached
        return cached[1]

    def choose(self, replicas: Sequence[RunningReplica], prompt: Sequence[int] | None) -> RunningReplica:
        """The policy's choice among `replicas` for this prompt (None: load only); remembers the prefix."""
        by_id = {r.replica_id: r for r in replicas}
        healthy = [r for r in replicas if (r.routing_stats or {}).get("healthy", True)] or list(replicas)
        block_size = next((int(r.routing_stats["block_size"]) for r in replicas
                           if (r.routing_stats or {}).get("block_size")), None)
        hashes = self.policy.hashes(prompt, block_size) if prompt else []

        def holder(block_hash: bytes) -> ReplicaID | None:
            short = short_hash(block_hash)
            holders = [r for r in healthy if short in self._holds(r)]
            return min(holders, key=self.replica_load).replica_id if holders else None

        choice, decision = self.policy.choose([r.replica_id for r in healthy],
                                              lambda rid: self.replica_load(by_id[rid]), hashes, holder)
        if self._ray_counter is not None:
            try:
                self._ray_counter.inc(1.0, tags={"decision": decision, "deployment": self._deployment_id.name,
                                                 "application": self._deployment_id.app_name})
            except Exception:  # noqa: BLE001 - metrics are optional; routing is not
                self._ray_counter = None
        if hashes:
            self.policy.remember(hashes, choice)
        return by_id[choice]

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        pinned = pinned_replica(pending_request)
        if pinned is not None:
            named = [r for r in candidate_replicas if r.replica_id.unique_id == pinned]
            return [named or [min(candidate_replicas, key=self.replica_load)]]
        choice = self.choose(candidate_replicas, prompt_of(pending_request))
        rest = sorted((r for r in candidate_replicas if r.replica_id != choice.replica_id), key=self.replica_load)
        return [[choice], rest] if rest else [[choice]]

    # ------------------------------------------------------------------ Serve's lifecycle hooks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1
        self.num_routed[replica_id] = self.num_routed.get(replica_id, 0) + 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.in_flight.get(replica_id, 0) > 0:
            self.in_flight[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id)
        self._held.pop(replica_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for gone in [rid for rid in self._held if rid not in live]:
            self._held.pop(gone, None)
            self.policy.forget(gone)
        for table in (self.in_flight, self.num_routed):
            for gone in [rid for rid in table if rid not in live]:
                table.pop(gone, None)

    # ------------------------------------------------------------------ what /metrics reads

    def snapshot(self) -> dict[str, Any]:
        """The replicas' latest routing stats (labelled by replica), this router's decision counts."""
        replicas = []
        for replica in self._replicas_list:
            stats: Mapping = replica.routing_stats or {}
            replicas.append({
                **{k: v for k, v in stats.items() if k != "prefix_hashes"},
                "num_prefixes": len(stats.get("prefix_hashes") or ()),
                "replica": replica.replica_id.unique_id,
                "in_flight": self.in_flight.get(replica.replica_id, 0),
                "num_routed": self.num_routed.get(replica.replica_id, 0),
            })
        return {"replicas": replicas, "decisions": dict(self.policy.decisions)}


def _ray_decision_counter() -> Any:
    """Routing decisions in Ray's metrics export too: every router process's counts, summed there (the
    ingress's /metrics shows its own router's); None where Ray metrics are unavailable."""
    try:
        from ray.util.metrics import Counter

        return Counter("pagedserve_routing_decisions", "Engine routing decisions by kind, all routers.",
                       tag_keys=("decision", "deployment", "application"))
    except Exception:  # noqa: BLE001 - metrics are optional; routing is not
        return None
