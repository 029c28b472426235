"""The choice of an engine for one request under a routing policy, shared by both routers of user
requests: the Serve request router (router.PrefixAffinityRouter, keyed by replica id) and the in-process
coordinator (coordinator.DPCoordinator, keyed by engine index).

A caller gives the candidates (already narrowed by health and its circuit breaker), each candidate's
routing stats (`EngineHost.record_routing_stats`: load figures, `block_size`, `prefix_hashes`,
`lora_adapters`, `kv_events`) and load, and the request's prompt, cache salt and LoRA adapter; it gets
back the choice, why, and (exact routing) a candidate whose offload tier holds a longer run of the
prompt than the choice (`tier_peer`). The policies (settings.ROUTING_POLICIES):

- "random", "power_of_two": blind to prefixes and adapters (the benchmark's baselines).
- "prefix_approx": the candidates holding the adapter first (`prefer_holders`), then bounded prefix
  affinity on what candidates reported serving and where this chooser sent each prefix.
- "exact": as "prefix_approx" for the adapter; then, where candidates publish KV events, the prompt
  tokens each holds by this chooser's index of their tiers (kv_index.py) against its load
  (`RoutingPolicy.choose_by_holdings`); a candidate whose view is stale is scored approximately.

Tenant isolation: every hash a choice compares is the engine's own prefix-cache chain hash of the prompt
under its cache salt and the adapter's `LoRARequest.cache_key` (`routing_policy.prefix_hashes`), so a
prefix is never routed toward a cache that cannot hit it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic

from pagedserve.cluster.serve.kv_feed import key_of
from pagedserve.cluster.serve.kv_index import ClusterKVIndex, PredictionCounters, RecentRoutes
from pagedserve.cluster.serve.routing_policy import (
    Holding, K, RoutingParams, RoutingPolicy, prefer_holders, prefix_hashes, short_hash,
)
from pagedserve.cluster.settings import check_routing_policy
from pagedserve.engine.core.kv_events import DEVICE

MAX_PREDICTIONS = 16384  # predictions awaiting the engine's answer (the oldest are dropped)


def tier_peer(index: ClusterKVIndex, choice: Hashable, candidates: Sequence[Hashable], keys: Sequence[bytes],
              held_blocks: int | None = None) -> tuple[Hashable, int] | None:
    """(the candidate other than `choice` whose offload tier holds the longest run of the prompt's blocks
    from its first, that run's length in blocks), when that run is longer than what `choice` holds anywhere
    (`held_blocks`, else by `index`); fresh views only; else None. The chosen engine fetches the difference
    from that replica's tier (cluster/serve/tier_peer.py)."""
    best, best_n = None, index.held_blocks(choice, keys)[1] if held_blocks is None else held_blocks
    for rid in candidates:
        view = index.views.get(rid)
        if rid == choice or view is None or not view.fresh:
            continue
        tiers = [held for tier, held in view.tiers.items() if tier != DEVICE]
        n = 0
        while n < len(keys) and any(keys[n] in held for held in tiers):
            n += 1
        if n > best_n:
            best, best_n = rid, n
    return None if best is None else (best, best_n)


@dataclass(frozen=True)
class Choice(Generic[K]):
    """A routing decision: the candidate, why (routing_policy.DECISIONS), and under exact routing a
    candidate whose offload tier holds a longer run of the prompt (and that run, in blocks), or None."""

    key: K
    decision: str
    tier_peer: tuple[K, int] | None = None


class PrefixChooser(Generic[K]):
    """One router's policy state: its affinity memory, KV index, recent routes and cached-token predictions.

    `tier_peers`: whether exact choices name a tier peer (a caller that can pass the hint on to the engine);
    without it the prediction is what the choice itself holds."""

    def __init__(self, params: RoutingParams | None = None, routing_policy: str = "exact", seed: int | None = None,
                 silent_after_s: float = 10.0, recent_routes_s: float = 5.0, tier_peers: bool = True) -> None:
        self.policy: RoutingPolicy[K] = RoutingPolicy(params, seed=seed)
        self.routing_policy = check_routing_policy(routing_policy)
        self.index = ClusterKVIndex(silent_after_s)
        self.recent = RecentRoutes(recent_routes_s)
        self.tier_peers = tier_peers
        self.predictions: OrderedDict[str, int] = OrderedDict()  # request id -> predicted cached tokens
        self.prediction_counters = PredictionCounters()
        self._held: dict[K, tuple[int, frozenset[str]]] = {}  # candidate -> (id(reported list), hashes)

    @property
    def exact_routing(self) -> bool:
        """Whether this chooser keeps a KV index and routes on it (the "exact" policy)."""
        return self.routing_policy == "exact"

    def reported_prefixes(self, key: K, stats: Mapping | None) -> frozenset[str]:
        """The short prefix hashes `key` reported serving (cached per reported list)."""
        reported = (stats or {}).get("prefix_hashes") or ()
        cached = self._held.get(key)
        if cached is None or cached[0] != id(reported):
            cached = (id(reported), frozenset(reported))
            self._held[key] = cached
        return cached[1]

    def choose(self, candidates: Sequence[K], stats: Callable[[K], Mapping | None], load: Callable[[K], float],
               prompt: Sequence[int] | None, block_size: int | None, cache_salt: str | None = None,
               request_id: str | None = None, adapter: str | None = None, lora_key: tuple = ()) -> Choice[K]:
        """The policy's choice among `candidates` (at least one) for this prompt (None: load only), with
        the prompt's hashes under `cache_salt` and `lora_key`; remembers the prefix and, with `request_id`
        under exact routing, the predicted cached tokens (`observe_cached` checks them)."""
        if not candidates:
            raise ValueError("candidates: need at least one")
        if self.routing_policy in ("random", "power_of_two"):
            if self.routing_policy == "random":
                key, decision = self.policy.choose_random(candidates)
            else:
                key, decision = self.policy.choose_least_loaded_of_two(candidates, load)
            return Choice(key, decision)
        if adapter is not None:
            candidates = prefer_holders(candidates, load,
                                        lambda k: adapter in ((stats(k) or {}).get("lora_adapters") or ()),
                                        self.policy.params)
        if (self.exact_routing and prompt and block_size
                and any("kv_events" in (stats(k) or {}) for k in candidates)):
            return self._choose_exact(candidates, stats, load, prompt, block_size, cache_salt, request_id, lora_key)
        hashes = prefix_hashes(prompt, block_size, self.policy.params.affinity_blocks, cache_salt, lora_key) \
            if prompt and block_size else []

        def holder(block_hash: bytes) -> K | None:
            short = short_hash(block_hash)
            holders = [k for k in candidates if short in self.reported_prefixes(k, stats(k))]
            return min(holders, key=load) if holders else None

        key, decision = self.policy.choose(list(candidates), load, hashes, holder)
        if hashes:
            self.policy.remember(hashes, key)
        return Choice(key, decision)

    def _choose_exact(self, candidates: Sequence[K], stats: Callable[[K], Mapping | None],
                      load: Callable[[K], float], prompt: Sequence[int], block_size: int,
                      cache_salt: str | None, request_id: str | None, lora_key: tuple) -> Choice[K]:
        now = time.monotonic()
        for key in candidates:
            self.index.update(key, (stats(key) or {}).get("kv_events"), now)
        # Only blocks the engine can hit: its hit stops short of the prompt's last token.
        hashes = prefix_hashes(prompt, block_size, (len(prompt) - 1) // block_size, cache_salt, lora_key)
        keys = [key_of(h) for h in hashes]
        approx = hashes[:self.policy.params.affinity_blocks]

        def holding(key: K) -> Holding:
            view = self.index.views.get(key)
            if view is not None and view.fresh:
                device, held = self.index.held_blocks(key, keys)
                device = max(device, self.recent.held_blocks(key, keys, now, view.last_report_time))
                return Holding(device * block_size, (max(held, device) - device) * block_size)
            reported = self.reported_prefixes(key, stats(key))
            n = next((j + 1 for j in range(len(approx) - 1, -1, -1)
                      if short_hash(approx[j]) in reported or self.policy.remembered(approx[j]) == key), 0)
            return Holding(n * block_size, 0, stale=True)

        choice, decision, held = self.policy.choose_by_holdings(
            list(candidates), load, holding, last_sent=self.policy.sent_to(list(candidates), approx))
        predicted = held.device_tokens + held.offload_tokens
        peer = tier_peer(self.index, choice, list(candidates), keys, predicted // block_size) \
            if self.tier_peers else None
        if peer is not None:  # the engine fetches the peer's run first: it finds that much (if the fetch works)
            predicted = peer[1] * block_size
        self.recent.remember(keys, choice, now)
        self.policy.remember(approx, choice)
        if request_id is not None:
            self.predictions[request_id] = predicted
            while len(self.predictions) > MAX_PREDICTIONS:
                self.predictions.popitem(last=False)
        return Choice(choice, decision, peer)

    def sync(self, key: K, stats: Mapping | None, now: float | None = None) -> None:
        """Apply the KV report in `key`'s latest routing stats to the index (exact routing only)."""
        report = (stats or {}).get("kv_events")
        if self.exact_routing and report is not None:
            self.index.update(key, report, time.monotonic() if now is None else now)

    def observe_cached(self, request_id: str, num_cached_tokens: int) -> None:
        """What the engine really found for a request this chooser predicted."""
        predicted = self.predictions.pop(request_id, None)
        if predicted is not None:
            self.prediction_counters.observe(predicted, num_cached_tokens)

    def known(self) -> set[K]:
        """The candidates this chooser keeps anything about."""
        return set(self._held) | set(self.index.views)

    def forget(self, key: K) -> None:
        """Drop what is known of a candidate that went away."""
        self.policy.forget(key)
        self._held.pop(key, None)
        self.index.forget(key)
        self.recent.forget(key)
