"""`EngineStats`: one engine's figures as every engine shape reports them, built from the engine's
`SchedulerStats` in one place (`EngineStats.from_scheduler`).

The figures a fleet sums are named once, as the fields of `EngineFigures` (each field says whether it is
a gauge, a mean or a cumulative counter, and the /metrics family it becomes); `EngineStats` adds who
reported them (engine index, Serve replica, incarnation: new on every (re)start) and the engine's own
extras (health, KV transfer, speculative decoding, LoRA). The record pickles as it is across Ray (an
engine actor's `get_stats`); Serve's routing stats must be a dict, so there, and only there, it goes
as `to_dict()` and comes back with `from_dict()`.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from pagedserve.engine.outputs import SchedulerStats

FigureKind = Literal["gauge", "mean", "counter"]


def _figure(kind: FigureKind, metric: str, help_text: str, default: float = 0) -> Any:
    """A fleet figure: how it combines over engines (gauge: summed as now; mean: averaged over the engines
    that report; counter: summed and monotonic across restarts) and its /metrics family (name, help)."""
    return field(default=default, metadata={"kind": kind, "metric": metric, "help": help_text})


@dataclass
class EngineFigures:
    """The engine figures a fleet combines (per engine in `EngineStats`, over the fleet in `FleetStats`)."""

    num_running: int = _figure("gauge", "num_requests_running", "Requests in model execution batches.")
    num_waiting: int = _figure("gauge", "num_requests_waiting", "Requests waiting to be scheduled.")
    kv_cache_usage: float = _figure("mean", "kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = 100%).",
                                    0.0)
    num_free_blocks: int = _figure("gauge", "kv_cache_free_blocks", "KV cache blocks in the free pool.")
    num_total_blocks: int = _figure("gauge", "kv_cache_total_blocks", "KV cache blocks in total.")
    prefix_cache_queries: int = _figure("counter", "prefix_cache_queries",
                                        "Prompt tokens looked up in the prefix cache.")
    prefix_cache_hits: int = _figure("counter", "prefix_cache_hits", "Prompt tokens found in the prefix cache.")
    num_preemptions: int = _figure("counter", "num_preemptions", "Cumulative preemptions.")
    num_prompt_tokens: int = _figure("counter", "prompt_tokens", "Prefill tokens processed.")
    num_generation_tokens: int = _figure("counter", "generation_tokens", "Generation tokens processed.")
    # The KV offload tier (0 without one): its hit rate is hits / queries, the device cache's prefix_cache_*.
    kv_offload_query_tokens: int = _figure("counter", "kv_offload_queries", "Prompt tokens the device prefix cache "
                                                                            "lacked, looked up in the KV offload tier.")
    kv_offload_hit_tokens: int = _figure("counter", "kv_offload_hits", "Prompt tokens reloaded from the KV offload tier.")
    kv_offload_remote_hit_tokens: int = _figure("counter", "kv_offload_remote_hits",
                                                "Of the KV offload hits, prompt tokens fetched from another node's tier.")
    kv_offload_stored_bytes: int = _figure("counter", "kv_offload_stored_bytes", "KV bytes spilled from the device "
                                                                                 "cache to the offload tier.")
    kv_offload_loaded_bytes: int = _figure("counter", "kv_offload_loaded_bytes",
                                           "KV bytes loaded back from the offload tier.")

    @classmethod
    def figure_fields(cls, *kinds: FigureKind) -> tuple:
        """The figure fields (all, or those of the given kinds), in declaration order."""
        return tuple(f for f in fields(EngineFigures) if not kinds or f.metadata["kind"] in kinds)

    @classmethod
    def figure_names(cls, *kinds: FigureKind) -> tuple[str, ...]:
        return tuple(f.name for f in cls.figure_fields(*kinds))

    def figures(self, *kinds: FigureKind) -> dict[str, float]:
        """This record's figures (all, or those of the given kinds) by name."""
        return {name: getattr(self, name) for name in self.figure_names(*kinds)}


# Cumulative counters (summed, monotonic across restarts), summed gauges, and every figure.
COUNTER_KEYS = EngineFigures.figure_names("counter")
GAUGE_KEYS = EngineFigures.figure_names("gauge")
ENGINE_FIGURES = EngineFigures.figure_names()
# The KV-transfer figures (EngineStats.kv_transfer) that are gauges; the rest are cumulative counters.
KV_TRANSFER_GAUGES = frozenset({"held_requests", "held_blocks"})


@dataclass
class EngineStats(EngineFigures):
    """One engine's latest figures, who reported them, and its extras."""

    engine_index: int = 0  # position in its pool (in-process engine actors); 0 in a Serve replica
    replica: str = "local"  # the Serve replica id ("local" outside Serve)
    incarnation: str | None = None  # new on every (re)start: a new one counts from zero
    stats_time: float = 0.0  # the engine's time.monotonic(): orders the answers of one incarnation
    healthy: bool = True  # False: the engine loop died or stalls with work waiting
    num_unfinished: int = 0
    last_step_age_s: float = 0.0
    num_stream_outputs: int = 0  # outputs the host has streamed (counted before each yield)
    # Cumulative KV connector counters and gauges (kv_transfer.scheduler_connector.KVTransferStats); {} without one.
    kv_transfer: dict[str, Any] = field(default_factory=dict)
    # engine.spec_decode.metrics.SpecDecodeStats as a dict; {} when the engine does not speculate.
    spec_decoding: dict[str, Any] = field(default_factory=dict)
    # Multi-LoRA: adapter loads, evictions, disk reads, requests per name, "resident" adapters; {} without LoRA.
    lora: dict[str, Any] = field(default_factory=dict)
    # The offload tier across nodes: this engine's failed fetches from peers' tiers by reason
    # (cluster/serve/tier_peer.FETCH_FAILURE_REASONS, cumulative); {} without an offload tier.
    kv_tier_fetch_failures: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_scheduler(cls, scheduler: SchedulerStats, **identity: Any) -> EngineStats:
        """The record of an engine whose scheduler reported `scheduler`; `identity`: the other fields
        (engine_index, replica, incarnation, stats_time, healthy, ...). The extras are copies: the engine
        goes on updating its own (an in-process reader gets the record unpickled)."""
        return cls(**{name: getattr(scheduler, name) for name in ENGINE_FIGURES},
                   kv_transfer=copy.deepcopy(scheduler.kv_transfer or {}),
                   spec_decoding=copy.deepcopy(scheduler.spec_decoding or {}), lora=copy.deepcopy(scheduler.lora or {}),
                   **identity)

    def to_dict(self) -> dict[str, Any]:
        """As a plain dict: for Serve's routing stats (which must be one), nowhere else."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EngineStats:
        """The record back from `to_dict()` (or a routing-stats dict holding more): keys it does not know are
        left out, missing ones take their defaults."""
        return cls(**{key: value for key, value in values.items() if key in _ENGINE_STATS_FIELDS})


_ENGINE_STATS_FIELDS = frozenset(f.name for f in fields(EngineStats))
