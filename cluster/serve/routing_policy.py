"""The data-parallel routing policy, shared by the Serve request router and the in-process coordinator.

Power of two choices by load, with prefix affinity. A candidate's load is its requests (the larger of
those in flight from this router and its engine's waiting + running) plus `kv_weight * kv_cache_usage`. Affinity keys are the
chained block hashes (`engine.core.block_pool.hash_block_tokens`) of the prompt's first
`affinity_blocks` full blocks; the longest known prefix wins, and its holder is used unless its load
exceeds `imbalance_factor * (the two-choice winner's load) + imbalance_slack`. The slack (default 2
requests) keeps affinity when the other engine is idle and the holder's stats, which lag, still show
the request that just finished there.

The policy is generic over candidate keys (an engine index, a Serve replica id): callers give the
candidates, a load function and a lookup hash -> holder, and get back the choice and why it was made.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from pagedserve.engine.core.block_pool import BlockHash, hash_block_tokens

K = TypeVar("K", bound=Hashable)

# Why a request went where it went (counted for /metrics).
SINGLE = "single"  # one candidate only
AFFINE = "prefix_affine"  # the holder of the longest known prefix, within the imbalance bound
FALLBACK = "prefix_fallback"  # a prefix holder existed but was too loaded: the two-choice winner instead
BALANCED = "balanced"  # no known prefix: the less loaded of two random candidates
DECISIONS = (SINGLE, AFFINE, FALLBACK, BALANCED)


def engine_load(in_flight: float, stats: Mapping | None, kv_weight: float) -> float:
    """The load figure both routers compare: requests on the engine + kv_weight * KV usage.

    Requests on the engine are the larger of what this router has in flight there (exact, live) and
    the engine's own waiting + running (everyone's requests, as of its last stats): they count the
    same requests, so adding them would count each twice, and stale stats of a request that just
    finished would keep an idle engine looking busy."""
    stats = stats or {}
    engine_count = stats.get("num_waiting", 0) + stats.get("num_running", 0)
    return max(in_flight, engine_count) + kv_weight * stats.get("kv_cache_usage", 0.0)


def prefix_hashes(prompt_token_ids: Sequence[int], block_size: int, max_blocks: int) -> list[BlockHash]:
    """Chained hashes of the prompt's first `max_blocks` full blocks (the j-th covers blocks 0..j)."""
    num_blocks = min(max_blocks, len(prompt_token_ids) // block_size)
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for b in range(num_blocks):
        parent = hash_block_tokens(parent, prompt_token_ids[b * block_size:(b + 1) * block_size])
        hashes.append(parent)
    return hashes


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

    def __post_init__(self) -> None:
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

    def hashes(self, prompt_token_ids: Sequence[int], block_size: int | None) -> list[BlockHash]:
        if not block_size or block_size < 1:
            return []
        return prefix_hashes(prompt_token_ids, block_size, self.params.affinity_blocks)

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

    def remember(self, hashes: Sequence[BlockHash], key: K) -> None:
        for block_hash in hashes:
            self._affinity[block_hash] = key
            self._affinity.move_to_end(block_hash)
        while len(self._affinity) > self.params.max_affinity_entries:
            self._affinity.popitem(last=False)

    def forget(self, key: K) -> None:
        """Drop what was remembered about a candidate that went away."""
        for block_hash in [h for h, k in self._affinity.items() if k == key]:
            del self._affinity[block_hash]

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
