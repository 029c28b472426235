"""The data-parallel routing policy, shared by the Serve request router and the in-process coordinator
(both apply it through prefix_chooser.PrefixChooser).

Power of two choices by load, with prefix affinity. A candidate's load is its requests (the larger of
those in flight from this router and its engine's waiting + running) plus `kv_weight * kv_cache_usage`. Affinity keys are the
chained block hashes (`engine.core.block_pool.hash_block_tokens`) of the prompt's first
`affinity_blocks` full blocks; the longest known prefix wins, and its holder is used unless its load
exceeds `imbalance_factor * (the two-choice winner's load) + imbalance_slack`. The slack (default 2
requests) keeps affinity when the other engine is idle and the holder's stats, which lag, still show
the request that just finished there.

The policy is generic over candidate keys (an engine index, a Serve replica id): callers give the
candidates, a load function and a lookup hash -> holder, and get back the choice and why it was made.

Exact routing (`choose_by_holdings`) replaces the affinity guess where a router knows what each engine's
KV tiers hold (kv_index.py): a candidate's score is the prompt tokens it holds, the device's longest
prefix plus `offload_weight` times the tokens that continue it in an offload tier (a reload is cheaper
than a prefill, dearer than a hit); the highest score wins among the candidates whose load is within the
imbalance bound of the two-choice winner, ties to the less loaded. A candidate whose view is stale is
scored by the approximate signals (what it reported serving, where this router sent prefixes).

The cache-blind baselines a benchmark compares against (`ServeArgs.routing_policy`): `choose_random`
(uniformly at random) and `choose_least_loaded_of_two` (power of two choices by load, no prefix at all).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from pagedserve.engine.core.block_pool import BlockHash, prompt_block_hashes

K = TypeVar("K", bound=Hashable)

# Why a request went where it went (counted for /metrics).
SINGLE = "single"  # one candidate only
AFFINE = "prefix_affine"  # the holder of the longest known prefix, within the imbalance bound
FALLBACK = "prefix_fallback"  # a prefix holder existed but was too loaded: the two-choice winner instead
BALANCED = "balanced"  # no known prefix: the less loaded of two random candidates
RANDOM = "random"  # the random policy: uniformly at random
# Exact routing's kinds.
EXACT_HIT = "exact_hit"  # the choice holds a prefix of the prompt on its device
OFFLOAD_HIT = "offload_hit"  # ... part of it only in an offload tier
MISS = "miss"  # no candidate within the bound holds any of it: the two-choice winner
STALE_FALLBACK = "stale_fallback"  # the choice's view was stale: scored approximately
DECISIONS = (SINGLE, AFFINE, FALLBACK, BALANCED, RANDOM, EXACT_HIT, OFFLOAD_HIT, MISS, STALE_FALLBACK)


@dataclass(frozen=True)
class Holding:
    """What a candidate holds of a prompt, in tokens: on the device, then only in an offload tier."""

    device_tokens: int = 0
    offload_tokens: int = 0
    stale: bool = False


def engine_load(in_flight: float, stats: Mapping | None, kv_weight: float) -> float:
    """The load figure both routers compare: requests on the engine + kv_weight * KV usage.

    Requests on the engine are the larger of what this router has in flight there (exact, live) and
    the engine's own waiting + running (everyone's requests, as of its last stats): they count the
    same requests, so adding them would count each twice, and stale stats of a request that just
    finished would keep an idle engine looking busy."""
    stats = stats or {}
    engine_count = stats.get("num_waiting", 0) + stats.get("num_running", 0)
    return max(in_flight, engine_count) + kv_weight * stats.get("kv_cache_usage", 0.0)


def prefix_hashes(prompt_token_ids: Sequence[int], block_size: int, max_blocks: int | None,
                  cache_salt: str | None = None, lora_key: tuple = ()) -> list[BlockHash]:
    """Chained hashes of the prompt's first `max_blocks` full blocks (the j-th covers blocks 0..j), as
    the engine's prefix cache computes them: salted by `cache_salt` and keyed by the LoRA adapter the
    request runs under (`lora_key`: `LoRARequest.cache_key`, () for the base model), through the one
    chain both share (`block_pool.first_block_extra_keys`)."""
    return prompt_block_hashes(prompt_token_ids, block_size, cache_salt, max_blocks, lora_key)


def prefer_holders(candidates: Sequence[K], load: Callable[[K], float], holds: Callable[[K], bool],
                   params: RoutingParams) -> list[K]:
    """Multi-LoRA: the candidates that already hold the request's adapter (resident, as their stats report),
    when the least loaded of them is within the imbalance bound of the least loaded candidate overall
    (else every candidate: an adapter loads from disk faster than an overloaded engine drains)."""
    holders = [c for c in candidates if holds(c)]
    if not holders or len(holders) == len(candidates):
        return list(candidates)
    best = min(load(c) for c in candidates)
    if min(load(h) for h in holders) <= params.imbalance_factor * best + params.imbalance_slack:
        return holders
    return list(candidates)


def short_hash(block_hash: bytes) -> str:
    """How a prefix hash travels in routing stats: 16 hex digits (64 bits) of the SHA-256."""
    return block_hash[:8].hex()


@dataclass
class RoutingParams:
    """The policy's knobs (validated: a bad value is a ValueError naming the field)."""

    affinity_blocks: int = 4
    imbalance_factor: float = 2.0
    kv_weight: float = 4.0
    max_affinity_entries: int = 65536
    imbalance_slack: float = 2.0
    offload_weight: float = 0.5

    def __post_init__(self) -> None:
        if not 0 <= self.offload_weight <= 1:
            raise ValueError(f"offload_weight: must be in [0, 1], got {self.offload_weight}")
        if self.imbalance_slack < 0:
            raise ValueError(f"imbalance_slack: must be >= 0, got {self.imbalance_slack}")
        if self.affinity_blocks < 0:
            raise ValueError(f"affinity_blocks: must be >= 0, got {self.affinity_blocks}")
        if self.imbalance_factor < 1.0:
            raise ValueError(f"imbalance_factor: must be >= 1, got {self.imbalance_factor}")
        if self.kv_weight < 0:
            raise ValueError(f"kv_weight: must be >= 0, got {self.kv_weight}")
        if self.max_affinity_entries < 1:
            raise ValueError(f"max_affinity_entries: must be >= 1, got {self.max_affinity_entries}")


class RoutingPolicy(Generic[K]):
    """Chooses among candidates; remembers where each prefix was sent (a bounded LRU hash -> key)."""

    def __init__(self, params: RoutingParams | None = None, seed: int | None = 0) -> None:
        self.params = params or RoutingParams()
        self._rng = random.Random(seed)
        self._affinity: OrderedDict[BlockHash, K] = OrderedDict()
        self.decisions: dict[str, int] = dict.fromkeys(DECISIONS, 0)

    def choose(
        self,
        candidates: Sequence[K],
        load: Callable[[K], float],
        hashes: Sequence[BlockHash] = (),
        holder: Callable[[BlockHash], K | None] | None = None,
    ) -> tuple[K, str]:
        """(choice, decision). `holder(hash)` names a candidate known to hold that prefix (besides
        what this policy remembered itself), or None."""
        if not candidates:
            raise ValueError("candidates: need at least one")
        if len(candidates) == 1:
            return self._count(candidates[0], SINGLE)
        first, second = self._rng.sample(list(candidates), 2)
        choice = first if load(first) <= load(second) else second
        affine = self._affine(candidates, hashes, holder)
        if affine is None:
            return self._count(choice, BALANCED)
        if load(affine) <= self.params.imbalance_factor * load(choice) + self.params.imbalance_slack:
            return self._count(affine, AFFINE)
        return self._count(choice, FALLBACK)

    def choose_random(self, candidates: Sequence[K]) -> tuple[K, str]:
        """(choice, decision): one candidate uniformly at random (the cache-blind, load-blind baseline)."""
        if not candidates:
            raise ValueError("candidates: need at least one")
        if len(candidates) == 1:
            return self._count(candidates[0], SINGLE)
        return self._count(self._rng.choice(list(candidates)), RANDOM)

    def choose_least_loaded_of_two(self, candidates: Sequence[K], load: Callable[[K], float]) -> tuple[K, str]:
        """(choice, decision): the less loaded of two candidates drawn at random (power of two choices, blind
        to what any cache holds)."""
        if not candidates:
            raise ValueError("candidates: need at least one")
        if len(candidates) == 1:
            return self._count(candidates[0], SINGLE)
        first, second = self._rng.sample(list(candidates), 2)
        return self._count(first if load(first) <= load(second) else second, BALANCED)

    def choose_by_holdings(self, candidates: Sequence[K], load: Callable[[K], float],
                           holding: Callable[[K], Holding], last_sent: K | None = None) -> tuple[K, str, Holding]:
        """(choice, decision, what the choice holds): exact routing (see the module docstring). On a miss (no
        candidate within the bound holds any of the prompt) the choice is `last_sent`, where this prefix went
        last, when it is a candidate within the bound: a tenant whose prefix was evicted everywhere stays
        where its next request will find what this one stores, instead of moving its working set to whichever
        replica the two-choice draw favours (which fills that replica's cache with another's tenants)."""
        if not candidates:
            raise ValueError("candidates: need at least one")
        if len(candidates) == 1:
            only = candidates[0]
            return (*self._count(only, SINGLE), holding(only))
        first, second = self._rng.sample(list(candidates), 2)
        winner = first if load(first) <= load(second) else second
        bound = self.params.imbalance_factor * load(winner) + self.params.imbalance_slack
        weight = self.params.offload_weight
        winner_holding = holding(winner)
        best, best_key, best_holding = winner, None, winner_holding
        for key in candidates:
            held = winner_holding if key == winner else holding(key)
            score = held.device_tokens + weight * held.offload_tokens
            if score <= 0 or load(key) > bound:
                continue
            rank = (score, -load(key))
            if best_key is None or rank > best_key:
                best, best_key, best_holding = key, rank, held
        if best_key is None and last_sent is not None and last_sent != winner and last_sent in candidates \
                and load(last_sent) <= bound:
            best, best_holding = last_sent, holding(last_sent)
        if best_holding.stale:
            decision = STALE_FALLBACK
        elif best_key is None:
            decision = MISS
        else:
            decision = OFFLOAD_HIT if best_holding.offload_tokens else EXACT_HIT
        return (*self._count(best, decision), best_holding)

    def remember(self, hashes: Sequence[BlockHash], key: K) -> None:
        for block_hash in hashes:
            self._affinity[block_hash] = key
            self._affinity.move_to_end(block_hash)
        while len(self._affinity) > self.params.max_affinity_entries:
            self._affinity.popitem(last=False)

    def remembered(self, block_hash: BlockHash) -> K | None:
        """Where this policy last sent the prefix ending in this block (None: not remembered)."""
        return self._affinity.get(block_hash)

    def forget(self, key: K) -> None:
        """Drop what was remembered about a candidate that went away."""
        for block_hash in [h for h, k in self._affinity.items() if k == key]:
            del self._affinity[block_hash]

    def sent_to(self, candidates: Sequence[K], hashes: Sequence[BlockHash]) -> K | None:
        """The candidate this policy last sent the longest remembered prefix of `hashes` to, else None."""
        return self._affine(candidates, hashes, None)

    def _affine(self, candidates: Sequence[K], hashes: Sequence[BlockHash],
                holder: Callable[[BlockHash], K | None] | None) -> K | None:
        allowed = set(candidates)
        for block_hash in reversed(hashes):  # longest known prefix first
            # What a candidate reports holding beats where this policy sent the prefix itself.
            key = holder(block_hash) if holder is not None else None
            if key is None:
                key = self._affinity.get(block_hash)
            if key is not None and key in allowed:
                return key
        return None

    def _count(self, key: K, decision: str) -> tuple[K, str]:
        self.decisions[decision] += 1
        return key, decision
