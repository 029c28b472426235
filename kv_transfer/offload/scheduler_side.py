"""The offload tier's scheduler half: which blocks the tier holds, what spills and what loads back.

The index is this engine's share of the tier: the hashes it stored, least recently used first, bounded by
the tier's size in blocks. A cached block that the block pool takes for new use (`block_evicted`, called
while the step that will overwrite it is being scheduled) is stored: its (block id, hash) rides on that
step's metadata and every rank copies the block out before the step's forward pass. Past the size, the
least recently used entry is dropped (its files deleted), never one that a load of this engine is reading.

A waiting request's prefix that the device cache lacks is looked up block by block in the index, then on
the node (blocks other engines stored: `TierLocation.on_node`); the run of hits is loaded as the KV
connector's external tokens, layer by layer beside the forward pass, and its blocks enter the prefix cache
once the load landed (`KVCacheManager.finish_load`). A failed load makes the request recompute (the
scheduler's invalid-block roll-back) and drops the entries it read.

Blocks fetched from another node's tier (remote.py) are placed in this node's tier by the engine host and
`adopt`ed here: from the next step they are this engine's entries like its own spills (counted apart:
`remote_fetched_blocks`, and `remote_hit_tokens` when a load reads them).

Events: `listeners` hear "block offloaded (hash, tier)", "block dropped from tier (hash, tier)" and "block
reloaded from tier (hash, tier)" as the index changes (the KV event stream connects here).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pagedserve.kv_transfer.base import ConnectorRequest, KVConnectorScheduler
from pagedserve.kv_transfer.offload.tier_files import TierLocation

logger = logging.getLogger(__name__)


class OffloadTierListener(Protocol):
    """What the KV event stream hears from the offload tier (called on the scheduler's thread)."""

    def block_offloaded(self, block_hash: bytes, tier: str) -> None: ...

    def block_dropped(self, block_hash: bytes, tier: str) -> None: ...

    def block_reloaded(self, block_hash: bytes, tier: str) -> None: ...


@dataclass
class OffloadLoadJob:
    """Load tokens [token_start, token_end) of a request (whole blocks) from the tier into its blocks."""

    req_id: str
    block_ids: list[int]  # the request's blocks, logical order
    token_start: int
    token_end: int
    hashes: list[bytes]  # one per loaded block


@dataclass
class OffloadMetadata:
    """One step's tier work for every rank: copy out `stores` before the forward pass, load `loads` beside it,
    then delete `drops`."""

    loads: list[OffloadLoadJob] = field(default_factory=list)
    stores: list[tuple[int, bytes]] = field(default_factory=list)  # (block id, hash)
    drops: list[bytes] = field(default_factory=list)
    adopts: list[bytes] = field(default_factory=list)  # blocks fetched from another node's tier (remote.py)

    @property
    def is_empty(self) -> bool:
        return not self.loads and not self.stores and not self.drops and not self.adopts


@dataclass
class OffloadStats:
    """Cumulative tier counters (engine stats `kv_offload`, `pagedserve:kv_offload_*` metrics); tokens unless named."""

    query_tokens: int = 0  # prompt tokens the device cache did not hold, looked up in the tier
    hit_tokens: int = 0  # of those, loaded from the tier
    shared_hit_tokens: int = 0  # of the hits, from blocks another engine on the node stored
    loads: int = 0
    load_failures: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    stored_blocks: int = 0  # blocks spilled from the device cache
    stored_bytes: int = 0
    dropped_blocks: int = 0  # entries the LRU (or a failed load) removed
    remote_fetched_blocks: int = 0  # blocks fetched from another node's tier into this one (remote.py)
    remote_hit_tokens: int = 0  # of the hits, from blocks fetched from another node's tier
    resident_blocks: int = 0  # gauge: this engine's entries
    capacity_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class OffloadConnectorScheduler(KVConnectorScheduler):
    def __init__(self, location: TierLocation, block_size: int, capacity_blocks: int, block_bytes: int,
                 block_hashes: Callable[[ConnectorRequest], list[bytes]]) -> None:
        self.location = location
        self.tier = location.name
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes  # one block on every rank together
        self.block_hashes = block_hashes  # the request's full-block hash chain (the KV cache manager's)
        self.listeners: list[OffloadTierListener] = []
        self.stats = OffloadStats(capacity_blocks=capacity_blocks)
        self.index: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self._pins: dict[bytes, int] = {}  # entries loads in flight read
        self._matched: dict[str, list[bytes]] = {}  # this step's lookups, until allocation
        self._in_load: dict[str, OffloadLoadJob] = {}
        self._md = OffloadMetadata()
        self._remote: set[bytes] = set()  # entries fetched from another node's tier
        self._adopt_lock = threading.Lock()
        self._to_adopt: list[bytes] = []  # fetched blocks waiting for the scheduler's thread

    # ------------------------------------------------------------------ blocks from another node

    def adopt(self, hashes: list[bytes]) -> None:
        """Blocks fetched from another node's tier and placed in this one (remote.install_tier_blocks) become
        this engine's entries (thread-safe: taken in at the next step's metadata, before its lookups' loads
        are sent). Until then a lookup finds them on the node like any other engine's blocks."""
        with self._adopt_lock:
            self._to_adopt.extend(hashes)

    def _take_adopted(self) -> None:
        with self._adopt_lock:
            hashes, self._to_adopt = self._to_adopt, []
        for block_hash in hashes:
            if block_hash in self.index or self.capacity_blocks <= 0:
                continue
            self.index[block_hash] = None
            self._remote.add(block_hash)
            self._md.adopts.append(block_hash)
            self.stats.remote_fetched_blocks += 1
            self._emit("block_offloaded", block_hash)
        if hashes:
            self._shrink()

    # ------------------------------------------------------------------ spilling

    def block_evicted(self, block_id: int, block_hash: bytes) -> None:
        """The block pool reuses a cached block: store its KV (unless the tier holds it already)."""
        if block_hash in self.index:
            self.index.move_to_end(block_hash)
            return
        if self.capacity_blocks <= 0:
            return
        self.index[block_hash] = None
        self._md.stores.append((block_id, block_hash))
        self.stats.stored_blocks += 1
        self.stats.stored_bytes += self.block_bytes
        self._emit("block_offloaded", block_hash)
        self._shrink()

    def _shrink(self) -> None:
        protected = {h for hashes in self._matched.values() for h in hashes}
        while len(self.index) > self.capacity_blocks:
            victim = next((h for h in self.index if h not in self._pins and h not in protected), None)
            if victim is None:
                return  # everything left is being read: over by a little until those loads land
            self._drop(victim)

    def _drop(self, block_hash: bytes) -> None:
        if block_hash in self.index:
            del self.index[block_hash]
            self._remote.discard(block_hash)
            self._md.drops.append(block_hash)
            self.stats.dropped_blocks += 1
            self._emit("block_dropped", block_hash)

    def _emit(self, event: str, block_hash: bytes) -> None:
        for listener in self.listeners:
            try:
                getattr(listener, event)(block_hash, self.tier)
            except Exception:  # noqa: BLE001 - a listener never breaks the scheduler
                logger.exception("offload tier listener failed on %s", event)

    # ------------------------------------------------------------------ loading

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> int:
        """Whole blocks past the device cache's hits that the tier holds, stopping at the first miss and short
        of the last prompt token (computed for its logits)."""
        if getattr(request, "kv_offload_failed", False):
            return 0
        bs = self.block_size
        hashes = self.block_hashes(request)
        found = []
        for block_hash in hashes[num_computed_tokens // bs : max(0, request.num_tokens - 1) // bs]:
            if block_hash not in self.index and not self.location.on_node(block_hash):
                break
            found.append(block_hash)
        self._matched[request.request_id] = found
        return len(found) * bs

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int) -> None:
        found = self._matched.pop(request.request_id, [])
        if getattr(request, "num_preemptions", 0) == 0 and not getattr(request, "skip_reading_prefix_cache", False):
            self.stats.query_tokens += max(0, request.num_tokens - request.num_computed_tokens)
        if num_external_tokens == 0:
            return
        hashes = found[: num_external_tokens // self.block_size]
        start = request.num_computed_tokens
        job = OffloadLoadJob(request.request_id, list(block_ids), start, start + len(hashes) * self.block_size, hashes)
        self._md.loads.append(job)
        self._in_load[request.request_id] = job
        for block_hash in hashes:
            self._pins[block_hash] = self._pins.get(block_hash, 0) + 1
            if block_hash in self.index:
                self.index.move_to_end(block_hash)

    def is_loading(self, req_id: str) -> bool:
        return req_id in self._in_load

    def external_tokens_are_cached(self, request: ConnectorRequest) -> bool:
        return request.request_id in self._in_load

    def build_connector_metadata(self) -> OffloadMetadata:
        self._take_adopted()
        md, self._md = self._md, OffloadMetadata()
        self._matched.clear()  # lookups of requests that did not fit: done again next step
        self.stats.resident_blocks = len(self.index)
        return md

    def _unpin(self, job: OffloadLoadJob) -> None:
        for block_hash in job.hashes:
            left = self._pins.get(block_hash, 0) - 1
            if left > 0:
                self._pins[block_hash] = left
            else:
                self._pins.pop(block_hash, None)

    def load_finished(self, req_id: str, ok: bool) -> None:
        job = self._in_load.pop(req_id, None)
        if job is None:
            return
        self._unpin(job)
        if not ok:
            self.stats.load_failures += 1
            for block_hash in job.hashes:  # missing or damaged somewhere: nobody should read it again
                self._drop(block_hash)
            return
        tokens = job.token_end - job.token_start
        self.stats.loads += 1
        self.stats.hit_tokens += tokens
        self.stats.loaded_blocks += len(job.hashes)
        self.stats.shared_hit_tokens += sum(self.block_size for h in job.hashes if h not in self.index)
        self.stats.remote_hit_tokens += sum(self.block_size for h in job.hashes if h in self._remote)
        for block_hash in job.hashes:
            self._emit("block_reloaded", block_hash)

    def mark_load_failed(self, request: ConnectorRequest) -> None:
        self.load_finished(request.request_id, ok=False)
        request.kv_offload_failed = True  # it recomputes; it never reads the tier again

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> bool:
        job = self._in_load.pop(request.request_id, None)  # gone before its load came back
        if job is not None:
            self._unpin(job)
        self._matched.pop(request.request_id, None)
        return False

    def add_worker_stats(self, loaded_bytes: int, seconds: float) -> None:
        self.stats.loaded_bytes += loaded_bytes
        self.stats.load_seconds += seconds

    def snapshot_stats(self) -> None:
        return None  # (no prefill/decode transfer figures)

    def accounting(self) -> dict:
        """The index (least recently used first), pinned entries, loads in flight and the capacity."""
        return {"index": list(self.index), "pins": dict(self._pins), "loads_in_flight": len(self._in_load),
                "capacity_blocks": self.capacity_blocks, "location": self.location}

    def snapshot_offload_stats(self) -> OffloadStats:
        self.stats.resident_blocks = len(self.index)
        return OffloadStats(**vars(self.stats))
