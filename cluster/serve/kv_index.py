"""The cluster-wide KV index a request router keeps: replica -> tier -> the block hashes it holds.

Every router builds its own copy from the events its engine replicas publish with their routing stats
(kv_feed.py), so no router depends on another and a lost index rebuilds itself from the next reports.
A replica's view is fresh while its reports arrive in sequence; it goes stale on a gap in the sequence
numbers (a missed report the window does not cover), a new incarnation (the engine restarted: its
cache is empty, its numbering starts again) with no history to start from, a replica that stops
reporting events, or one that goes silent (no new report for `silent_after_s`). A snapshot in a later
report makes it fresh again. While a view is stale the router scores that replica approximately
(router.py), counts it, and logs once per stale spell.

Keys are kv_feed.key_of(block hash): the first bytes of the prefix-cache chain hash (salted, so a
tenant's prefix is never another tenant's hit).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedserve.cluster.serve.kv_feed import split_keys
from pagedserve.engine.core.kv_events import DEVICE, KVEvent, apply_event

logger = logging.getLogger(__name__)

# Why a view is stale.
NEVER_SYNCED = "never_synced"
GAP = "gap"
RESTARTED = "restarted"
DIVERGED = "diverged"  # its hash counts differ from the replica's own (a lost or misread event)
SILENT = "silent"
NO_EVENTS = "no_events"


@dataclass
class ReplicaView:
    """What one router knows of one replica's KV tiers."""

    incarnation: str | None = None
    seq: int = 0
    report: int = -1  # the last report applied (one report is seen many times)
    last_report_time: float = 0.0
    tiers: dict[str, set[bytes]] = field(default_factory=dict)
    engine_sizes: dict[str, int] = field(default_factory=dict)  # what the replica last said it holds
    synced: bool = False  # `tiers` is the replica's state as of `seq` (every batch up to it applied)
    stale: str | None = NEVER_SYNCED  # None: fresh

    @property
    def fresh(self) -> bool:
        return self.stale is None


@dataclass
class IndexCounters:
    gaps: int = 0
    restarts: int = 0
    resyncs: int = 0  # views rebuilt from a snapshot
    divergences: int = 0  # views found to hold other counts than their replica
    stale_spells: int = 0  # a view went from fresh to stale


@dataclass
class PredictionCounters:
    """A router's predicted cached tokens checked against what the engines found."""

    checked: int = 0  # requests whose engine answer came back
    matched: int = 0  # ... where the prediction was exact
    predicted_tokens: int = 0
    actual_tokens: int = 0

    def observe(self, predicted: int, actual: int) -> None:
        self.checked += 1
        self.matched += predicted == actual
        self.predicted_tokens += predicted
        self.actual_tokens += actual


class ClusterKVIndex:
    """Views of many replicas, updated from their reports; longest held prefix per replica and tier."""

    def __init__(self, silent_after_s: float = 10.0) -> None:
        if silent_after_s <= 0:
            raise ValueError(f"silent_after_s: must be > 0, got {silent_after_s}")
        self.silent_after_s = silent_after_s
        self.views: dict[Hashable, ReplicaView] = {}
        self.counters = IndexCounters()

    def view(self, replica: Hashable) -> ReplicaView:
        view = self.views.get(replica)
        if view is None:
            view = self.views[replica] = ReplicaView()
        return view

    def update(self, replica: Hashable, report: Mapping[str, Any] | None, now: float) -> ReplicaView:
        """Apply a replica's latest report (the same report seen again changes nothing but silence)."""
        view = self.view(replica)
        if report is None:
            self._stale(replica, view, NO_EVENTS)
            return view
        restarted = False
        if report.get("incarnation") != view.incarnation:
            restarted = view.incarnation is not None
            self.counters.restarts += restarted
            view.incarnation, view.seq, view.report, view.tiers, view.synced = report.get("incarnation"), 0, -1, {}, False
        if report.get("report") == view.report:
            self.check_silence(replica, now)
            return view
        view.report = report.get("report", -1)
        view.last_report_time = now
        sizes = report.get("sizes") or {}
        view.engine_sizes = dict(sizes.get("tiers") or {})
        from_seq = int(report.get("from_seq", 0))
        batches = report.get("batches") or ()
        if not view.synced and from_seq == 0:
            view.tiers, view.seq = {}, 0  # rebuilt from the whole history below
        if view.seq >= from_seq and (view.synced or from_seq == 0):
            # In sequence (or the incarnation's whole history is in the report).
            self._apply(view, batches)
            self._fresh(replica, view, sizes)
            return view
        snapshot = report.get("snapshot")
        if snapshot is not None:
            view.tiers = {tier: set(split_keys(keys)) for tier, keys in snapshot["tiers"].items()}
            view.seq = int(snapshot["seq"])
            self._apply(view, batches)
            self.counters.resyncs += 1
            self._fresh(replica, view, sizes)
            return view
        if view.synced:
            self.counters.gaps += 1
        view.synced = False
        self._stale(replica, view, RESTARTED if restarted else GAP)
        return view

    def check_silence(self, replica: Hashable, now: float) -> None:
        view = self.views.get(replica)
        if view is not None and view.fresh and now - view.last_report_time > self.silent_after_s:
            self._stale(replica, view, SILENT)

    def forget(self, replica: Hashable) -> None:
        self.views.pop(replica, None)

    def held_blocks(self, replica: Hashable, keys: Sequence[bytes]) -> tuple[int, int]:
        """(blocks of the prompt's chain held on the device, blocks held on the device or another tier):
        both longest prefixes, the second extending the first (device first, then offload)."""
        view = self.views.get(replica)
        if view is None:
            return 0, 0
        device = view.tiers.get(DEVICE, ())
        others = [held for tier, held in view.tiers.items() if tier != DEVICE]
        n_device = 0
        while n_device < len(keys) and keys[n_device] in device:
            n_device += 1
        n_any = n_device
        while n_any < len(keys) and any(keys[n_any] in held for held in others):
            n_any += 1
        return n_device, n_any

    def num_stale(self) -> int:
        return sum(1 for v in self.views.values() if not v.fresh)

    def num_keys(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for view in self.views.values():
            for tier, held in view.tiers.items():
                out[tier] = out.get(tier, 0) + len(held)
        return out

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _apply(view: ReplicaView, batches: Sequence) -> None:
        for seq, events in batches:
            if seq <= view.seq:
                continue
            for kind, tier, keys in events:
                apply_event(view.tiers, KVEvent(kind, tuple(split_keys(keys)), None, tier))
            view.seq = seq

    def _fresh(self, replica: Hashable, view: ReplicaView, sizes: Mapping | None = None) -> None:
        if sizes and sizes.get("seq") == view.seq:
            held = {tier: len(h) for tier, h in view.tiers.items() if h}
            if held != {tier: n for tier, n in (sizes.get("tiers") or {}).items() if n}:
                self.counters.divergences += 1
                view.synced = False
                self._stale(replica, view, DIVERGED)
                return
        view.synced = True
        if view.stale is not None and view.stale != NEVER_SYNCED:
            logger.info("KV index: replica %s is in sync again (seq %d); exact routing resumes for it",
                        replica, view.seq)
        view.stale = None

    def _stale(self, replica: Hashable, view: ReplicaView, reason: str) -> None:
        if view.stale == reason:
            return
        if view.fresh:
            self.counters.stale_spells += 1
            logger.warning("KV index: replica %s went stale (%s); routing it approximately until it resyncs",
                           replica, reason)
        view.stale = reason


class RecentRoutes:
    """Where this router just sent each prefix key (bounded, with times): the index learns of the blocks
    a request stores only with the replica's next report, up to one stats period later; until then the
    route stands in for them."""

    def __init__(self, ttl_s: float, max_entries: int = 65536) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._routes: OrderedDict[bytes, tuple[Hashable, float]] = OrderedDict()

    def remember(self, keys: Sequence[bytes], replica: Hashable, now: float) -> None:
        for key in keys:
            self._routes[key] = (replica, now)
            self._routes.move_to_end(key)
        while len(self._routes) > self.max_entries:
            self._routes.popitem(last=False)

    def held_blocks(self, replica: Hashable, keys: Sequence[bytes], now: float, since: float) -> int:
        """Leading keys sent to `replica` after `since` (the replica's latest report: from then on its
        report, which knows of evictions too, is the better word) and within the TTL."""
        n = 0
        while n < len(keys):
            route = self._routes.get(keys[n])
            if route is None or route[0] != replica or route[1] <= since or now - route[1] > self.ttl_s:
                break
            n += 1
        return n

    def forget(self, replica: Hashable) -> None:
        for key in [k for k, (r, _) in self._routes.items() if r == replica]:
            del self._routes[key]
