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

A circuit breaker (`circuit_breaker.CircuitBreaker`) keeps a replica that failed `failure_threshold`
requests in a row out of the choice until its cooldown has passed and its routing stats say it is
healthy again; the engine client reports each request's outcome by Serve's internal request id
(`record_outcome`), which `on_request_routed` maps to the replica.

The policy (`routing_policy`, ServeArgs.routing_policy; settings.ROUTING_POLICIES): "exact" (the default,
below), "prefix_approx" (the approximate prefix affinity above, ignoring KV events), "power_of_two" (the
less loaded of two random replicas) or "random"; the last two are blind to prefixes and adapters and exist
as baselines (`pagedserve bench serve --compare-routing`). Health and the circuit breaker narrow the
candidates under every policy.

The choice itself is `prefix_chooser.PrefixChooser`, which the in-process coordinator
(coordinator.DPCoordinator) runs too: one policy, one hashing of a request's prompt (salt, adapter).

Exact routing (routing_policy "exact"): where the replicas publish their KV events with their
routing stats (kv_feed.py), the router keeps its own index of what each replica's KV tiers hold
(kv_index.ClusterKVIndex) and scores each candidate by the prompt tokens it holds, device first, then
offload, against its load (routing_policy.choose_by_holdings); a replica whose view is stale is scored
approximately (what it reported serving). It predicts the request's cached tokens and checks the
prediction against what the engine found (`observe_cached`, from the engine client). Replicas that
publish no events at all are routed by the approximate policy alone, as before.

A PD consumer's calls to a producer engine (`kv_rank_endpoints`, `kv_read`, `kv_release`, each naming
the replica it is for in its `replica` keyword: cluster/pd/ray_transport.py) skip the policy: they go to
that replica, or, when it is gone, to any other, which refuses them at once (`EngineHost._check_pinned`).

The offload tier across nodes: when another replica's offload tier (by this router's index) holds a longer
run of the prompt's blocks than the chosen replica holds anywhere, the router names it in the `generate`
call (`kv_tier_peer`: `prefix_chooser.tier_peer`), the way a PD request names its producer, and the chosen engine fetches
the blocks its node lacks from that tier first (cluster/serve/tier_peer.py). `kv_tier_read` is pinned
like the PD reads.

Every router instance in a process registers itself (`router_registry`), so that the ingress can build
/metrics from the replicas' routing stats and the routing decisions without an RPC.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedserve.cluster.serve.engine_calls import (
    adapter_of, lora_key_of, pinned_replica, prompt_of, request_of,
)
from pagedserve.cluster.serve.prefix_chooser import PrefixChooser
from pagedserve.cluster.serve.circuit_breaker import DEFAULT_COOLDOWN_S, DEFAULT_FAILURE_THRESHOLD, CircuitBreaker
from pagedserve.cluster.serve.route_log import RouteLog, timed_choice
from pagedserve.cluster.serve.router_registry import register
from pagedserve.cluster.serve.routing_policy import (
    RoutingParams, engine_load,
)

logger = logging.getLogger(__name__)

# Requests whose replica the router remembers until their outcome is reported (the oldest forgotten).
MAX_TRACKED_REQUESTS = 65536


def _count_up(table: OrderedDict, key: Any, bounded: bool = False) -> None:
    """One more of `key` in an insertion-ordered multiset; `bounded`: past MAX_TRACKED_REQUESTS keys the
    oldest go."""
    table[key] = table.get(key, 0) + 1
    while bounded and len(table) > MAX_TRACKED_REQUESTS:
        table.popitem(last=False)


def _count_down(table: OrderedDict, key: Any) -> bool:
    """One fewer of `key`; False if there was none."""
    count = table.get(key, 0)
    if count <= 0:
        return False
    if count == 1:
        del table[key]
    else:
        table[key] = count - 1
    return True


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
        routing_policy: str = "exact",
        offload_weight: float = 0.5,
        silent_after_s: float = 10.0,
        recent_routes_s: float = 5.0,
    ) -> None:
        self.chooser: PrefixChooser[ReplicaID] = PrefixChooser(
            RoutingParams(affinity_blocks, imbalance_factor, kv_weight, max_affinity_entries, imbalance_slack,
                          offload_weight), routing_policy, seed, silent_after_s, recent_routes_s)
        # The chooser's state under the names /metrics, tests and the engine client read.
        self.policy, self.routing_policy = self.chooser.policy, self.chooser.routing_policy
        self.index, self.recent = self.chooser.index, self.chooser.recent
        self.predictions, self.prediction_counters = self.chooser.predictions, self.chooser.prediction_counters
        self.in_flight: dict[ReplicaID, int] = {}
        self.num_routed: dict[ReplicaID, int] = {}
        self.breaker: CircuitBreaker[ReplicaID] = CircuitBreaker(failure_threshold, breaker_cooldown_s)
        self._routed_to: OrderedDict[str, ReplicaID] = OrderedDict()  # internal request id -> replica
        # How many requests of each (internal request id, replica) `in_flight` counts, and how many completed
        # before they were routed. Serve registers a request's completion callback before it awaits the
        # replica's acceptance, and calls `on_request_routed` only then: a short call (an engine's `ready()`)
        # can complete first. Counted naively, it stayed in flight forever and its replica lost every tie of
        # the two-choice draw (a test's ten tenants all went to the other engine). Every routed request
        # completes (Serve's contract), so `_counted` holds only what is in flight; refused requests, which
        # are never routed where they completed, would pile up in `_completed_first`: it is bounded.
        self._counted: OrderedDict[tuple[str, ReplicaID], int] = OrderedDict()
        self._completed_first: OrderedDict[tuple[str, ReplicaID], int] = OrderedDict()
        register(self._deployment_id.app_name, self._deployment_id.name, self)
        self._ray_counter = _ray_decision_counter()
        self.route_log = RouteLog()  # each request's decision, for its trace (the ingress takes it)
        self.tier_hint: dict[str, str] | None = None  # the last exact choice's `kv_tier_peer` (tier_peer)

    # ------------------------------------------------------------------ the choice

    @property
    def exact_routing(self) -> bool:
        """Whether this router keeps a KV index and routes on it (the "exact" policy)."""
        return self.chooser.exact_routing

    def replica_load(self, replica: RunningReplica) -> float:
        cached = self._replica_queue_len_cache.get(replica.replica_id) or 0
        in_flight = max(self.in_flight.get(replica.replica_id, 0), cached)
        return engine_load(in_flight, replica.routing_stats, self.policy.params.kv_weight)

    def choose(self, replicas: Sequence[RunningReplica], prompt: Sequence[int] | None,
               cache_salt: str | None = None, request_id: str | None = None,
               adapter: str | None = None, lora_key: tuple = ()) -> RunningReplica:
        """The policy's choice among `replicas` for this prompt (None: load only), among the replicas that hold
        its LoRA `adapter` (by name) first (`prefer_holders`); remembers the prefix. The prompt's hashes carry
        `cache_salt` and the adapter's `lora_key` (`LoRARequest.cache_key`) as the engine's do."""
        return self._choose(replicas, prompt, cache_salt, request_id, adapter, lora_key)[0]

    def _choose(self, replicas: Sequence[RunningReplica], prompt: Sequence[int] | None,
                cache_salt: str | None = None, request_id: str | None = None,
                adapter: str | None = None, lora_key: tuple = ()) -> tuple[RunningReplica, str]:
        by_id = {r.replica_id: r for r in replicas}
        self.tier_hint = None
        for r in replicas:
            self.breaker.observe(r.replica_id, r.routing_stats, bool((r.routing_stats or {}).get("healthy", True)))
        healthy = [r for r in replicas if (r.routing_stats or {}).get("healthy", True)] or list(replicas)
        healthy = [r for r in healthy if self.breaker.is_routable(r.replica_id)] or healthy
        block_size = next((int(r.routing_stats["block_size"]) for r in replicas
                           if (r.routing_stats or {}).get("block_size")), None)
        choice = self.chooser.choose([r.replica_id for r in healthy], lambda rid: by_id[rid].routing_stats,
                                     lambda rid: self.replica_load(by_id[rid]), prompt, block_size, cache_salt,
                                     request_id, adapter, lora_key)
        self._count_in_ray(choice.decision)
        if choice.tier_peer is not None:
            peer = choice.tier_peer[0]
            self.tier_hint = {"app": peer.deployment_id.app_name, "deployment": peer.deployment_id.name,
                              "replica": peer.unique_id}
        return by_id[choice.key], choice.decision

    def _count_in_ray(self, decision: str) -> None:
        if self._ray_counter is not None:
            try:
                self._ray_counter.inc(1.0, tags={"decision": decision, "deployment": self._deployment_id.name,
                                                 "application": self._deployment_id.app_name})
            except Exception:  # noqa: BLE001 - metrics are optional; routing is not
                self._ray_counter = None

    def _sync_index(self, replicas: Sequence[RunningReplica]) -> None:
        """Apply the KV reports in the replicas' latest routing stats to this router's index (kept under the
        exact policy only)."""
        now = time.monotonic()
        for replica in replicas:
            self.chooser.sync(replica.replica_id, replica.routing_stats, now)

    def observe_cached(self, request_id: str, num_cached_tokens: int) -> None:
        """What the engine really found for a request this router predicted (the engine client calls it)."""
        self.chooser.observe_cached(request_id, num_cached_tokens)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        pinned = pinned_replica(pending_request)
        if pinned is not None:
            named = [r for r in candidate_replicas if r.replica_id.unique_id == pinned]
            return [named or [min(candidate_replicas, key=self.replica_load)]]
        request_id, cache_salt = request_of(pending_request)
        adapter = adapter_of(pending_request)
        lora_key = lora_key_of(pending_request)
        prompt = prompt_of(pending_request)
        if request_id is None:
            choice = self.choose(candidate_replicas, prompt, cache_salt, adapter=adapter, lora_key=lora_key)
        else:
            choice, record = timed_choice(
                lambda: self._choose(candidate_replicas, prompt, cache_salt, request_id, adapter, lora_key),
                candidate_replicas, self.replica_load, self._deployment_id.name,
                name=lambda replica: replica.replica_id.unique_id)
            self.route_log.record(request_id, record)
        if self.tier_hint is not None and pending_request is not None and pending_request.metadata.call_method == "generate":
            pending_request.kwargs["kv_tier_peer"] = self.tier_hint  # (Serve sends the kwargs after this)
        rest = sorted((r for r in candidate_replicas if r.replica_id != choice.replica_id), key=self.replica_load)
        return [[choice], rest] if rest else [[choice]]

    # ------------------------------------------------------------------ Serve's lifecycle hooks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self.num_routed[replica_id] = self.num_routed.get(replica_id, 0) + 1
        internal_id = getattr(getattr(pending_request, "metadata", None), "internal_request_id", None)
        key = (internal_id, replica_id)
        if not (internal_id and _count_down(self._completed_first, key)):  # (else: it has already completed)
            self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1
            if internal_id:
                _count_up(self._counted, key)
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

    def record_refusal(self, internal_request_id: str) -> None:
        """The engine refused a request this router routed for load: pass its replica over for a moment."""
        replica_id = self._routed_to.pop(internal_request_id, None)
        if replica_id is not None:
            self.breaker.refused(replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        key = (internal_request_id, replica_id)
        if internal_request_id and not _count_down(self._counted, key):
            # Not routed there (yet): a completion that came first, or a request the replica refused.
            _count_up(self._completed_first, key, bounded=True)
            return
        if self.in_flight.get(replica_id, 0) > 0:
            self.in_flight[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.chooser.forget(replica_id)
        self.breaker.forget(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for gone in [rid for rid in self.chooser.known() if rid not in live]:
            self.chooser.forget(gone)
            self.breaker.forget(gone)
        self._sync_index(replicas)  # every broadcast of the stats: fewer reports missed, fewer resyncs
        for table in (self.in_flight, self.num_routed):
            for gone in [rid for rid in table if rid not in live]:
                table.pop(gone, None)

    # ------------------------------------------------------------------ what /metrics reads

    def snapshot(self) -> dict[str, Any]:
        """The replicas' latest routing stats (labelled by replica), this router's decision counts."""
        replicas = []
        for replica in self._replicas_list:
            stats: Mapping = replica.routing_stats or {}
            view = self.index.views.get(replica.replica_id)
            replicas.append({
                **{k: v for k, v in stats.items() if k not in ("prefix_hashes", "kv_events")},
                "num_prefixes": len(stats.get("prefix_hashes") or ()),
                "kv_view": None if view is None else {"stale": view.stale, "seq": view.seq,
                                                      "blocks": {t: len(h) for t, h in view.tiers.items()},
                                                      "engine_blocks": dict(view.engine_sizes)},
                "replica": replica.replica_id.unique_id,
                "in_flight": self.in_flight.get(replica.replica_id, 0),
                "num_routed": self.num_routed.get(replica.replica_id, 0),
                "circuit_open": self.breaker.is_open(replica.replica_id),
            })
        kv_index = {**asdict(self.index.counters), "stale_engines": self.index.num_stale(),
                    "blocks": self.index.num_keys()}
        return {"replicas": replicas, "decisions": dict(self.policy.decisions), "circuit_opens": self.breaker.num_opens,
                "kv_index": kv_index, "predictions": asdict(self.prediction_counters)}


def _ray_decision_counter() -> Any:
    """Routing decisions in Ray's metrics export too: every router process's counts, summed there (the
    ingress's /metrics shows its own router's); None where Ray metrics are unavailable."""
    try:
        from ray.util.metrics import Counter

        return Counter("pagedserve_routing_decisions", "Engine routing decisions by kind, all routers.",
                       tag_keys=("decision", "deployment", "application"))
    except Exception:  # noqa: BLE001 - metrics are optional; routing is not
        return None
