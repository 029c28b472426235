"""Figures over a fleet of engines, for /metrics and /health: `FleetStats`, the typed snapshot every
engine client's `aggregate_stats()`/`latest_stats()` returns, and `FleetAccumulator`, the one
restart-aware accumulator every engine client (the in-process coordinator, the Serve engine client,
the PD client through its pools) builds it with. The figures themselves are named once, as the fields
of `engine_stats.EngineFigures`.

An engine that restarts counts from zero again, and a Serve replica that goes away takes its counts
with it: `FleetCounters` keeps the figures of earlier incarnations (and of replicas that left) and adds
them, so that a counter on /metrics never goes backwards."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedserve.cluster.engine_stats import (
    COUNTER_KEYS, ENGINE_FIGURES, GAUGE_KEYS, KV_TRANSFER_GAUGES, EngineFigures, EngineStats,
)
from pagedserve.engine.spec_decode.metrics import SpecDecodeStats

__all__ = ["COUNTER_KEYS", "ENGINE_FIGURES", "GAUGE_KEYS", "EngineEntry", "FleetAccumulator", "FleetCounters",
           "FleetStats", "fleet_gauges", "sum_spec"]

# Figures of members that went away, kept for monotonic counters (bounded: the least recently seen go first).
MAX_REMEMBERED_MEMBERS = 1024


def fleet_gauges(reports: Iterable[EngineFigures]) -> dict[str, float]:
    """The gauges of the engines that reported (summed) and their mean KV-cache usage (the "mean" figures)."""
    reports = list(reports)
    out: dict[str, float] = {key: sum(int(getattr(r, key)) for r in reports) for key in GAUGE_KEYS}
    for key in EngineFigures.figure_names("mean"):
        values = [float(getattr(r, key)) for r in reports]
        out[key] = sum(values) / len(values) if values else 0.0
    return out


def spec_from_dict(figures: Mapping[str, Any] | None) -> SpecDecodeStats | None:
    """An engine's reported counters, or None when it does not speculate (reported `{}` or nothing)."""
    if not figures:
        return None
    return SpecDecodeStats(
        num_drafts=int(figures.get("num_drafts", 0)),
        num_draft_tokens=int(figures.get("num_draft_tokens", 0)),
        num_accepted_tokens=int(figures.get("num_accepted_tokens", 0)),
        accepted_per_position=[int(n) for n in figures.get("accepted_per_position", ())],
    )


def sum_spec(parts: Iterable[SpecDecodeStats | Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """The summed counters as `SpecDecodeStats.as_dict()` (rates recomputed from the sums), or None when
    no part speculates, so that /metrics shows spec_decode_* only for a speculating deployment."""
    total: SpecDecodeStats | None = None
    for part in parts:
        stats = part if isinstance(part, SpecDecodeStats) else spec_from_dict(part)
        if stats is None:
            continue
        if total is None:
            total = SpecDecodeStats()
        total.merge(stats)
    return None if total is None else total.as_dict()


@dataclass
class _Member:
    """One engine (or replica) as the accumulator knows it."""

    incarnation: Any
    base: dict[str, float] = field(default_factory=dict)  # its earlier incarnations' counts
    last: dict[str, float] = field(default_factory=dict)  # its current incarnation's latest figures
    spec_base: dict[str, Any] | None = None
    spec_last: dict[str, Any] | None = None


class FleetCounters:
    """Cumulative figures summed over engines that restart, and replicas that come and go.

    `observe(member, figures, incarnation, spec)` records one engine's latest report: its cumulative
    counters (and gauges named in `gauges`, which are never carried over), its incarnation (a new one
    counts from zero, on top of what the member counted before) and its speculative-decoding counters.
    `keys` fixes the counters read (missing ones count 0); without it, whatever a report holds is summed.
    Members not seen for the longest are forgotten past `max_members`."""

    def __init__(self, keys: Iterable[str] | None = None, gauges: Iterable[str] = (),
                 max_members: int = MAX_REMEMBERED_MEMBERS) -> None:
        self.keys = tuple(keys) if keys is not None else None
        self.gauges = frozenset(gauges)
        self.max_members = max_members
        self._members: dict[Hashable, _Member] = {}

    def observe(self, member: Hashable, figures: Mapping[str, Any] | None, incarnation: Any = None,
                spec: Mapping[str, Any] | None = None) -> None:
        state = self._members.pop(member, None)
        if state is None:
            state = _Member(incarnation)
        elif state.incarnation != incarnation:  # restarted: what it counted so far becomes its base
            for key, value in state.last.items():
                if key not in self.gauges:
                    state.base[key] = state.base.get(key, 0) + value
            if state.spec_last:
                state.spec_base = sum_spec([state.spec_base, state.spec_last])
            state.incarnation, state.last, state.spec_last = incarnation, {}, None
        if figures:
            names = self.keys if self.keys is not None else tuple(figures)
            state.last = {key: figures.get(key, 0) for key in names}
        if spec:
            state.spec_last = dict(spec)
        self._members[member] = state  # newest last
        while len(self._members) > self.max_members:
            del self._members[next(iter(self._members))]

    def totals(self) -> dict[str, float]:
        """Each figure summed over every member: counters with their earlier incarnations, gauges as now."""
        out: dict[str, float] = dict.fromkeys(self.keys, 0) if self.keys is not None else {}
        for state in self._members.values():
            for key, value in state.last.items():
                out[key] = out.get(key, 0) + value
            for key, value in state.base.items():
                out[key] = out.get(key, 0) + value
        return out

    def spec(self) -> dict[str, Any] | None:
        """The speculative-decoding counters summed over every member and incarnation (None: none speculates)."""
        return sum_spec(part for state in self._members.values() for part in (state.spec_base, state.spec_last))


@dataclass
class EngineEntry:
    """One engine as a fleet snapshot lists it: its latest stats (None before it reported) and what the
    routing side knows of it."""

    label: str  # its /metrics `engine_index` label: position (in-process), Serve replica id, "<pool>-..." (PD)
    stats: EngineStats | None = None
    available: bool = True  # reachable (in-process: False after the actor died, until it answers again)
    in_flight: int = 0  # requests this process routed there and not finished
    num_routed: int = 0  # requests this process routed there
    pool: str | None = None  # PD: "prefill" or "decode"
    circuit_open: bool = False  # Serve: out of routing until its health recovers
    num_prefixes: int | None = None  # Serve: prompt-prefix hashes the replica reports holding
    kv_view: dict[str, Any] | None = None  # Serve, exact routing: the router's KV view of it (kv_index)

    @property
    def healthy(self) -> bool:
        """Routable: reachable and not reporting a stall."""
        return self.available and (self.stats is None or self.stats.healthy)


@dataclass
class FleetStats(EngineFigures):
    """The engines behind one client: counters summed over every engine and incarnation ever seen
    (monotonic), gauges summed over the engines that report, KV usage their mean, one entry per engine,
    and what the shape adds (None where it does not)."""

    num_engines: int = 0
    num_healthy_engines: int = 0
    num_in_flight: int = 0
    engines: list[EngineEntry] = field(default_factory=list)
    spec_decoding: dict[str, Any] | None = None  # SpecDecodeStats.as_dict() of the sums; None: nobody speculates
    routing_decisions: dict[str, int] | None = None  # Serve: this process's routers' decisions by kind
    kv_routing: dict[str, Any] | None = None  # Serve: the KV index's health, predicted vs actual cached tokens
    fault_tolerance: dict[str, Any] | None = None  # circuit breaker, migrations, overload retries
    pools: dict[str, FleetStats] | None = None  # PD: each pool's own snapshot
    kv_transfer: dict[str, float] | None = None  # the engines' KV-transfer figures summed; None: no KV connector
    # The engines' failed fetches from other nodes' offload tiers by reason, summed; None: no offload tier
    kv_tier_fetch_failures: dict[str, float] | None = None
    pd: dict[str, int] | None = None  # PD: how the client served requests (pd_client.PDCounters)
    stats_age_s: float | None = None  # in-process, latest_stats(): seconds since the last completed poll

    @property
    def num_requests_routed(self) -> list[int]:
        """Requests this process routed to each engine, in `engines` order."""
        return [e.num_routed for e in self.engines]

    def replace(self, **changes: Any) -> FleetStats:
        """A copy with `changes` (e.g. what a wrapping client adds: fault_tolerance)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def over_pools(cls, pools: dict[str, FleetStats], **extras: Any) -> FleetStats:
        """Several pools as one fleet (PD): each pool's counters (already monotonic) and gauges summed, KV
        usage the mean over every reporting engine, engines labelled `<pool>-<label>`, `pools` each pool's."""
        engines = [dataclasses.replace(e, label=f"{name}-{e.label}", pool=name)
                   for name, pool in pools.items() for e in pool.engines]
        summed = {key: sum(int(getattr(p, key)) for p in pools.values())
                  for key in (*COUNTER_KEYS, *GAUGE_KEYS, "num_engines", "num_healthy_engines", "num_in_flight")}
        reporting = [e.stats for e in engines if e.available and e.stats is not None]
        means = {key: value for key, value in fleet_gauges(reporting).items() if key not in GAUGE_KEYS}
        kv_transfer: dict[str, float] = {}  # (always a dict: a PD fleet exports its KV figures, zeros included)
        for pool in pools.values():
            for key, value in (pool.kv_transfer or {}).items():
                kv_transfer[key] = kv_transfer.get(key, 0) + value
        tier_fetch: dict[str, float] = {}
        for pool in pools.values():
            for reason, count in (pool.kv_tier_fetch_failures or {}).items():
                tier_fetch[reason] = tier_fetch.get(reason, 0) + count
        return cls(**summed, **means, engines=engines, pools=dict(pools), kv_transfer=kv_transfer,
                   spec_decoding=sum_spec(p.spec_decoding for p in pools.values()),
                   kv_tier_fetch_failures=tier_fetch or None, **extras)


class FleetAccumulator:
    """Builds a client's `FleetStats`: `observe` each engine report as it arrives (counters - the engine
    figures, speculative decoding's and KV transfer's - kept across restarts and departures,
    `FleetCounters`), then `snapshot` the engines as they stand now."""

    def __init__(self, max_members: int = MAX_REMEMBERED_MEMBERS) -> None:
        self.counters = FleetCounters(COUNTER_KEYS, max_members=max_members)
        self.kv_transfer = FleetCounters(gauges=KV_TRANSFER_GAUGES, max_members=max_members)
        self.tier_fetch_failures = FleetCounters(max_members=max_members)

    def observe(self, member: Hashable, stats: EngineStats) -> None:
        """One engine's latest report (its incarnation tells a restart)."""
        self.counters.observe(member, stats.figures("counter"), stats.incarnation, stats.spec_decoding)
        self.kv_transfer.observe(member, stats.kv_transfer, stats.incarnation)
        self.tier_fetch_failures.observe(member, stats.kv_tier_fetch_failures, stats.incarnation)

    def snapshot(self, engines: list[EngineEntry], **extras: Any) -> FleetStats:
        """Counters over every member and incarnation seen, gauges over the reachable engines that reported,
        and `extras` (the shape's FleetStats fields)."""
        reporting = [e.stats for e in engines if e.available and e.stats is not None]
        return FleetStats(**self.counters.totals(), **fleet_gauges(reporting), num_engines=len(engines),
                          num_healthy_engines=sum(e.healthy for e in engines),
                          num_in_flight=sum(e.in_flight for e in engines), engines=engines,
                          spec_decoding=self.counters.spec(), kv_transfer=self.kv_transfer.totals() or None,
                          kv_tier_fetch_failures=self.tier_fetch_failures.totals() or None, **extras)
