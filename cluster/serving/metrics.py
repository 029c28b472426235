"""Prometheus metrics of one serving app, with vLLM-style names prefixed `pagedserve:`.

Latency and size histograms are observed by the HTTP layer per request. Gauges and
cumulative counters come from the engines' own stats (the engine client's
`aggregate_stats()`, a `fleet_stats.FleetStats`, cluster/engine_client.py), read by attribute by a custom
collector at scrape time, so they are exact and never drift. Every app gets its own `CollectorRegistry`: two apps in one process
must not clash in the global one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from pagedserve.cluster.engine_stats import EngineFigures
from pagedserve.cluster.fleet_stats import EngineEntry, FleetStats

logger = logging.getLogger(__name__)

PREFIX = "pagedserve:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (as vLLM's request size histograms)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(float(value))
        exponent += 1


# The fleet's figures (FleetStats attributes), named with their /metrics family once: engine_stats.EngineFigures.
# (metric name without prefix, FleetStats attribute, help)
_GAUGES = tuple((f.metadata["metric"], f.name, f.metadata["help"]) for f in EngineFigures.figure_fields("gauge", "mean"))
_COUNTERS = tuple((f.metadata["metric"], f.name, f.metadata["help"]) for f in EngineFigures.figure_fields("counter"))

# KV transfer (prefill/decode), from the engines' SchedulerStats.kv_transfer summed over engines:
# (metric name, kv_transfer key, help)
_KV_COUNTERS = (
    ("kv_transfer_bytes", "loaded_bytes", "KV bytes decode engines pulled from prefill engines."),
    ("kv_transfer_blocks_pulled", "loaded_blocks", "KV blocks decode engines filled from prefill engines."),
    ("kv_transfer_tokens_pulled", "loaded_tokens", "Prompt tokens whose KV decode engines pulled."),
    ("kv_transfer_failures", "load_failures", "KV pulls that failed (the request recomputed its prompt)."),
    ("kv_transfer_fallbacks", "fallbacks", "Requests a decode engine computed itself instead of pulling KV "
                                           "(a failed pull, an expired hold or unusable params)."),
    ("kv_transfer_expired_holds", "expired_holds", "Prefill KV holds freed by hold_timeout_s, not a release."),
)
_KV_GAUGES = (
    ("kv_transfer_held_requests", "held_requests", "Finished prefills whose KV waits for a reader."),
    ("kv_transfer_held_blocks", "held_blocks", "KV blocks prefill engines hold for readers."),
)
# Speculative decoding, from the engines' SchedulerStats.spec_decoding summed over engines (vLLM's
# spec_decode_* counters): (metric name, spec_decoding key, help)
_SPEC_COUNTERS = (
    ("spec_decode_num_drafts", "num_drafts", "Speculative proposals verified (one per request and step that "
                                             "proposed at least one token)."),
    ("spec_decode_num_draft_tokens", "num_draft_tokens", "Draft tokens proposed."),
    ("spec_decode_num_accepted_tokens", "num_accepted_tokens", "Draft tokens the target accepted."),
)
# Fault tolerance, from the engine client's "fault_tolerance" stats (cluster/serve/migration.py, the
# request router's circuit breaker): (metric name, key, help)
_FAULT_COUNTERS = (
    ("request_migrations", "migrations", "Requests moved to another engine after the one serving them failed "
                                         "(each move counts)."),
    ("request_migration_failures", "migration_failures", "Requests that failed with every migration used up."),
    ("overload_retries", "overload_retries", "Requests an overloaded engine refused that were retried on "
                                             "another engine."),
    ("circuit_breaker_opens", "circuit_opens", "Times an engine was taken out of routing after failing "
                                               "requests in a row."),
)
_FAULT_GAUGES = (
    ("engines_circuit_open", "circuit_open_engines", "Engines out of routing until their health recovers."),
)
# Per-pool gauges (PD): (metric name after "pool_", the pool's FleetStats attribute, help)
_PER_POOL = (
    ("num_requests_running", "num_running", "Requests in model execution batches, per pool"),
    ("num_requests_waiting", "num_waiting", "Requests waiting to be scheduled, per pool"),
    ("num_engines", "num_engines", "Engines in the pool"),
)


def _reported(name: str) -> Callable[[EngineEntry], float | None]:
    """An engine's own figure, None (not exported) before it first reported."""
    return lambda engine: None if engine.stats is None else getattr(engine.stats, name)


# Per-engine gauges: (metric name after "engine_", the value of an engine entry or None when it has none, help)
_PER_ENGINE: tuple[tuple[str, Callable[[EngineEntry], float | None], str], ...] = (
    ("num_requests_running", _reported("num_running"), "Requests in model execution batches"),
    ("num_requests_waiting", _reported("num_waiting"), "Requests waiting to be scheduled"),
    ("kv_cache_usage_perc", _reported("kv_cache_usage"), "Fraction of KV cache blocks in use"),
    ("kv_cache_free_blocks", _reported("num_free_blocks"), "KV cache blocks in the free pool"),
    ("kv_cache_total_blocks", _reported("num_total_blocks"), "KV cache blocks in total"),
    ("prefix_cache_hits", _reported("prefix_cache_hits"), "Prompt tokens found in the prefix cache"),
    ("num_requests_routed", lambda engine: engine.num_routed, "Requests this process routed to the engine"),
    ("prefixes_reported", lambda engine: engine.num_prefixes, "Prompt-prefix hashes the engine reports holding "
                                                              "(routing stats)"),
)


class EngineStatsCollector(Collector):
    """Reads the engines' fleet snapshot (`FleetStats`) at scrape time."""

    def __init__(self, model_name: str, stats_fn: Callable[[], FleetStats | None]) -> None:
        self.model_name = model_name
        self.stats_fn = stats_fn

    def collect(self):
        try:
            stats = self.stats_fn() or FleetStats()
        except Exception:  # a scrape must not fail because one engine is unreachable
            logger.exception("reading engine stats for /metrics failed")
            stats = FleetStats()
        for name, key, help_text in _GAUGES:
            family = GaugeMetricFamily(PREFIX + name, help_text, labels=["model_name"])
            family.add_metric([self.model_name], float(getattr(stats, key)))
            yield family
        for name, key, help_text in _COUNTERS:
            family = CounterMetricFamily(PREFIX + name, help_text, labels=["model_name"])
            family.add_metric([self.model_name], float(getattr(stats, key)))
            yield family
        healthy = GaugeMetricFamily(PREFIX + "engine_healthy", "1 when an engine is healthy.",
                                    labels=["model_name", "engine_index"])
        for engine in stats.engines:
            healthy.add_metric([self.model_name, engine.label], 1.0 if engine.healthy else 0.0)
        yield healthy
        yield from self._per_engine(stats.engines)
        yield from self._kv_views(stats.engines)
        yield from self._routing(stats)
        yield from self._disaggregated(stats)
        yield from self._tier_fetch(stats)
        yield from self._spec_decode(stats)
        yield from self._fault_tolerance(stats)
        yield from self._lora(stats.engines)

    def _fault_tolerance(self, stats: FleetStats):
        """Migrations, overload retries and the circuit breaker (when the client reports them)."""
        fault = stats.fault_tolerance
        if fault is None:
            return
        for families, family_type in ((_FAULT_COUNTERS, CounterMetricFamily), (_FAULT_GAUGES, GaugeMetricFamily)):
            for name, key, help_text in families:
                family = family_type(PREFIX + name, help_text, labels=["model_name"])
                family.add_metric([self.model_name], float(fault.get(key, 0) or 0))
                yield family

    def _lora(self, engines: list[EngineEntry]):
        """Adapter loads into resident slots and evictions from them, summed over the engines (with LoRA)."""
        figures = [e.stats.lora for e in engines if e.stats is not None and e.stats.lora]
        if not figures:
            return
        for name, key, help_text in (("lora_adapter_loads", "loads", "LoRA adapters loaded into resident slots."),
                                     ("lora_adapter_evictions", "evictions", "LoRA adapters evicted from resident "
                                                                            "slots (least recently used)."),
                                     ("lora_adapter_disk_loads", "disk_loads", "LoRA adapters read from disk.")):
            family = CounterMetricFamily(PREFIX + name, help_text, labels=["model_name"])
            family.add_metric([self.model_name], float(sum(f.get(key, 0) for f in figures)))
            yield family

    def _spec_decode(self, stats: FleetStats):
        """Speculative decoding counters (only when the engines speculate)."""
        spec = stats.spec_decoding
        if spec is None:
            return
        for name, key, help_text in _SPEC_COUNTERS:
            family = CounterMetricFamily(PREFIX + name, help_text, labels=["model_name"])
            family.add_metric([self.model_name], float(spec.get(key, 0) or 0))
            yield family
        family = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Drafts whose token at "
                                     "this position (0 = first) the target accepted.",
                                     labels=["model_name", "position"])
        for position, count in enumerate(spec.get("accepted_per_position") or ()):
            family.add_metric([self.model_name, str(position)], float(count))
        yield family

    def _tier_fetch(self, stats: FleetStats):
        """The offload tier across nodes: fetches from another node's tier that failed, by reason."""
        failures = stats.kv_tier_fetch_failures
        if failures is None:
            return
        family = CounterMetricFamily(PREFIX + "kv_offload_remote_fetch_failures", "Fetches of a prompt's KV blocks "
                                     "from another node's offload tier that failed (the engine recomputed them), "
                                     "by reason: timeout, refused (KV secret, signature), peer_gone, error.",
                                     labels=["model_name", "reason"])
        for reason, count in sorted(failures.items()):
            family.add_metric([self.model_name, reason], float(count))
        yield family

    def _disaggregated(self, stats: FleetStats):
        """Prefill/decode: KV transfer figures and per-pool load (only in the PD shape)."""
        kv = stats.kv_transfer
        if kv is not None:
            for name, key, help_text in _KV_COUNTERS:
                family = CounterMetricFamily(PREFIX + name, help_text, labels=["model_name"])
                family.add_metric([self.model_name], float(kv.get(key, 0) or 0))
                yield family
            for name, key, help_text in _KV_GAUGES:
                family = GaugeMetricFamily(PREFIX + name, help_text, labels=["model_name"])
                family.add_metric([self.model_name], float(kv.get(key, 0) or 0))
                yield family
            # Engines report the pulls' count and summed time, not each pull: a summary (mean), no quantiles.
            timing = SummaryMetricFamily(PREFIX + "kv_transfer_time_seconds", "Time decode engines spent "
                                         "pulling KV (per pull: count and sum).", labels=["model_name"])
            timing.add_metric([self.model_name], count_value=float(kv.get("loads", 0) or 0),
                              sum_value=float(kv.get("load_seconds", 0.0) or 0.0))
            yield timing
        pools = stats.pools
        if pools:
            for name, key, help_text in _PER_POOL:
                family = GaugeMetricFamily(PREFIX + "pool_" + name, help_text, labels=["model_name", "pool"])
                for pool, pool_stats in pools.items():
                    family.add_metric([self.model_name, pool], float(getattr(pool_stats, key)))
                yield family
        pd = stats.pd
        if pd is not None:
            family = CounterMetricFamily(PREFIX + "pd_requests", "Requests by how the PD router served them "
                                         "(pd_requests: prefill then decode; prefill_answers: the prefill's token "
                                         "was the answer; decode_only: prompt logprobs; prefill_fallbacks: the "
                                         "prefill pool failed, computed on a decode engine; prefill_retries, "
                                         "decode_retries: a lost engine's leg given to another).",
                                         labels=["model_name", "path"])
            for path, count in sorted(pd.items()):
                family.add_metric([self.model_name, path], float(count))
            yield family

    def _per_engine(self, engines: list[EngineEntry]):
        """Each engine's own figures, labelled by engine (a replica id under Serve)."""
        labels = ["model_name", "engine_index"]
        for name, value_of, help_text in _PER_ENGINE:
            family = GaugeMetricFamily(PREFIX + "engine_" + name, help_text + " (per engine)", labels=labels)
            for engine in engines:
                value = value_of(engine)
                if value is not None:
                    family.add_metric([self.model_name, engine.label], float(value))
            yield family

    def _routing(self, stats: FleetStats):
        engines = GaugeMetricFamily(PREFIX + "num_engines", "Engines (replicas) known to the router.",
                                    labels=["model_name"])
        engines.add_metric([self.model_name], float(stats.num_engines))
        yield engines
        healthy = GaugeMetricFamily(PREFIX + "num_healthy_engines", "Engines reporting healthy.",
                                    labels=["model_name"])
        healthy.add_metric([self.model_name], float(stats.num_healthy_engines))
        yield healthy
        decisions = stats.routing_decisions
        if decisions is not None:
            family = CounterMetricFamily(PREFIX + "routing_decisions", "Routing decisions of this process's "
                                         "router, by kind (exact routing: exact_hit, offload_hit, miss, stale_fallback; "
                                         "approximate: prefix_affine, prefix_fallback, balanced; single).",
                                         labels=["model_name", "decision"])
            for decision, count in sorted(decisions.items()):
                family.add_metric([self.model_name, decision], float(count))
            yield family
        kv = stats.kv_routing
        if kv is not None:
            yield from self._kv_routing(kv)

    def _kv_views(self, engines: list[EngineEntry]):
        """Per engine and tier: the prefix blocks the router's KV index holds for it, and the blocks the
        engine says it holds (equal while the view is in sync and the engine idle)."""
        views = [(e.label, e.kv_view) for e in engines if e.kv_view]
        if not views:
            return
        labels = ["model_name", "engine_index", "tier"]
        for name, key, help_text in (("engine_kv_index_blocks", "blocks", "Prefix blocks the router's KV index "
                                      "holds for the engine, by tier."),
                                     ("engine_kv_cached_blocks", "engine_blocks", "Prefix blocks the engine "
                                      "reported holding, by tier.")):
            family = GaugeMetricFamily(PREFIX + name, help_text, labels=labels)
            for index, view in views:
                for tier, count in sorted((view.get(key) or {}).items()):
                    family.add_metric([self.model_name, index, tier], float(count))
            yield family

    def _kv_routing(self, kv: dict):
        """Exact routing: the KV index's health and the routers' predicted vs actual cached tokens."""
        labels = ["model_name"]
        stale = GaugeMetricFamily(PREFIX + "kv_index_stale_engines", "Engines whose KV view is stale in this "
                                  "process's router (routed approximately until they resync).", labels=labels)
        stale.add_metric([self.model_name], float(kv.get("stale_engines", 0)))
        yield stale
        for name, key, help_text in _KV_INDEX_COUNTERS:
            family = CounterMetricFamily(PREFIX + name, help_text, labels=labels)
            family.add_metric([self.model_name], float(kv.get(key, 0)))
            yield family
        checks = CounterMetricFamily(PREFIX + "routing_cached_token_predictions", "Requests whose predicted "
                                     "cached tokens were checked against the engine's, by outcome.",
                                     labels=["model_name", "outcome"])
        checked, matched = int(kv.get("checked", 0)), int(kv.get("matched", 0))
        checks.add_metric([self.model_name, "match"], float(matched))
        checks.add_metric([self.model_name, "mismatch"], float(checked - matched))
        yield checks


_KV_INDEX_COUNTERS = (
    ("kv_index_resyncs", "resyncs", "KV views rebuilt from a snapshot."),
    ("kv_index_gaps", "gaps", "Gaps in an engine's KV event sequence numbers (a missed report)."),
    ("kv_index_restarts", "restarts", "Engines seen with a new incarnation (restarted)."),
    ("kv_index_stale_spells", "stale_spells", "Times an engine's KV view went stale."),
    ("kv_index_divergences", "divergences", "KV views found to hold other counts than their engine (resynced)."),
    ("routing_predicted_cached_tokens", "predicted_tokens", "Cached prompt tokens the router predicted."),
    ("routing_actual_cached_tokens", "actual_tokens", "Cached prompt tokens the engines found (predicted requests)."),
)


class ServingMetrics:
    """The metrics of one app. Observe per-request timings; `render()` gives the exposition text."""

    def __init__(self, model_name: str, stats_fn: Callable[[], FleetStats | None], max_model_len: int = 4096) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between streamed outputs.", labels,
                             buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "Time per output token after the first, "
                              "per request: (last token - first token) / (tokens - 1).", labels,
                              buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "End-to-end request latency.", labels,
                             buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        sizes = token_buckets(max_model_len)
        self.prompt_tokens = Histogram(PREFIX + "request_prompt_tokens", "Prompt tokens per request.", labels,
                                       buckets=sizes, registry=self.registry).labels(model_name)
        self.generation_tokens = Histogram(PREFIX + "request_generation_tokens", "Generated tokens per request.",
                                           labels, buckets=sizes, registry=self.registry).labels(model_name)
        self._success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self._errors = Counter(PREFIX + "request_errors", "Requests that failed, by HTTP status.",
                               ["model_name", "status"], registry=self.registry)
        self._lora_requests = Counter(PREFIX + "lora_requests", "Requests by LoRA adapter name.",
                                      ["model_name", "lora_name"], registry=self.registry)
        self.registry.register(EngineStatsCollector(model_name, stats_fn))

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def observe_time_per_output_token(self, seconds: float) -> None:
        self.tpot.observe(seconds)

    def observe_finished(self, e2e_seconds: float, prompt_tokens: int, generation_tokens: int,
                         finish_reason: str | None) -> None:
        self.e2e.observe(e2e_seconds)
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(generation_tokens)
        self._success.labels(self.model_name, finish_reason or "unknown").inc()

    def observe_adapter_request(self, lora_name: str) -> None:
        self._lora_requests.labels(self.model_name, lora_name).inc()

    def observe_error(self, status: int) -> None:
        self._errors.labels(self.model_name, str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
