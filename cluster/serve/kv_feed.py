"""An engine replica's KV events as they ride on its routing stats (the wire format; read by kv_index).

Why the routing stats: Serve already calls `record_routing_stats` on every engine replica each
`request_routing_stats_period_s` and broadcasts the answer to every request router (each ingress
replica's router, the prefill and decode pools' routers alike). Events riding on it reach every router
with no extra RPC, no extra actor and no single point of failure; the price is latency (one stats
period), which the router covers by remembering where it just sent each prefix (kv_index.RecentRoutes).

A router may miss a broadcast (the long poll hands over only the newest stats), so a report does not
carry only what is new since the previous report: it carries the sealed batches of the last
`window_reports` reports (bounded by `max_window_hashes`); a router whose last applied sequence
number is in the window catches up from it, one further behind has a gap. For those, a report carries
a snapshot (every hash by tier) every `snapshot_every` reports and whenever the window had to drop
batches that the previous report's readers had not all seen.

A report (`report()`, under "kv_events" in the routing stats):
    {"incarnation": str, "report": n, "seq": last batch number, "from_seq": s,
     "batches": [(seq, [(kind, tier, keys), ...]), ...],   # every batch after s up to seq, in order
     "snapshot": None | {"seq": s2, "tiers": {tier: keys}},
     "sizes": {"seq": s3, "tiers": {tier: number of hashes held right after batch s3}}}
`keys` are the block hashes' first KEY_BYTES bytes, concatenated (a prefix hash collision could only
mispredict a hit; the engine itself matches full hashes).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.core.block_pool import BlockHash
from pagedserve.engine.core.kv_events import KVEventBatch

logger = logging.getLogger(__name__)

KEY_BYTES = 8
WINDOW_REPORTS = 8
SNAPSHOT_EVERY = 10
MAX_WINDOW_HASHES = 50_000  # x KEY_BYTES: a report stays well under a megabyte


def key_of(block_hash: BlockHash) -> bytes:
    return block_hash[:KEY_BYTES]


def join_keys(hashes: Any) -> bytes:
    return b"".join(h[:KEY_BYTES] for h in hashes)


def split_keys(keys: bytes) -> list[bytes]:
    return [keys[i:i + KEY_BYTES] for i in range(0, len(keys), KEY_BYTES)]


def encode_batch(batch: KVEventBatch) -> tuple[int, list[tuple[str, str, bytes]]]:
    return batch.seq, [(e.kind, e.tier, join_keys(e.block_hashes)) for e in batch.events]


class KVEventFeed:
    """Builds each routing-stats report of one engine replica from its engine's event log."""

    def __init__(self, engine: AsyncLLM, incarnation: str, window_reports: int = WINDOW_REPORTS,
                 snapshot_every: int = SNAPSHOT_EVERY, max_window_hashes: int = MAX_WINDOW_HASHES) -> None:
        if window_reports < 1 or snapshot_every < 1 or max_window_hashes < 1:
            raise ValueError("window_reports, snapshot_every, max_window_hashes: must be >= 1")
        self.engine = engine
        self.incarnation = incarnation
        self.snapshot_every = snapshot_every
        self.max_window_hashes = max_window_hashes
        self.num_reports = 0
        self.num_snapshots = 0
        self._report_seqs: deque[int] = deque([0], maxlen=window_reports)  # last seq of recent reports

    async def report(self) -> dict[str, Any] | None:
        """The next report; None when the engine cannot give a snapshot it needs (its loop died): the
        routers then route this replica approximately."""
        self.num_reports += 1
        from_seq = self._report_seqs[0]
        batches = self.engine.kv_events_since(from_seq)
        snapshot = None
        if batches is not None:
            batches, from_seq = self._bounded(batches, from_seq)
        if batches is None or from_seq > self._report_seqs[-1] or self.num_reports % self.snapshot_every == 0:
            # Readers of the previous report would have a gap (or it is the periodic one): a snapshot.
            try:
                taken = await self.engine.kv_snapshot()
            except Exception as exc:  # noqa: BLE001 - the stats (health included) must still go out
                logger.warning("no KV snapshot from the engine (%s); this report carries no KV events", exc)
                return None
            snapshot = {"seq": taken.seq, "tiers": {tier: join_keys(keys) for tier, keys in taken.tiers.items()}}
            self.num_snapshots += 1
            if batches is None:
                from_seq = taken.seq
                batches = self.engine.kv_events_since(from_seq) or []
        seq = batches[-1].seq if batches else max(from_seq, snapshot["seq"] if snapshot else 0)
        self._report_seqs.append(seq)
        sizes_seq, sizes = self.engine.kv_sizes()
        return {"incarnation": self.incarnation, "report": self.num_reports, "seq": seq, "from_seq": from_seq,
                "batches": [encode_batch(b) for b in batches], "snapshot": snapshot,
                "sizes": {"seq": sizes_seq, "tiers": sizes}}

    def _bounded(self, batches: list[KVEventBatch], from_seq: int) -> tuple[list[KVEventBatch], int]:
        """The newest batches within max_window_hashes (from_seq moves up past the ones left out)."""
        total = 0
        keep = len(batches)
        for i in range(len(batches) - 1, -1, -1):
            total += sum(max(1, len(e.block_hashes)) for e in batches[i].events)
            if total > self.max_window_hashes:
                break
            keep = i
        if keep == 0:
            return batches, from_seq
        return batches[keep:], batches[keep - 1].seq
