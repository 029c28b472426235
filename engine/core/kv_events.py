"""KV cache events: what enters and leaves an engine's prefix cache, in sequence-numbered batches.

A router that knows which block hashes each engine holds can route a request to the engine that
already has its prefix (exact routing, cluster/serve/kv_index.py). The block pool records an event
whenever a block hash enters the prefix cache (`stored`: a full block registered after a prefill
chunk, a decode or a landed KV load), leaves it (`removed`: evicted for reuse, or invalidated after a
failed load or step) or when the whole cache is dropped (`cleared`: reset_prefix_cache). The engine
seals the events of each step into one `KVEventBatch` with the next sequence number of this log
(only non-empty batches take a number), so a consumer that sees seq N after N-2 knows it missed a
batch and resyncs from a `KVSnapshot` (every cached hash by tier, as of one sequence number).

Tiers: the device cache is `DEVICE`. A second tier (host or shared memory, `OFFLOAD`; disk, `DISK`)
records its own holdings through the same log with `record()`: `offloaded` when a block lands in the
tier, `removed` when the tier drops it, `reloaded` when a block comes back to the device (the device
`stored` event follows once it is registered there) - and registers a snapshot source for its tier
(`add_snapshot_source`), so snapshots cover every tier.

Hashes are the prefix-cache chain (block_pool.hash_block_tokens, salted by the request's cache_salt in
the first block, so a salted prefix never matches an unsalted one): the same bytes a router computes
from a prompt (block_pool.prompt_block_hashes).

Cost: the device path appends one small tuple per stored or evicted block hash on the engine thread
(no lock); sealing once per step takes a lock only when there is something to seal.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass

from pagedserve.engine.core.block_pool import BlockHash

# Tiers.
DEVICE = "device"
OFFLOAD = "offload"
DISK = "disk"
TIERS = (DEVICE, OFFLOAD, DISK)

# Event kinds.
STORED = "stored"  # block hashes now held in `tier`
REMOVED = "removed"  # block hashes no longer held in `tier`
CLEARED = "cleared"  # `tier` holds nothing any more
OFFLOADED = "offloaded"  # block hashes copied into an offload tier (held there, like `stored`)
RELOADED = "reloaded"  # block hashes loaded back from `tier` to the device (still held in `tier`)
KINDS = (STORED, REMOVED, CLEARED, OFFLOADED, RELOADED)

# Sealed batches kept for consumers that drain late (a consumer further behind resyncs from a snapshot).
DEFAULT_MAX_RETAINED_EVENTS = 65536


@dataclass(frozen=True, slots=True)
class KVEvent:
    """One change to a tier's holdings. `block_hashes` of a `stored` event form a chain: the first's
    parent is `parent_hash` (None: it starts a prompt), each later one's parent the one before it."""

    kind: str
    block_hashes: tuple[BlockHash, ...] = ()
    parent_hash: BlockHash | None = None
    tier: str = DEVICE

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: must be one of {KINDS}, got {self.kind!r}")
        if self.tier not in TIERS:
            raise ValueError(f"tier: must be one of {TIERS}, got {self.tier!r}")


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """The events of one engine step, in order."""

    seq: int
    events: tuple[KVEvent, ...]


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """Every hash each tier holds, as of sequence number `seq` (all batches up to it applied)."""

    seq: int
    tiers: dict[str, frozenset[BlockHash]]


def apply_event(holdings: dict[str, set[BlockHash]], event: KVEvent) -> None:
    """Apply one event to a tier -> hashes table (the one reading of the event kinds)."""
    if event.kind == CLEARED:
        holdings.pop(event.tier, None)
        return
    if event.kind == RELOADED:
        return  # the tier still holds them; the device's own `stored` event follows
    held = holdings.setdefault(event.tier, set())
    if event.kind == REMOVED:
        held.difference_update(event.block_hashes)
    else:
        held.update(event.block_hashes)


class KVEventLog:
    """One engine's event log: the device tier's pending events, sealed batches, snapshot sources."""

    def __init__(self, max_retained_events: int = DEFAULT_MAX_RETAINED_EVENTS) -> None:
        if max_retained_events < 1:
            raise ValueError(f"max_retained_events: must be >= 1, got {max_retained_events}")
        self.max_retained_events = max_retained_events
        self.seq = 0  # the last sealed batch's number (0: none yet)
        # Engine thread only: device changes of the current step as (kind, hash, parent).
        self._device: list[tuple[str, BlockHash | None, BlockHash | None]] = []
        self._other: list[KVEvent] = []  # record(): any thread, under the lock
        self._batches: deque[tuple[KVEventBatch, int]] = deque()  # (batch, its number of hashes)
        self._retained = 0
        self._lock = threading.Lock()
        self._sources: dict[str, Callable[[], Collection[BlockHash]]] = {}
        # How many hashes each tier held when batch `seq` was sealed: a consumer that applied every batch up to
        # it must hold as many (a cheap check that its view has not drifted).
        self._sizes: tuple[int, dict[str, int]] = (0, {})

    # ---- recording (the block pool: engine thread) ---------------------------------------

    def stored(self, block_hash: BlockHash, parent: BlockHash | None) -> None:
        self._device.append((STORED, block_hash, parent))

    def removed(self, block_hash: BlockHash) -> None:
        self._device.append((REMOVED, block_hash, None))

    def cleared(self) -> None:
        self._device.append((CLEARED, None, None))

    def record(self, event: KVEvent) -> None:
        """Record an event of another tier (thread-safe); it joins the next sealed batch."""
        with self._lock:
            self._other.append(event)

    def add_snapshot_source(self, tier: str, holdings: Callable[[], Collection[BlockHash]]) -> None:
        """`holdings()` gives the tier's hashes; it is called on the engine thread, between steps (its len()
        at every sealed batch: keep it O(1))."""
        if tier not in TIERS:
            raise ValueError(f"tier: must be one of {TIERS}, got {tier!r}")
        self._sources[tier] = holdings

    # ---- sealing and reading -------------------------------------------------------------

    def seal(self) -> KVEventBatch | None:
        """Close the current step's events into the next batch (engine thread); None if there were none."""
        if not self._device and not self._other:
            return None
        device, self._device = self._device, []
        events = _group(device)
        with self._lock:
            events.extend(self._other)
            self._other = []
            self.seq += 1
            batch = KVEventBatch(self.seq, tuple(events))
            self._sizes = (self.seq, {tier: len(source()) for tier, source in self._sources.items()})
            size = sum(max(1, len(e.block_hashes)) for e in events)
            self._batches.append((batch, size))
            self._retained += size
            while self._retained > self.max_retained_events and len(self._batches) > 1:
                self._retained -= self._batches.popleft()[1]
        return batch

    def since(self, seq: int) -> list[KVEventBatch] | None:
        """Sealed batches after `seq`, in order (thread-safe); None when some of them are no longer
        retained (the caller is too far behind: resync from a snapshot)."""
        with self._lock:
            if seq >= self.seq:
                return []
            if not self._batches or self._batches[0][0].seq > seq + 1:
                return None
            return [batch for batch, _ in self._batches if batch.seq > seq]

    def sizes(self) -> tuple[int, dict[str, int]]:
        """(seq, hashes held per tier right after batch seq was sealed) (thread-safe)."""
        with self._lock:
            return self._sizes

    def snapshot(self) -> KVSnapshot:
        """Seal what is pending, then every tier's hashes as of the last batch (engine thread)."""
        self.seal()
        tiers = {tier: frozenset(source()) for tier, source in self._sources.items()}
        return KVSnapshot(self.seq, tiers)


class TierEventRecorder:
    """Hears an offload tier (kv_transfer/offload: its `listeners`) and records what it gains, drops and
    reloads in the engine's event log, under the log's tier names."""

    TIER_NAMES = {"host": OFFLOAD, "disk": DISK}

    def __init__(self, log: KVEventLog) -> None:
        self.log = log

    def _record(self, kind: str, block_hash: BlockHash, tier: str) -> None:
        self.log.record(KVEvent(kind, (block_hash,), tier=self.TIER_NAMES.get(tier, OFFLOAD)))

    def block_offloaded(self, block_hash: BlockHash, tier: str) -> None:
        self._record(OFFLOADED, block_hash, tier)

    def block_dropped(self, block_hash: BlockHash, tier: str) -> None:
        self._record(REMOVED, block_hash, tier)

    def block_reloaded(self, block_hash: BlockHash, tier: str) -> None:
        self._record(RELOADED, block_hash, tier)


def _group(device: list[tuple[str, BlockHash | None, BlockHash | None]]) -> list[KVEvent]:
    """Consecutive device changes as events: a run of stored hashes that chain (each the parent of the
    next) is one event, consecutive removals one event; order is kept."""
    events: list[KVEvent] = []
    run: list[BlockHash] = []
    run_kind: str | None = None
    run_parent: BlockHash | None = None

    def flush() -> None:
        if run_kind is not None:
            events.append(KVEvent(run_kind, tuple(run), run_parent if run_kind == STORED else None))

    for kind, block_hash, parent in device:
        if kind == CLEARED:
            flush()
            run, run_kind = [], None
            events.append(KVEvent(CLEARED))
            continue
        assert block_hash is not None
        extends = run_kind == kind and (kind == REMOVED or parent == run[-1])
        if not extends:
            flush()
            run, run_kind, run_parent = [], kind, parent
        run.append(block_hash)
    flush()
    return events
