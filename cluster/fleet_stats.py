"""Figures over a fleet of engines, for /metrics and /health: which engine figures are cumulative
counters and which are gauges (one list), the speculative-decoding sums, and `FleetCounters`, the one
restart-aware accumulator that every engine client (the in-process coordinator, the Serve engine
client, the PD client) keeps its cumulative figures in.

An engine that restarts counts from zero again, and a Serve replica that goes away takes its counts
with it: `FleetCounters` keeps the figures of earlier incarnations (and of replicas that left) and adds
them, so that a counter on /metrics never goes backwards."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine.spec_decode.metrics import SpecDecodeStats


# Cumulative engine counters (summed, and kept monotonic across restarts) in an engine's stats.
COUNTER_KEYS = (
    "num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "num_prompt_tokens", "num_generation_tokens",
    "kv_offload_query_tokens", "kv_offload_hit_tokens", "kv_offload_stored_bytes", "kv_offload_loaded_bytes",
)
# Instantaneous engine gauges (summed over reachable engines).
GAUGE_KEYS = ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks")
# The SchedulerStats figures every engine reports (EngineHost.get_stats, the replica's routing stats).
ENGINE_FIGURES = (*GAUGE_KEYS, "kv_cache_usage", *COUNTER_KEYS)
# Figures of members that went away, kept for monotonic counters (bounded: the least recently seen go first).
MAX_REMEMBERED_MEMBERS = 1024


def fleet_gauges(reports: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """The gauges of the engines that reported (GAUGE_KEYS summed) and their mean KV-cache usage."""
    reports = list(reports)
    out: dict[str, float] = {key: sum(int(r.get(key, 0)) for r in reports) for key in GAUGE_KEYS}
    usages = [float(r.get("kv_cache_usage", 0.0)) for r in reports]
    out["kv_cache_usage"] = sum(usages) / len(usages) if usages else 0.0
    return out


def spec_from_dict(figures: dict[str, Any] | None) -> SpecDecodeStats | None:
    """An engine's reported counters, or None when it does not speculate (reported `{}` or nothing)."""
    if not figures:
        return None
    return SpecDecodeStats(
        num_drafts=int(figures.get("num_drafts", 0)),
        num_draft_tokens=int(figures.get("num_draft_tokens", 0)),
        num_accepted_tokens=int(figures.get("num_accepted_tokens", 0)),
        accepted_per_position=[int(n) for n in figures.get("accepted_per_position", ())],
    )


def sum_spec(parts: Iterable[SpecDecodeStats | dict[str, Any] | None]) -> dict[str, Any] | None:
    """The summed counters as `SpecDecodeStats.as_dict()` (rates recomputed from the sums), or None when
    no part speculates, so that /metrics shows spec_decode_* only for a speculating deployment."""
    total: SpecDecodeStats | None = None
    for part in parts:
        stats = spec_from_dict(part) if isinstance(part, dict) or part is None else part
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
