"""The data-parallel routing policy as a Ray Serve request router for the engine deployment.

Selected in the Serve config of the engine deployment:

    request_router_config:
      request_router_class: pagedserve.cluster.serve.router:PrefixAffinityRouter
      request_router_kwargs: {affinity_blocks: 4, imbalance_factor: 2.0, kv_weight: 4.0}
      request_routing_stats_period_s: 1

Each engine replica reports its load and a bounded set of the prompt-prefix hashes it served as
routing stats (`engine_deployment.PagedServeEngine.record_routing_stats`); Serve delivers them to
every router. For a `generate(request_id, prompt_token_ids, ...)` call the router runs
`routing_policy.RoutingPolicy` over the live replicas: load = requests this router has in flight on
the replica (or Serve's cached queue length, whichever is larger) + the replica's waiting + running
+ kv_weight * KV usage; the longest prompt prefix this router sent somewhere, or a replica reports
holding, wins within the imbalance bound. It answers Serve with two ranks: the choice, then the rest
(Serve moves on to the rest only when the choice refuses the request because its queue is full).

A circuit breaker (`circuit_breaker.CircuitBreaker`) keeps a replica that failed `failure_threshold`
requests in a row out of the choice until its cooldown has passed and its routing stats say it is
healthy again; the engine client reports each request's outcome by Serve's internal request id
(`record_outcome`), which `on_request_routed` maps to the replica.

Every router instance in a process registers itself (`router_registry`), so that the ingress can build
/metrics from the replicas' routing stats and the routing decisions without an RPC.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedserve.cluster.serve.route_log import RouteLog, timed_choice
from pagedserve.cluster.serve.circuit_breaker import DEFAULT_COOLDOWN_S, DEFAULT_FAILURE_THRESHOLD, CircuitBreaker
from pagedserve.cluster.serve.router_registry import register
from pagedserve.cluster.serve.routing_policy import RoutingParams, RoutingPolicy, engine_load, prefer_holders
from pagedserve.engine.lora.request import SAMPLING_KEY

logger = logging.getLogger(__name__)

# Requests whose replica the router remembers until their outcome is reported (the oldest forgotten).
MAX_TRACKED_REQUESTS = 65536


def request_id_of(pending_request: PendingRequest | None) -> str | None:
    """The engine request id of a `generate(request_id, ...)` call (for its trace), else None."""
    if pending_request is None or pending_request.metadata.call_method != "generate":
        return None
    rid = pending_request.args[0] if pending_request.args else pending_request.kwargs.get("request_id")
    return rid if isinstance(rid, str) else None


def prompt_of(pending_request: PendingRequest | None) -> Sequence[int] | None:
    """The prompt token ids of an engine `generate(request_id, prompt_token_ids, ...)` call, else None."""
    if pending_request is None or pending_request.metadata.call_method != "generate":
        return None
    args, kwargs = pending_request.args, pending_request.kwargs
    ids = args[1] if len(args) > 1 else kwargs.get("prompt_token_ids")
    return ids if isinstance(ids, (list, tuple)) else None


def adapter_of(pending_request: PendingRequest | None) -> str | None:
    """The LoRA adapter name of an engine `generate(request_id, prompt_token_ids, sampling_params, ...)` call
    (it rides in the sampling params, see engine.lora.request.SAMPLING_KEY), else None."""
    if pending_request is None or pending_request.metadata.call_method != "generate":
        return None
    args, kwargs = pending_request.args, pending_request.kwargs
    params = args[2] if len(args) > 2 else kwargs.get("sampling_params")
    lora = params.get(SAMPLING_KEY) if isinstance(params, dict) else None
    return lora.get("lora_name") if isinstance(lora, dict) else None


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
        failure_threshold: int = DEFAULT_FAILURE_THRESHOLD,
        breaker_cooldown_s: float = DEFAULT_COOLDOWN_S,
    ) -> None:
        self.policy: RoutingPolicy[ReplicaID] = RoutingPolicy(
            RoutingParams(affinity_blocks, imbalance_factor, kv_weight, max_affinity_entries, imbalance_slack), seed=seed)
        self.in_flight: dict[ReplicaID, int] = {}
        self.num_routed: dict[ReplicaID, int] = {}
        self._held: dict[ReplicaID, tuple[int, frozenset[str]]] = {}  # replica -> (id(stats list), hashes)
        self.breaker: CircuitBreaker[ReplicaID] = CircuitBreaker(failure_threshold, breaker_cooldown_s)
        self._routed_to: OrderedDict[str, ReplicaID] = OrderedDict()  # internal request id -> replica
        register(self._deployment_id.app_name, self._deployment_id.name, self)
        self._ray_counter = _ray_decision_counter()
        self.route_log = RouteLog()  # each request's decision, for its trace (the ingress takes it)

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

    def choose(self, replicas: Sequence[RunningReplica], prompt: Sequence[int] | None,
               adapter: str | None = None) -> RunningReplica:
        """The policy's choice among `replicas` for this prompt (None: load only), among the replicas that hold
        its LoRA `adapter` first (`prefer_holders`); remembers the prefix."""
        return self._choose(replicas, prompt, adapter)[0]

    def _choose(self, replicas: Sequence[RunningReplica], prompt: Sequence[int] | None,
                adapter: str | None = None) -> tuple[RunningReplica, str]:
        by_id = {r.replica_id: r for r in replicas}
        for r in replicas:
            self.breaker.observe(r.replica_id, r.routing_stats, bool((r.routing_stats or {}).get("healthy", True)))
        healthy = [r for r in replicas if (r.routing_stats or {}).get("healthy", True)] or list(replicas)
        healthy = [r for r in healthy if not self.breaker.is_open(r.replica_id)] or healthy
        if adapter is not None:
            healthy = prefer_holders(healthy, self.replica_load,
                                     lambda r: adapter in ((r.routing_stats or {}).get("lora_adapters") or ()),
                                     self.policy.params)
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
        return by_id[choice], decision

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        request_id = request_id_of(pending_request)
        adapter = adapter_of(pending_request)
        if request_id is None:
            choice = self.choose(candidate_replicas, prompt_of(pending_request), adapter)
        else:
            choice, record = timed_choice(lambda: self._choose(candidate_replicas, prompt_of(pending_request), adapter),
                                          candidate_replicas, self.replica_load, self._deployment_id.name,
                                          name=lambda replica: replica.replica_id.unique_id)
            self.route_log.record(request_id, record)
        rest = sorted((r for r in candidate_replicas if r.replica_id != choice.replica_id), key=self.replica_load)
        return [[choice], rest] if rest else [[choice]]

    # ------------------------------------------------------------------ Serve's lifecycle hooks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1
        self.num_routed[replica_id] = self.num_routed.get(replica_id, 0) + 1
        internal_id = getattr(getattr(pending_request, "metadata", None), "internal_request_id", None)
        if internal_id:
            self._routed_to[internal_id] = replica_id
            while len(self._routed_to) > MAX_TRACKED_REQUESTS:
                self._routed_to.popitem(last=False)

    def record_outcome(self, internal_request_id: str, ok: bool) -> None:
        """The engine client's verdict on a request this router routed (the circuit breaker's input)."""
        replica_id = self._routed_to.pop(internal_request_id, None)
        if replica_id is not None:
            was_open = self.breaker.is_open(replica_id)
            self.breaker.record(replica_id, ok)
            if self.breaker.is_open(replica_id) and not was_open:
                logger.warning("engine replica %s failed %d requests in a row: out of routing until it recovers",
                               replica_id.unique_id, self.breaker.failure_threshold)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.in_flight.get(replica_id, 0) > 0:
            self.in_flight[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id)
        self._held.pop(replica_id, None)
        self.breaker.forget(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for gone in [rid for rid in self._held if rid not in live]:
            self._held.pop(gone, None)
            self.policy.forget(gone)
            self.breaker.forget(gone)
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
                "circuit_open": self.breaker.is_open(replica.replica_id),
            })
        return {"replicas": replicas, "decisions": dict(self.policy.decisions), "circuit_opens": self.breaker.num_opens}


def _ray_decision_counter() -> Any:
    """Routing decisions in Ray's metrics export too: every router process's counts, summed there (the
    ingress's /metrics shows its own router's); None where Ray metrics are unavailable."""
    try:
        from ray.util.metrics import Counter

        return Counter("pagedserve_routing_decisions", "Engine routing decisions by kind, all routers.",
                       tag_keys=("decision", "deployment", "application"))
    except Exception:  # noqa: BLE001 - metrics are optional; routing is not
        return None


def short_hash(block_hash: bytes) -> str:
    """How a prefix hash travels in routing stats: 16 hex digits (64 bits) of the SHA-256."""
    return block_hash[:8].hex()
