"""The KV cache manager: which blocks each request owns, prefix-cache lookups, and hit stats.

The scheduler talks to this class only. A request (duck-typed) provides `request_id`,
`all_token_ids`, `num_tokens`, `num_computed_tokens`, `cache_salt`, `num_preemptions`,
`skip_reading_prefix_cache` and optionally `lora_request`.

Per request the manager keeps its block list, the hashes of its full blocks (extended
incrementally as tokens arrive, never recomputed) and how many of its blocks are
already registered in the prefix cache. `free` drops all of it.

Blocks whose KV a connector is still loading (prefill/decode disaggregation) are no prefix hits for
anyone: they are registered only once the load has come back intact (`finish_load`), so a load that
fails can only ever have been read by the request that loaded it. Blocks found untrustworthy after
the fact (`invalidate_blocks`) lose their hashes, and every request holding one is told where its
valid prefix ends so that it recomputes from there.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from pagedserve.engine.core.block_pool import BlockHash, BlockPool, CacheEventSink, KVCacheBlock, extend_block_hashes


class KVRequest(Protocol):
    """What the manager reads from a request."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    cache_salt: str | None
    num_preemptions: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def skip_reading_prefix_cache(self) -> bool: ...


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters, in tokens (requests counts first allocations).

    Each request's prompt is counted once, when it is first scheduled. A preempted request
    that resumes looks up the cache again; that lookup goes to the `preempted_*` counters so it
    does not inflate the hit rate (it mostly hits its own blocks). A request that does not read
    the cache (prompt logprobs) is not a query.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 events: CacheEventSink | None = None) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size: must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, events)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_hashes: dict[str, list[BlockHash]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        # Requests with a KV load in flight -> index of the first of their blocks it writes: neither that
        # block nor any later one enters the prefix cache before the load has landed.
        self._loading_from: dict[str, int] = {}
        self._stats = PrefixCacheStats()
        self.total_prefix_cache_stats = PrefixCacheStats()

    # ---- sizes -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens: must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ------------------------------------------------------------------

    def block_hashes(self, request: KVRequest) -> list[BlockHash]:
        """The request's full-block hashes, extended to cover its current full blocks."""
        hashes = self.req_to_block_hashes.get(request.request_id)
        if hashes is None:
            hashes = self.req_to_block_hashes[request.request_id] = []
        if len(hashes) < len(request.all_token_ids) // self.block_size:
            # The salt and the adapter enter the first block; the chain carries them to all later ones.
            lora = getattr(request, "lora_request", None)
            extend_block_hashes(hashes, request.all_token_ids, self.block_size, request.cache_salt,
                                lora_key=lora.cache_key if lora is not None else ())
        return hashes

    def get_computed_blocks(self, request: KVRequest) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of the request, and the tokens they hold.

        The hit stops short of the last token, which must be recomputed to produce logits.
        A request that skips reading the cache (prompt logprobs) gets no hit.
        Ref counts and stats are untouched: `allocate_slots` takes the references.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        hashes = self.block_hashes(request)
        max_blocks = max(0, request.num_tokens - 1) // self.block_size
        computed: list[KVCacheBlock] = []
        get = self.block_pool.get_cached_block
        for h in hashes[:max_blocks]:
            block = get(h)
            if block is None:
                break
            computed.append(block)
        return computed, len(computed) * self.block_size

    # ---- allocation --------------------------------------------------------------------

    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_loading_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make the request own blocks for computed + new computed + new tokens.

        `num_loading_tokens`: the first that many of the new tokens get their KV from a connector's
        load, not from this step's computation; the blocks from the one holding the first of them on
        stay out of the prefix cache until `finish_load`.

        Returns the newly allocated blocks (not the hit blocks), or None, with nothing
        changed, when there are not enough free blocks.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens: must be >= 0, got {num_new_tokens}")
        if num_new_computed_tokens < 0:
            raise ValueError(f"num_new_computed_tokens: must be >= 0, got {num_new_computed_tokens}")
        if not 0 <= num_loading_tokens <= num_new_tokens:
            raise ValueError(f"num_loading_tokens: must be in [0, num_new_tokens={num_new_tokens}], "
                             f"got {num_loading_tokens}")
        rid = request.request_id
        hit_blocks = new_computed_blocks or []
        req_blocks = self.req_to_blocks.get(rid)
        first_allocation = req_blocks is None
        if hit_blocks and req_blocks:
            raise ValueError(f"new_computed_blocks: request {rid} already holds blocks")
        num_prior_tokens = request.num_computed_tokens + num_new_computed_tokens
        if len(hit_blocks) * self.block_size > num_prior_tokens:
            raise ValueError(
                f"new_computed_blocks: {len(hit_blocks)} blocks exceed the "
                f"{num_prior_tokens} computed tokens"
            )

        num_total_tokens = num_prior_tokens + num_new_tokens
        num_held = (len(req_blocks) if req_blocks else 0) + len(hit_blocks)
        num_needed = max(0, self.num_blocks_for(num_total_tokens) - num_held)
        # Hit blocks with ref 0 are counted as free now but leave the free queue when touched.
        num_free_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if num_needed > self.block_pool.num_free_blocks - num_free_hits:
            return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[rid] = []
        if hit_blocks:
            self.block_pool.touch(hit_blocks)  # before get_new_blocks, so hits are not evicted
            req_blocks.extend(hit_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_needed)
        req_blocks.extend(new_blocks)
        if num_loading_tokens:
            self._loading_from.setdefault(rid, num_prior_tokens // self.block_size)

        if self.enable_caching:
            self._cache_full_blocks(request, req_blocks, min(num_total_tokens, len(request.all_token_ids)))
        if first_allocation and self.enable_caching and not request.skip_reading_prefix_cache:
            self._record_stats(request.num_tokens, num_new_computed_tokens, request.num_preemptions > 0)
        return new_blocks

    def _cache_full_blocks(self, request: KVRequest, req_blocks: list[KVCacheBlock], num_known_tokens: int) -> None:
        rid = request.request_id
        num_cached = self.num_cached_blocks.get(rid, 0)
        num_full = min(num_known_tokens // self.block_size, self._loading_from.get(rid, num_known_tokens))
        if num_full <= num_cached:
            return
        hashes = self.block_hashes(request)
        self.block_pool.cache_full_blocks(req_blocks, hashes, num_cached, num_full)
        self.num_cached_blocks[rid] = num_full

    def finish_load(self, request: KVRequest) -> None:
        """The request's KV load landed intact: its loaded (and since computed) full blocks become prefix hits."""
        rid = request.request_id
        if self._loading_from.pop(rid, None) is None:
            return
        blocks = self.req_to_blocks.get(rid)
        if blocks and self.enable_caching:
            self._cache_full_blocks(request, blocks, min(request.num_computed_tokens, len(request.all_token_ids)))

    def invalidate_blocks(self, block_ids: Iterable[int]) -> dict[str, int]:
        """Blocks whose KV is not to be trusted (a load that failed): no lookup finds them again.

        Returns every request holding one of them -> the index (in its block list) of its first such
        block. Its blocks from there on lose their hashes too (their KV was computed over the invalid
        one) and are registered again as the request recomputes them. Blocks stay allocated: the caller
        rolls each request's computed tokens back to the start of its first invalid block (or frees it).
        """
        invalid = set(block_ids)
        if not invalid:
            return {}
        pool = self.block_pool
        for block_id in invalid:
            pool.uncache_block(pool.blocks[block_id])
        affected: dict[str, int] = {}
        for rid, blocks in self.req_to_blocks.items():
            first = next((i for i, b in enumerate(blocks) if b.block_id in invalid), None)
            if first is None:
                continue
            affected[rid] = first
            for block in blocks[first:]:
                pool.uncache_block(block)
            self.num_cached_blocks[rid] = min(self.num_cached_blocks.get(rid, 0), first)
            if self._loading_from.get(rid, first) >= first:
                self._loading_from.pop(rid, None)  # (a load into blocks it will recompute anyway)
        return affected

    def _record_stats(self, num_query_tokens: int, num_hit_tokens: int, resumed: bool) -> None:
        for stats in (self._stats, self.total_prefix_cache_stats):
            if resumed:
                stats.preempted_requests += 1
                stats.preempted_queries += num_query_tokens
                stats.preempted_hits += num_hit_tokens
            else:
                stats.requests += 1
                stats.queries += num_query_tokens
                stats.hits += num_hit_tokens

    def free(self, request: KVRequest) -> None:
        """Release all of the request's blocks, tail first (so the tail is evicted before the prefix)."""
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        self.req_to_block_hashes.pop(rid, None)
        self.num_cached_blocks.pop(rid, None)
        self._loading_from.pop(rid, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        """Physical block ids of the request in logical order ([] if it holds none)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def uncache_blocks(self, request_id: str) -> None:
        """Forget the prefix-cache hashes of the request's blocks: a failed forward pass may have left
        their contents incomplete, so no later request may reuse them. Call before freeing."""
        for block in self.req_to_blocks.get(request_id, ()):
            self.block_pool.uncache_block(block)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Counters since the previous call (then reset)."""
        stats, self._stats = self._stats, PrefixCacheStats()
        return stats
